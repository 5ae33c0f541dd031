"""Kimi Linear (model_type kimi_linear, the 48B-A3B style, as transformers' KimiLinearForCausalLM):
KDA layers and NoPE MLA layers as `linear_attn_config` (one-based layer lists) or `layer_types` say,
dense first layers, sigmoid-routed MoE with e_score_correction_bias and shared experts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import MAX_LAYERS, Keys, ModelSpec, check_experts, check_heads, read_common
from ..errors import ConfigError
from ..formats.checkpoint import Checkpoint
from .base import Ctx, Decoder, DenseMLP, Linear, MLAttention, MoE, SigmoidGroupRouter
from .kda import KDAttention
from .loading import Tensors

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, as in the reference


@dataclass(frozen=True)
class KimiLinearSpec(ModelSpec):
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    linear_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 4
    layer_types: tuple[str, ...] = ()  # "kda" | "mla" per layer
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer


def layers_from_lists(lac: dict[str, Any], n: int) -> tuple[str, ...]:
    """ "kda" | "mla" per layer from linear_attn_config's one-based full_attn_layers and kda_layers."""
    lk = Keys(lac, "config.json linear_attn_config")
    types: list[str | None] = [None] * n
    for key, kind in (("full_attn_layers", "mla"), ("kda_layers", "kda")):
        for one_based in lk.req(key, list):
            if not isinstance(one_based, int) or not 1 <= one_based <= n:
                raise ConfigError(f"config.json: linear_attn_config.{key} has layer {one_based!r} outside 1..{n}")
            if types[one_based - 1] is not None:
                raise ConfigError(f"config.json: layer {one_based} is both a KDA and an MLA layer")
            types[one_based - 1] = kind
    if None in types:
        missing = types.index(None) + 1
        raise ConfigError(f"config.json: layer {missing} is in neither full_attn_layers nor kda_layers")
    return tuple(t for t in types if t is not None)


def _layer_types(k: Keys, n: int) -> tuple[str, ...]:
    lac = k.d.get("linear_attn_config") or {}
    if isinstance(lac, dict) and "full_attn_layers" in lac and "kda_layers" in lac:
        return layers_from_lists(lac, n)
    names = k.d.get("layer_types")
    if isinstance(names, list) and len(names) == n:
        mapping = {"full_attention": "mla", "linear_attention": "kda"}
        if any(x not in mapping for x in names):
            raise ConfigError(f"config.json: layer_types may hold only {sorted(mapping)}")
        return tuple(mapping[x] for x in names)
    raise ConfigError("config.json: missing required key linear_attn_config (full_attn_layers, kda_layers)")


