"""Mixtral (model_type mixtral): GQA with RoPE, softmax top-k routing always renormalised, experts
w1 (gate), w3 (up), w2 (down). As transformers' MixtralForCausalLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import Keys, ModelSpec, RopeSpec, check_experts, check_heads, read_common, read_head_dim, read_rope
from ..formats.checkpoint import Checkpoint
from .base import Decoder, GQAttention, Linear, MoE, Rope, SoftmaxRouter
from .loading import Tensors


@dataclass(frozen=True)
class MixtralSpec(ModelSpec):
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    sliding_window: int | None = None
    rope: RopeSpec | None = None


def read_spec(config: dict[str, Any]) -> MixtralSpec:
    k = Keys(config, "config.json")
    common = read_common(k, "mixtral")
    heads = k.req("num_attention_heads", int)
    kv_heads = k.req("num_key_value_heads", int)
    check_heads(k, heads, kv_heads)
    n_experts = k.req("num_local_experts", int)
    top_k = k.req("num_experts_per_tok", int)
    check_experts(k, n_experts, top_k, "num_local_experts", common["num_hidden_layers"])
    head_dim = read_head_dim(k, common["hidden_size"], heads)
    intermediate = k.req("intermediate_size", int)
    k.positive("intermediate_size", intermediate)
    window = k.opt_none("sliding_window", int)
    if window is not None:
        k.positive("sliding_window", window)
    return MixtralSpec(
        **common,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
        sliding_window=window,
        rope=read_rope(k, head_dim, common["max_position_embeddings"]),
    )


def build(ckpt: Checkpoint, s: MixtralSpec) -> Decoder:
    t = Tensors(ckpt)
    E, H, KV, D = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
    assert s.rope is not None
    rope = Rope(s.rope)
    blocks = []
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        attn = GQAttention(
            Linear(t.weight(f"{a}.q_proj.weight", H * D, E)),
            Linear(t.weight(f"{a}.k_proj.weight", KV * D, E)),
            Linear(t.weight(f"{a}.v_proj.weight", KV * D, E)),
            Linear(t.weight(f"{a}.o_proj.weight", E, H * D)),
            H,
            KV,
            D,
            rope,
            sliding_window=s.sliding_window,
        )
        # Released checkpoints: block_sparse_moe.*; transformers >= 5 may also write mlp.*.
        moe = f"{p}.block_sparse_moe" if t.has(f"{p}.block_sparse_moe.gate.weight") else f"{p}.mlp"
        router = SoftmaxRouter(
            t.weight(f"{moe}.gate.weight", s.num_local_experts, E), s.num_experts_per_tok, renormalize=True
        )
        experts = t.experts([f"{moe}.experts"], ("w1", "w3", "w2"), s.num_local_experts, E, s.intermediate_size)
        blocks.append(t.block(p, attn, MoE(router, experts, None), s))
    return t.decoder(blocks, s)
