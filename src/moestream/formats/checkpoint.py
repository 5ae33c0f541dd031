"""A Hugging Face checkpoint directory: config.json plus safetensors (single file or sharded with
model.safetensors.index.json). Tensors are memory-mapped views; nothing is read until used."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError
from .safetensors import MappedFile, TensorInfo, open_regular, read_header

INDEX = "model.safetensors.index.json"


MAX_JSON = 256 * 1024 * 1024  # far above any config or index (a 1T-parameter index is tens of MB)


def read_json(path: Path, what: str) -> Any:
    """The JSON document in path, refused (one line naming the file) unless it is a regular file of
    valid UTF-8 JSON within MAX_JSON bytes."""
    try:
        with open_regular(path, what) as f:
            if os.fstat(f.fileno()).st_size > MAX_JSON:
                raise CheckpointError(f"{path}: {what} is larger than {MAX_JSON:,} bytes")
            raw = f.read()  # not read(MAX_JSON + 1): that reserves the whole bound for every file
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e.strerror}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, or an int too long
        raise CheckpointError(f"{path}: corrupt {what} ({str(e)[:200]})") from None


def read_index(path: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map, {tensor name: shard file name}, each name a plain
    relative path inside the model directory."""
    index = read_json(path, "safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: no weight_map object")
    for name, fname in weight_map.items():
        if not isinstance(fname, str):
            raise CheckpointError(f"{path}: weight_map[{name[:200]!r}] is not a file name")
        check_member_name(path, fname)
    return weight_map


def check_member_name(index_path: Path, fname: str) -> None:
    """A file name from an index must stay in the model directory: relative, no `..` or empty parts,
    printable (no NUL, no lone surrogate). Symlinks in the directory (the Hugging Face cache's, to
    ../../blobs/) are fine: the rule is about the name written in the index."""
    leaves = fname.startswith("/") or "\\" in fname or any(p in ("", "..") for p in fname.split("/"))
    if leaves or not fname.isprintable():
        raise CheckpointError(f"{index_path}: file name {fname[:200]!r} leaves the model directory or is not a name")


class TensorStore:
    """Named tensors with shapes, looked up with errors that name the store and the tensor."""

    path: Path
    tensors: dict[str, TensorInfo]

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name}") from None

    def checked(self, name: str, shape: tuple[int, ...] | None) -> TensorInfo:
        """info(name), refusing a shape other than the one the config implies."""
        info = self.info(name)
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name} has shape {list(info.shape)}, the config implies {list(shape)}"
            )
        return info


class Checkpoint(TensorStore):
    def __init__(self, path: str | Path, preload: bool = False):
        self.path = Path(path)
        self.preload = preload
        if not self.path.exists():
            raise InputError(f"model directory {self.path} does not exist")
        if not self.path.is_dir():
            raise InputError(f"{self.path} is not a model directory")
        cfg_path = self.path / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{self.path}: no config.json in the model directory")
        config = read_json(cfg_path, "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path}: corrupt config.json (not a JSON object)")
        self.config: dict[str, Any] = config
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, MappedFile] = {}
        index_path = self.path / INDEX
        if index_path.exists() or index_path.is_symlink():
            self._read_sharded(index_path)
        else:
            self._read_unindexed()

    def _read_sharded(self, index_path: Path) -> None:
        weight_map = read_index(index_path)
        headers = {}
        for fname in sorted(set(weight_map.values())):
            shard = self.path / fname
            if not shard.exists():
                raise CheckpointError(f"{shard}: shard named in {INDEX} is missing")
            headers[fname] = read_header(shard)
        for name, fname in weight_map.items():
            if name not in headers[fname]:
                raise CheckpointError(f"{self.path / fname}: tensor {name} listed in {INDEX} is not in it")
            self.tensors[name] = headers[fname][name]

    def _read_unindexed(self) -> None:
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no .safetensors files in the model directory")
        for fname in files:
            for name, info in read_header(self.path / fname).items():
                if name in self.tensors:
                    raise CheckpointError(f"{self.path}: tensor {name} appears in two files")
                self.tensors[name] = info

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as a read-only memory-mapped array; with shape, the shape is checked."""
        info = self.checked(name, shape)
        mf = self._maps.get(info.path)
        if mf is None:
            mf = self._maps[info.path] = MappedFile(info.path, self.preload)
        return mf.view(info)

    def mapped_files(self) -> list[tuple[Path, np.ndarray]]:
        """Every shard the model's tensors were taken from, with its whole-file memory map (the tensors
        are views of these: a budgeted run reads the routed experts' ranges from the files themselves)."""
        return [(path, mf.map) for path, mf in self._maps.items()]

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.tensors if n.startswith(prefix)]
