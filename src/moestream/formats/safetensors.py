"""Safetensors files: the header is parsed here (not by the safetensors package) because the engine
needs every tensor's absolute byte offset for direct reads, and every size is checked against the file.

Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data region; data_offsets are [begin, end) relative to the data region.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parses and checks a safetensors header; every tensor must lie inside the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} runs past the end of the file ({size} bytes); "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = meta["dtype"]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if begin < 0 or end - begin != nbytes or any(d < 0 for d in shape):
            raise CheckpointError(
                f"{path}: tensor {name} offsets [{begin}, {end}) do not match its shape {list(shape)} {dtype}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name} lies outside the file (ends at byte {data_start + end}, "
                f"file has {size}); the shard is truncated"
            )
        out[name] = TensorInfo(name, dtype, shape, Path(path), data_start + begin, nbytes)
    return out


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


class MappedFile:
    """One read-only memory map per file, shared by all tensor views into it. With preload, every page
    is read and mapped up front (one madvise), so no token pays a page fault."""

    def __init__(self, path: Path, preload: bool = False):
        self.path = path
        try:
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
