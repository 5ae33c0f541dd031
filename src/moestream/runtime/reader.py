"""Reads of the packed store's expert file: aligned O_DIRECT preads in C with the GIL released (several
in flight from a small pool of I/O threads), or buffered reads where the file system refuses O_DIRECT
(tmpfs). A failed or short read, or bytes that fail their CRC-32C, is an IntegrityError naming the file
and offset."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import _C
from ..errors import IntegrityError
from ..formats.packed import checks_enabled, mismatch

ALIGN = 4096
FAULT_ENV = "MOESTREAM_FAIL_READ"  # testing: the Nth read (1-based) fails as a short read


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer of nbytes whose start is 4096-aligned (pages are not touched)."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


class BlobReader:
    """Reads of one file or several (a checkpoint's shards): reads name their file by number."""

    def __init__(self, paths: Path | list[Path], io_threads: int = 4):
        self.paths = [Path(p) for p in (paths if isinstance(paths, list) else [paths])]
        self.path = self.paths[0]
        opened = [self._open(p) for p in self.paths]
        self.fds = [fd for fd, _ in opened]
        self.direct_fds = [direct for _, direct in opened]
        self.direct = all(self.direct_fds)  # what the report says: every read bypasses the page cache
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="moestream-io")
        self.reads = 0
        self.bytes_read = 0
        self.seconds = 0.0  # summed over reads (they overlap)
        self._lock = threading.Lock()
        fault = os.environ.get(FAULT_ENV)
        self._fail_at = int(fault) if fault and fault.isdigit() else 0

    @property
    def fd(self) -> int:
        return self.fds[0]

    @staticmethod
    def _open(path: Path) -> tuple[int, bool]:
        """(descriptor, O_DIRECT?): buffered where the file system refuses O_DIRECT (tmpfs)."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            return os.open(path, os.O_RDONLY), False
        probe = aligned_empty(ALIGN)
        try:  # some file systems accept the flag at open and refuse the reads
            _C.pread(fd, probe, 0, ALIGN)
        except OSError:
            os.close(fd)
            return os.open(path, os.O_RDONLY), False
        return fd, True

    def submit(self, offset: int, nbytes: int, into: np.ndarray, crc: int | None = None, file: int = 0) -> Future[None]:
        """Reads nbytes at offset of file number `file` into the buffer `into` (aligned, at least nbytes
        rounded up to 4096) and, given their CRC-32C, checks them in the I/O thread (the GIL is released
        for both)."""
        with self._lock:
            self.reads += 1
            n = self.reads
        return self.pool.submit(self._read, file, offset, nbytes, into, n, crc if checks_enabled() else None)

    def _read(self, file: int, offset: int, nbytes: int, into: np.ndarray, n: int, crc: int | None) -> None:
        path, fd = self.paths[file], self.fds[file]
        length = -(-nbytes // ALIGN) * ALIGN if self.direct_fds[file] else nbytes
        t0 = time.perf_counter()
        try:
            got = _C.pread(fd, into, offset, length)
        except OSError as e:
            raise IntegrityError(f"{path}: read of {nbytes} bytes at offset {offset} failed: {e.strerror}") from None
        if n == self._fail_at:
            got = nbytes // 2  # injected fault (tests)
        if got < nbytes:
            raise IntegrityError(f"{path}: short read at offset {offset}: {got} of {nbytes} bytes")
        if crc is not None and _C.crc32c(into[:nbytes]) != crc:
            raise IntegrityError(mismatch(path, {"offset": offset, "nbytes": nbytes}))
        with self._lock:
            self.bytes_read += nbytes
            self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)


def read_bandwidth(path: Path, block: int, seconds: float = 2.0, in_flight: int = 4) -> tuple[float, bool]:
    """(GB/s, O_DIRECT?) of random aligned reads of `block` bytes from `path`, `in_flight` at a time, as
    the expert cache reads. Blocks are drawn uniformly from the file; with O_DIRECT the page cache does
    not help, without it (tmpfs) the number is a memory copy."""
    size = os.path.getsize(path)
    block = max(ALIGN, min(-(-block // ALIGN) * ALIGN, size // ALIGN * ALIGN))
    if size < block:
        raise ValueError(f"{path}: {size} bytes, too small to measure")
    reader = BlobReader(Path(path), io_threads=in_flight)
    bufs = [aligned_empty(block) for _ in range(in_flight)]
    rng = np.random.default_rng(0)
    top = (size - block) // ALIGN
    total = 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            offs = [int(o) * ALIGN for o in rng.integers(0, top + 1, in_flight)]
            futs = [reader.submit(o, block, b) for o, b in zip(offs, bufs, strict=True)]
            for f in futs:
                f.result()
            total += block * in_flight
    finally:
        reader.close()
    return total / (time.perf_counter() - t0) / 1e9, reader.direct
