"""Typed model specs read from config.json. Keys keep their config.json names. A required key that is
missing, a value of the wrong type, or sizes that do not add up are refused with a ConfigError naming
the key; optional keys fall back to the defaults their architecture defines (as transformers does)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")
_MISSING = object()

# Sane bounds, far above any released model, so that a config cannot make `inspect` (which builds every
# layer and expert) run for minutes or ask for absurd shapes.
MAX_LAYERS = 10_000
MAX_VOCAB = 10_000_000
MAX_WIDTH = 1 << 18  # any other size: widths, heads, head dims, ranks, experts per layer
MAX_ROUTED_EXPERTS = 1 << 19  # layers x experts per layer: what inspect and the planner walk
MAX_POSITIONS = 1 << 31
INT64 = 1 << 63
MAX_ROPE_THETA = 1e15
MAX_ROPE_FACTOR = 1e6
BOUNDS = {
    "num_hidden_layers": MAX_LAYERS,
    "vocab_size": MAX_VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    "original_max_position_embeddings": MAX_POSITIONS,
    "sliding_window": MAX_POSITIONS,
}


class Keys:
    """Typed access to a config dict, with errors that name the key."""

    def __init__(self, d: dict[str, Any], where: str):
        self.d = d
        self.where = where

    def _check(self, key: str, v: Any, typ: type) -> Any:
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v) if abs(v) < INT64 else math.inf
        if typ is int and isinstance(v, bool):
            raise ConfigError(f"{self.where}: key {key} must be an integer, got {v!r}")
        if not isinstance(v, typ):
            raise ConfigError(f"{self.where}: key {key} must be {typ.__name__}, got {_short(v)}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{self.where}: key {key} must be a finite number, got {_short(v)}")
        if isinstance(v, int) and not -INT64 <= v < INT64:
            raise ConfigError(f"{self.where}: key {key} is out of range, got {_short(v)}")
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
        """v > 0 and, for a size, within its bound (BOUNDS, else MAX_WIDTH)."""
        if v <= 0:
            raise ConfigError(f"{self.where}: key {key} must be positive, got {v}")
        if isinstance(v, int):
            self.at_most(key, v, BOUNDS.get(key, MAX_WIDTH))

    def within(self, key: str, v: float, low: float, high: float, low_open: bool = False) -> None:
        """low <= v <= high (low < v with low_open)."""
        if not (low < v if low_open else low <= v) or v > high:
            bracket = "(" if low_open else "["
            raise ConfigError(f"{self.where}: key {key} must be in {bracket}{low:g}, {high:g}], got {v}")

    def at_most(self, key: str, v: int, high: int) -> None:
        if v > high:
            raise ConfigError(f"{self.where}: key {key} is {v}, more than the {high:,} moestream accepts")

    def non_negative(self, key: str, v: int, high: int = MAX_WIDTH) -> None:
        if v < 0:
            raise ConfigError(f"{self.where}: key {key} must not be negative, got {v}")
        self.at_most(key, v, high)

    def token_id(self, key: str, v: Any) -> int:
        """A token id: an integer, not negative."""
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < INT64:
            raise ConfigError(f"{self.where}: key {key} must hold token ids (integers >= 0), got {_short(v)}")
        return v

    def token_ids(self, key: str, v: Any) -> tuple[int, ...]:
        """eos_token_id: absent, one id or a list of ids."""
        if v is None:
            return ()
        if isinstance(v, list):
            return tuple(self.token_id(key, x) for x in v)
        return (self.token_id(key, v),)


def _short(v: Any) -> str:
    """A value for an error message, cut short (a hostile config can hold megabytes in one key)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


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
    rk = Keys(merged, f"{k.where} rope parameters")
    theta = rk.opt_none("rope_theta", float)
    if theta is None:
        theta = k.req("rope_theta", float)
    # theta ** (i / dim) is computed in float32, and YaRN divides by log(theta)
    rk.within("rope_theta", theta, 1.0, MAX_ROPE_THETA, low_open=True)
    kind = rk.opt("rope_type", str, rk.opt("type", str, "default"))
    if kind == "default":
        return RopeSpec(theta=theta, dim=dim, interleave=interleave)
    if kind not in ("linear", "yarn"):
        raise ConfigError(f"{k.where}: unsupported rope type {kind!r} (supported: default, linear, yarn)")
    factor = rk.req("factor", float)
    rk.within("factor", factor, 0.0, MAX_ROPE_FACTOR, low_open=True)
    if kind == "linear":
        return RopeSpec(theta, dim, "linear", factor=factor, interleave=interleave)
    original = rk.opt("original_max_position_embeddings", int, k.opt("original_max_position_embeddings", int, max_pos))
    rk.positive("original_max_position_embeddings", original)
    attention_factor = rk.opt_none("attention_factor", float)
    if attention_factor is not None:
        rk.positive("attention_factor", attention_factor)
    betas = {key: rk.opt(key, float, default) or default for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0))}
    mscales = {key: rk.opt(key, float, 0.0) for key in ("mscale", "mscale_all_dim")}
    for key, beta in betas.items():
        rk.within(key, beta, 1e-3, MAX_ROPE_FACTOR)  # YaRN takes the logarithm of max_pos / beta
    for key, mscale in mscales.items():
        rk.within(key, mscale, 0.0, MAX_ROPE_FACTOR)  # YaRN divides by 1 + 0.1 mscale log(factor)
    return RopeSpec(
        theta=theta,
        dim=dim,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=betas["beta_fast"],
        beta_slow=betas["beta_slow"],
        mscale=mscales["mscale"],
        mscale_all_dim=mscales["mscale_all_dim"],
        attention_factor=attention_factor,
        truncate=rk.opt("truncate", bool, True),
        interleave=interleave,
    )


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
        eos_token_ids=k.token_ids("eos_token_id", k.d.get("eos_token_id")),
        hidden_act=k.opt("hidden_act", str, "silu"),
        torch_dtype=read_dtype(k),
    )
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings"):
        value = common[key]
        assert isinstance(value, int | float)
        k.positive(key, value)
    if common["bos_token_id"] is not None:
        k.token_id("bos_token_id", common["bos_token_id"])
    if common["hidden_act"] != "silu":
        raise ConfigError(f"{k.where}: hidden_act {common['hidden_act']!r} is not supported (silu is)")
    return common