def read_spec(config: dict[str, Any]) -> KimiLinearSpec:
    k = Keys(config, "config.json")
    common = read_common(k, "kimi_linear")
    n_layers = common["num_hidden_layers"]
    heads = k.req("num_attention_heads", int)
    check_heads(k, heads, k.opt("num_key_value_heads", int, heads))
    n_experts = k.req("num_experts", int)
    top_k = k.req("num_experts_per_token", int)
    check_experts(k, n_experts, top_k, "num_experts", n_layers)
    act = k.opt("moe_router_activation_func", str, "sigmoid")
    if act != "sigmoid":
        raise ConfigError(f"config.json: moe_router_activation_func {act!r} is not supported (sigmoid is)")
    n_group = k.opt("num_expert_group", int, 1)
    topk_group = k.opt("topk_group", int, 1)
    if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"config.json: num_expert_group {n_group} / topk_group {topk_group} do not fit {n_experts}")
    lac = k.d.get("linear_attn_config") or {}
    lk = Keys(lac if isinstance(lac, dict) else {}, "config.json linear_attn_config")
    linear_heads = lk.opt("num_heads", int, 0) or k.req("linear_num_heads", int)
    linear_head_dim = lk.opt("head_dim", int, 0) or k.req("linear_head_dim", int)
    conv_kernel = lk.opt("short_conv_kernel_size", int, 0) or k.opt("linear_conv_kernel_dim", int, 4)
    mlp_types = k.d.get("mlp_layer_types")
    if isinstance(mlp_types, list) and len(mlp_types) == n_layers:
        if any(x not in ("dense", "sparse") for x in mlp_types):
            raise ConfigError("config.json: mlp_layer_types may hold only dense and sparse")
        mlp_layer_types = tuple(mlp_types)
    else:
        first_dense = k.req("first_k_dense_replace", int)
        k.non_negative("first_k_dense_replace", first_dense, MAX_LAYERS)
        mlp_layer_types = tuple("dense" if i < first_dense else "sparse" for i in range(n_layers))
    if k.opt("mla_use_nope", bool, True) is not True:
        raise ConfigError("config.json: mla_use_nope false (rotary MLA) is not supported for kimi_linear")
    spec = KimiLinearSpec(
        **common,
        num_attention_heads=heads,
        q_lora_rank=k.opt_none("q_lora_rank", int),
        kv_lora_rank=k.req("kv_lora_rank", int),
        qk_nope_head_dim=k.req("qk_nope_head_dim", int),
        qk_rope_head_dim=k.req("qk_rope_head_dim", int),
        v_head_dim=k.req("v_head_dim", int),
        intermediate_size=k.req("intermediate_size", int),
        moe_intermediate_size=k.req("moe_intermediate_size", int),
        num_experts=n_experts,
        num_experts_per_token=top_k,
        num_shared_experts=k.opt("num_shared_experts", int, 0),
        num_expert_group=n_group,
        topk_group=topk_group,
        moe_renormalize=k.opt("moe_renormalize", bool, True),
        routed_scaling_factor=k.opt("routed_scaling_factor", float, 1.0),
        linear_heads=linear_heads,
        linear_head_dim=linear_head_dim,
        conv_kernel=conv_kernel,
        layer_types=_layer_types(k, n_layers),
        mlp_layer_types=mlp_layer_types,
    )
    for key in (
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "linear_heads",
        "linear_head_dim",
        "conv_kernel",
        "routed_scaling_factor",
    ):
        k.positive(key, getattr(spec, key))
    if spec.q_lora_rank is not None:
        k.positive("q_lora_rank", spec.q_lora_rank)
    k.non_negative("qk_rope_head_dim", spec.qk_rope_head_dim)
    k.non_negative("num_shared_experts", spec.num_shared_experts)
    return spec


def conv_weights(t: Tensors, a: str, P: int, K: int) -> np.ndarray:
    """[3P, K]: q, k, v short-convolution weights, fused ({a}.conv1d) or one per projection."""
    if t.has(f"{a}.q_conv1d.weight"):
        parts = [np.asarray(t.ckpt.array(f"{a}.{n}_conv1d.weight", (P, 1, K)), np.float32) for n in "qkv"]
        return np.concatenate(parts).reshape(3 * P, K)
    return np.asarray(t.ckpt.array(f"{a}.conv1d.weight", (3 * P, 1, K)), np.float32).reshape(3 * P, K)


def per_head(t: Tensors, name: str, heads: int) -> np.ndarray:
    """A per-head parameter stored in any shape with `heads` values (A_log is [1, 1, H, 1])."""
    stored = getattr(t.ckpt.info(name), "shape", None)
    shape = tuple(stored) if stored is not None and math.prod(stored) == heads else (1, 1, heads, 1)
    return np.asarray(t.ckpt.array(name, shape), np.float32).reshape(-1)


