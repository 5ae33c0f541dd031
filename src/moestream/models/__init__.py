"""One module per architecture family; dispatch is by config.json's model_type."""

from __future__ import annotations

import importlib
from typing import Any

from ..config import ModelSpec
from ..errors import ConfigError
from ..formats.checkpoint import Checkpoint
from .base import Model

ARCHITECTURES = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "kimi_linear": "kimi_linear",
    "kimi_k3": "kimi_k3",
}


def _module(model_type: Any) -> Any:
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(f"config.json: unknown model_type {model_type!r} (supported: {known})")
    return importlib.import_module(f".{ARCHITECTURES[model_type]}", __name__)


def read_spec(config: dict[str, Any]) -> ModelSpec:
    if not isinstance(config, dict):
        raise ConfigError("config.json: not a JSON object")
    spec: ModelSpec = _module(config.get("model_type")).read_spec(config)
    return spec


def build(ckpt: Checkpoint, spec: ModelSpec) -> Model:
    model: Model = _module(spec.model_type).build(ckpt, spec)
    return model
