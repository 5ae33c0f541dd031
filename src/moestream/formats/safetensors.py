"""Safetensors files: the header is parsed here (not by the safetensors package) because the engine
needs every tensor's absolute byte offset for direct reads, and every size is checked against the file.

Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data region; data_offsets are [begin, end) relative to the data region.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

# safetensors dtype name -> numpy dtype
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def open_regular(path: Path, what: str) -> BinaryIO:
    """path opened for reading, refused unless it is a regular file (after symlinks). Opened without
    blocking, so a FIFO or a device named like a model file is refused instead of hanging the load."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise CheckpointError(f"{path}: cannot read {what}: {getattr(e, 'strerror', None) or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: {what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parses and checks a safetensors header; every tensor must lie inside the file, and no two overlap."""
    try:
        with open_regular(path, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} runs past the end of the file ({size} bytes) or past "
                    f"{MAX_HEADER:,}; the file is truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    if len(raw) < n:
        raise CheckpointError(f"{path}: truncated safetensors header (the file shrank while read)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, or an int too long
        raise CheckpointError(f"{path}: corrupt safetensors header ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    if not isinstance(header.get("__metadata__", {}), dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _header_entry(path, name, meta)
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name} offsets [{begin}, {end}) do not match its shape {list(shape)} {dtype}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name} lies outside the file (ends at byte {data_start + end}, "
                f"file has {size}); the shard is truncated"
            )
        out[name] = TensorInfo(name, dtype, shape, Path(path), data_start + begin, nbytes)
    _refuse_overlaps(path, out)
    return out


def _header_entry(path: Path, name: str, meta: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each of the type and range safetensors allows."""

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt header entry for tensor {name[:200]} ({why})")

    if not isinstance(meta, dict):
        raise corrupt("not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise corrupt("dtype is not a string")
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name[:200]} has unsupported dtype {dtype[:40]}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise corrupt("shape is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets):
        raise corrupt("data_offsets is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise corrupt(f"data_offsets [{begin}, {end}) end before they begin")
    return dtype, tuple(shape), begin, end


def _is_size(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def _refuse_overlaps(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """Two tensors sharing bytes is a corrupt header (the spec forbids it; a write to one would change
    the other)."""
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in tensors.values() if i.nbytes)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {first} and {second} overlap in the file")


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


class MappedFile:
    """One read-only memory map per file, shared by all tensor views into it. With preload, every page
    is read and mapped up front (one madvise), so no token pays a page fault."""

    def __init__(self, path: Path, preload: bool = False):
        self.path = path
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            self.map = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot map: {e}") from None
        m = getattr(self.map, "_mmap", None)
        if preload and m is not None:
            try:
                m.madvise(MADV_POPULATE_READ)
            except (OSError, ValueError):  # older kernel: at least start reading ahead
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    m.madvise(mmap.MADV_WILLNEED)

    def view(self, info: TensorInfo) -> np.ndarray:
        raw = self.map[info.offset : info.offset + info.nbytes]
        return raw.view(info.np_dtype).reshape(info.shape)


def write_file(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes a safetensors file atomically (temporary name, then rename)."""

    def keep(v: np.ndarray) -> Callable[[], np.ndarray]:
        return lambda: v

    write_streaming(path, [(k, DTYPE_NAMES[v.dtype], v.shape, keep(v)) for k, v in tensors.items()], metadata)


def write_streaming(
    path: Path,
    entries: Sequence[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes tensors one at a time: entries are (name, dtype, shape, make) where make() returns the
    array, so a file larger than RAM can be written. Atomic: temporary name, then rename."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data region 8-byte aligned
    from ..atomic import atomic_write

    with atomic_write(Path(path)) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape, make in entries:
            arr = np.ascontiguousarray(make())
            if arr.shape != tuple(shape) or arr.dtype != DTYPES[dtype]:
                raise ValueError(f"{name}: made {arr.dtype} {arr.shape}, declared {dtype} {shape}")
            f.write(arr.reshape(-1).view(np.uint8).data)  # its bytes, not a copy of them