def kda_attention(
    t: Tensors,
    a: str,
    E: int,
    heads: int,
    head_dim: int,
    conv_kernel: int,
    eps: float,
    gate: Callable[[np.ndarray, Ctx], np.ndarray],
    a_log: np.ndarray,
    gate_lower_bound: float | None = None,
) -> KDAttention:
    """A KDA layer's tensors under {a} (self_attn): q/k/v/o projections, short convolutions, the decay
    gate's f_a/f_b/dt_bias, beta's b_proj and the output norm; the output gate and A_log come in."""
    P = heads * head_dim

    def lin(name: str, rows: int, cols: int) -> Linear:
        return Linear(t.weight(f"{name}.weight", rows, cols))

    return KDAttention(
        q=lin(f"{a}.q_proj", P, E),
        k=lin(f"{a}.k_proj", P, E),
        v=lin(f"{a}.v_proj", P, E),
        conv=conv_weights(t, a, P, conv_kernel),
        f_a=lin(f"{a}.f_a_proj", head_dim, E),
        f_b=lin(f"{a}.f_b_proj", P, head_dim),
        dt_bias=t.vector(f"{a}.dt_bias", P),
        a_log=a_log,
        b=lin(f"{a}.b_proj", heads, E),
        gate=gate,
        o_norm=t.vector(f"{a}.o_norm.weight", head_dim),
        o=lin(f"{a}.o_proj", E, P),
        heads=heads,
        head_dim=head_dim,
        eps=eps,
        gate_lower_bound=gate_lower_bound,
    )


class LowRankGate:
    """g_b(g_a(x)): Kimi Linear's output gate."""

    def __init__(self, a: Linear, b: Linear):
        self.a, self.b = a, b

    def __call__(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        return self.b(self.a(x, ctx), ctx)


def build(ckpt: Checkpoint, s: KimiLinearSpec) -> Decoder:
    t = Tensors(ckpt)
    E, H = s.hidden_size, s.num_attention_heads
    N, R, V, C = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank
    LH, LD = s.linear_heads, s.linear_head_dim
    P = LH * LD

    def lin(name: str, rows: int, cols: int) -> Linear:
        return Linear(t.weight(f"{name}.weight", rows, cols))

    blocks = []
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        attn: KDAttention | MLAttention
        if s.layer_types[i] == "kda":
            gate = LowRankGate(lin(f"{a}.g_a_proj", LD, E), lin(f"{a}.g_b_proj", P, LD))
            attn = kda_attention(t, a, E, LH, LD, s.conv_kernel, s.rms_norm_eps, gate, per_head(t, f"{a}.A_log", LH))
        else:
            # NoPE: the k_r part is shared by all heads but never rotated
            attn = t.mla(a, E, H, N, R, V, C, s.q_lora_rank, None, (N + R) ** -0.5, LATENT_NORM_EPS)
        # Released checkpoints: mlp.* for dense layers, block_sparse_moe.* for MoE; transformers
        # saves both as block_sparse_moe.*.
        moe = f"{p}.block_sparse_moe"
        ffn: DenseMLP | MoE
        if s.mlp_layer_types[i] == "dense":
            dense = f"{p}.mlp" if t.has(f"{p}.mlp.gate_proj.weight") else moe
            ffn = t.dense_mlp(dense, s.intermediate_size, E)
        else:
            I = s.moe_intermediate_size  # noqa: E741
            router = SigmoidGroupRouter(
                t.weight(f"{moe}.gate.weight", s.num_experts, E),
                t.optional_vector(f"{moe}.gate.e_score_correction_bias", s.num_experts),
                s.num_experts_per_token,
                s.num_expert_group,
                s.topk_group,
                s.moe_renormalize,
                s.routed_scaling_factor,
            )
            experts = t.experts([f"{moe}.experts", f"{p}.mlp.experts"], ("w1", "w3", "w2"), s.num_experts, E, I)
            shared = t.dense_mlp(f"{moe}.shared_experts", I * s.num_shared_experts, E) if s.num_shared_experts else None
            ffn = MoE(router, experts, shared)
        blocks.append(t.block(p, attn, ffn, s))
    return t.decoder(blocks, s)
