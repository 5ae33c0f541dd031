"""What tensors an architecture reads, with their shapes, found by running its builder against a
stand-in checkpoint (so the names live in one place per architecture); and the parameter and byte
counts `moestream inspect` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import build, read_spec


class _Recorder:
    """A stand-in checkpoint that records every tensor the builder asks for, and its shape. Arrays are
    shared zero buffers per shape (calloc: no memory is touched)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.path = Path("<config>")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._zeros: dict[tuple[tuple[int, ...], Any], np.ndarray] = {}

    def has(self, name: str) -> bool:
        return True

    def info(self, name: str) -> Any:
        class _Info:
            dtype = "F32"

        return _Info()

    def array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        assert shape is not None
        shape = tuple(int(d) for d in shape)
        self.shapes[name] = shape
        dtype = np.uint8 if name.endswith((".weight_packed", ".weight_scale")) else np.float32
        key = (shape, dtype)
        if key not in self._zeros:
            try:
                self._zeros[key] = np.zeros(shape if len(shape) else (1,), dtype)
            except MemoryError:  # the config's sizes are within bounds but their product is not
                raise ConfigError(f"config.json: tensor {name} of shape {list(shape)} is too large") from None
        return self._zeros[key]


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of everything the architecture of config reads, in the builder's order."""
    rec = _Recorder(config)
    build(rec, read_spec(config))  # type: ignore[arg-type]
    return rec.shapes


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_experts" not in name


def n_params(name: str, shape: tuple[int, ...]) -> int:
    """Parameters a tensor holds: an MXFP4 weight_packed [r, c/2] holds r*c; its scales hold none."""
    if name.endswith(".weight_scale") or name.endswith("weight_scale_inv"):
        return 0
    n = math.prod(shape)
    return 2 * n if name.endswith(".weight_packed") else n


@dataclass
class Inventory:
    total_params: int
    active_params: int
    trunk_params: int
    expert_params: int
    n_experts: int  # routed experts in the whole model
    top_k: int
    moe_layers: int


def inventory(config: dict[str, Any]) -> Inventory:
    spec: Any = read_spec(config)
    shapes = tensor_shapes(config)
    trunk = sum(n_params(n, s) for n, s in shapes.items() if not is_routed_expert(n))
    experts = sum(n_params(n, s) for n, s in shapes.items() if is_routed_expert(n))
    per_layer: dict[str, set[str]] = {}
    for n in shapes:
        if is_routed_expert(n):
            layer, _, rest = n.partition(".experts.")
            per_layer.setdefault(layer, set()).add(rest.split(".")[0])
    n_experts = sum(len(v) for v in per_layer.values())
    top_k = int(getattr(spec, "num_experts_per_token", 0) or getattr(spec, "num_experts_per_tok", 0))
    per_expert = experts // n_experts if n_experts else 0
    active = trunk + len(per_layer) * top_k * per_expert
    return Inventory(trunk + experts, active, trunk, experts, n_experts, top_k, len(per_layer))


def layer_map(spec: Any) -> str:
    """One letter per layer: K = KDA, M = MLA, G = GQA attention; lower case = dense FFN (no experts)."""
    n = spec.num_hidden_layers
    kinds = getattr(spec, "layer_types", None)
    if kinds:
        attn = ["K" if k == "kda" else "M" for k in kinds]
    else:
        attn = ["M" if hasattr(spec, "kv_lora_rank") else "G"] * n
    dense: list[bool]
    if hasattr(spec, "mlp_layer_types") and spec.mlp_layer_types:
        dense = [t == "dense" for t in spec.mlp_layer_types]
    elif hasattr(spec, "first_k_dense_replace"):
        dense = [i < spec.first_k_dense_replace for i in range(n)]
    elif hasattr(spec, "is_sparse"):
        dense = [not spec.is_sparse(i) for i in range(n)]
    else:
        dense = [False] * n
    letters = [a.lower() if d else a for a, d in zip(attn, dense, strict=True)]
    return " ".join("".join(letters[i : i + 12]) for i in range(0, n, 12))
