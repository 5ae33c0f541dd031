"""Typed model specs read from config.json. Keys keep their config.json names. A required key that is
missing, a value of the wrong type, or sizes that do not add up are refused with a ConfigError naming
the key; optional keys fall back to the defaults their architecture defines (as transformers does)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")
_MISSING = object()


class Keys:
    """Typed access to a config dict, with errors that name the key."""

    def __init__(self, d: dict[str, Any], where: str):
        self.d = d
        self.where = where

    def _check(self, key: str, v: Any, typ: type) -> Any:
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if typ is int and isinstance(v, bool):
            raise ConfigError(f"{self.where}: key {key} must be an integer, got {v!r}")
        if not isinstance(v, typ):
            raise ConfigError(f"{self.where}: key {key} must be {typ.__name__}, got {v!r}")
        return v

    def req(self, key: str, typ: type[T]) -> T:
        v = self.d.get(key, _MISSING)
        if v is _MISSING or v is None:
            raise ConfigError(f"{self.where}: missing required key {key}")
        return self._check(key, v, typ)

    def opt(self, key: str, typ: type[T], default: T) -> T:
        v = self.d.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        return self._check(key, v, typ)

    def opt_none(self, key: str, typ: type[T]) -> T | None:
        v = self.d.get(key, _MISSING)
        if v is _MISSING or v is None:
            return None
        return self._check(key, v, typ)

    def positive(self, key: str, v: int | float) -> None:
        if v <= 0:
            raise ConfigError(f"{self.where}: key {key} must be positive, got {v}")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    dim: int  # rotated dims per head
    kind: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = False  # DeepSeek: rotary pairs (x0, x1), (x2, x3), ...


def read_rope(k: Keys, dim: int, max_pos: int, interleave: bool = False) -> RopeSpec:
    """rope_parameters (transformers >= 5) or rope_theta + rope_scaling (the released configs)."""
    params = k.d.get("rope_parameters") or {}
    scaling = k.d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{k.where}: rope_parameters / rope_scaling must be objects")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", k.d.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{k.where}: missing required key rope_theta")
    kind = merged.get("rope_type", merged.get("type", "default"))
    rk = Keys(merged, f"{k.where} rope parameters")
    if kind == "default":
        return RopeSpec(theta=float(theta), dim=dim, interleave=interleave)
    if kind == "linear":
        return RopeSpec(float(theta), dim, "linear", factor=rk.req("factor", float), interleave=interleave)
    if kind == "yarn":
        return RopeSpec(
            theta=float(theta),
            dim=dim,
            kind="yarn",
            factor=rk.req("factor", float),
            original_max_position_embeddings=rk.opt(
                "original_max_position_embeddings",
                int,
                k.opt("original_max_position_embeddings", int, max_pos),
            ),
            beta_fast=rk.opt("beta_fast", float, 32.0) or 32.0,
            beta_slow=rk.opt("beta_slow", float, 1.0) or 1.0,
            mscale=rk.opt("mscale", float, 0.0),
            mscale_all_dim=rk.opt("mscale_all_dim", float, 0.0),
            attention_factor=rk.opt_none("attention_factor", float),
            truncate=rk.opt("truncate", bool, True),
            interleave=interleave,
        )
    raise ConfigError(f"{k.where}: unsupported rope type {kind!r} (supported: default, linear, yarn)")


@dataclass(frozen=True)
class ModelSpec:
    """What every architecture has."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str
    torch_dtype: str | None = field(default=None)


def _eos(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def read_common(k: Keys, model_type: str) -> dict[str, Any]:
    common = dict(
        model_type=model_type,
        vocab_size=k.req("vocab_size", int),
        hidden_size=k.req("hidden_size", int),
        num_hidden_layers=k.req("num_hidden_layers", int),
        rms_norm_eps=k.req("rms_norm_eps", float),
        tie_word_embeddings=k.opt("tie_word_embeddings", bool, False),
        max_position_embeddings=k.opt("max_position_embeddings", int, 4096),
        bos_token_id=k.opt_none("bos_token_id", int),
        eos_token_ids=_eos(k.d.get("eos_token_id")),
        hidden_act=k.opt("hidden_act", str, "silu"),
        torch_dtype=k.d.get("torch_dtype") or k.d.get("dtype"),
    )
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps"):
        value = common[key]
        assert isinstance(value, int | float)
        k.positive(key, value)
    if common["hidden_act"] != "silu":
        raise ConfigError(f"{k.where}: hidden_act {common['hidden_act']!r} is not supported (silu is)")
    return common


def check_heads(k: Keys, heads: int, kv_heads: int) -> None:
    k.positive("num_attention_heads", heads)
    k.positive("num_key_value_heads", kv_heads)
    if heads % kv_heads:
        raise ConfigError(f"{k.where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def check_experts(k: Keys, n_experts: int, top_k: int, experts_key: str) -> None:
    k.positive(experts_key, n_experts)
    k.positive("num_experts_per_tok", top_k)
    if top_k > n_experts:
        raise ConfigError(f"{k.where}: num_experts_per_tok {top_k} exceeds {experts_key} {n_experts}")
