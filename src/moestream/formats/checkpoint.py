"""A Hugging Face checkpoint directory: config.json plus safetensors (single file or sharded with
model.safetensors.index.json). Tensors are memory-mapped views; nothing is read until used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError
from .safetensors import MappedFile, TensorInfo, read_header

INDEX = "model.safetensors.index.json"


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt {what} ({e})") from None


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
        if index_path.exists():
            index = read_json(index_path, "safetensors index")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: no weight_map")
            files = sorted(set(weight_map.values()))
            headers = {}
            for fname in files:
                shard = self.path / fname
                if not shard.exists():
                    raise CheckpointError(f"{shard}: shard named in {INDEX} is missing")
                headers[fname] = read_header(shard)
            for name, fname in weight_map.items():
                if name not in headers[fname]:
                    raise CheckpointError(f"{self.path / fname}: tensor {name} listed in {INDEX} is not in it")
                self.tensors[name] = headers[fname][name]
        else:
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

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.tensors if n.startswith(prefix)]