def read_dtype(k: Keys) -> str | None:
    """torch_dtype (dtype in transformers >= 5): informative only, but a string when given."""
    key = "torch_dtype" if k.d.get("torch_dtype") else "dtype"
    return k.opt_none(key, str) or None


def check_heads(k: Keys, heads: int, kv_heads: int) -> None:
    k.positive("num_attention_heads", heads)
    k.positive("num_key_value_heads", kv_heads)
    if heads % kv_heads:
        raise ConfigError(f"{k.where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def read_head_dim(k: Keys, hidden: int, heads: int) -> int:
    """A GQA model's head_dim: the key when given (non-zero), else hidden_size / heads; even, for RoPE."""
    head_dim = k.opt("head_dim", int, 0)
    k.non_negative("head_dim", head_dim)
    if not head_dim:
        if hidden % heads:
            raise ConfigError(f"{k.where}: hidden_size is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"{k.where}: head_dim {head_dim} must be even for RoPE")
    return head_dim


def check_experts(k: Keys, n_experts: int, top_k: int, experts_key: str, layers: int) -> None:
    k.positive(experts_key, n_experts)
    k.positive("num_experts_per_tok", top_k)
    if top_k > n_experts:
        raise ConfigError(f"{k.where}: num_experts_per_tok {top_k} exceeds {experts_key} {n_experts}")
    if layers * n_experts > MAX_ROUTED_EXPERTS:
        raise ConfigError(
            f"{k.where}: {layers} layers of {n_experts} experts are more than the "
            f"{MAX_ROUTED_EXPERTS:,} routed experts moestream accepts"
        )
