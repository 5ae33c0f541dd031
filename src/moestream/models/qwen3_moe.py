"""Qwen3-MoE (model_type qwen3_moe): GQA with per-head q/k RMSNorm and RoPE, softmax top-k routing,
dense layers where `mlp_only_layers` / `decoder_sparse_step` say. As transformers' Qwen3MoeForCausalLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import Keys, ModelSpec, RopeSpec, check_experts, check_heads, read_common, read_head_dim, read_rope
from ..errors import ConfigError
from ..formats.checkpoint import Checkpoint
from .base import Decoder, DenseMLP, GQAttention, Linear, MoE, Rope, SoftmaxRouter
from .loading import Tensors


@dataclass(frozen=True)
class Qwen3MoeSpec(ModelSpec):
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    attention_bias: bool = False
    sliding_window: int | None = None
    rope: RopeSpec | None = None

    def is_sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )


def read_spec(config: dict[str, Any]) -> Qwen3MoeSpec:
    k = Keys(config, "config.json")
    common = read_common(k, "qwen3_moe")
    heads = k.req("num_attention_heads", int)
    kv_heads = k.req("num_key_value_heads", int)
    check_heads(k, heads, kv_heads)
    # The released configs say num_experts; transformers >= 5 saves num_local_experts.
    n_experts_key = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
    n_experts = k.req(n_experts_key, int)
    top_k = k.req("num_experts_per_tok", int)
    check_experts(k, n_experts, top_k, n_experts_key, common["num_hidden_layers"])
    head_dim = read_head_dim(k, common["hidden_size"], heads)
    step = k.opt("decoder_sparse_step", int, 1)
    k.positive("decoder_sparse_step", step)
    window = k.opt_none("sliding_window", int) if k.opt("use_sliding_window", bool, False) else None
    if window is not None:
        k.positive("sliding_window", window)
    spec = Qwen3MoeSpec(
        **common,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=k.req("intermediate_size", int),
        moe_intermediate_size=k.req("moe_intermediate_size", int),
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=k.opt("norm_topk_prob", bool, False),
        decoder_sparse_step=step,
        mlp_only_layers=_layer_list(k, "mlp_only_layers"),
        attention_bias=k.opt("attention_bias", bool, False),
        sliding_window=window,
        rope=read_rope(k, head_dim, common["max_position_embeddings"]),
    )
    for key in ("intermediate_size", "moe_intermediate_size"):
        k.positive(key, getattr(spec, key))
    return spec


def _layer_list(k: Keys, key: str) -> tuple[int, ...]:
    """A list of zero-based layer numbers (numbers past the last layer name no layer, as in transformers)."""
    layers = k.opt(key, list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        raise ConfigError(f"config.json: {key} may hold only layer numbers (0 for the first layer)")
    return tuple(layers)


def build(ckpt: Checkpoint, s: Qwen3MoeSpec) -> Decoder:
    t = Tensors(ckpt)
    E, H, KV, D = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
    assert s.rope is not None
    rope = Rope(s.rope)

    def lin(name: str, rows: int, cols: int) -> Linear:
        b = t.vector(f"{name}.bias", rows) if s.attention_bias else None
        return Linear(t.weight(f"{name}.weight", rows, cols), b)

    blocks = []
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        attn = GQAttention(
            lin(f"{a}.q_proj", H * D, E),
            lin(f"{a}.k_proj", KV * D, E),
            lin(f"{a}.v_proj", KV * D, E),
            lin(f"{a}.o_proj", E, H * D),
            H,
            KV,
            D,
            rope,
            q_norm=t.vector(f"{a}.q_norm.weight", D),
            k_norm=t.vector(f"{a}.k_norm.weight", D),
            norm_eps=s.rms_norm_eps,
            sliding_window=s.sliding_window,
        )
        m = f"{p}.mlp"
        ffn: DenseMLP | MoE
        if s.is_sparse(i):
            I = s.moe_intermediate_size  # noqa: E741
            router = SoftmaxRouter(
                t.weight(f"{m}.gate.weight", s.num_experts, E), s.num_experts_per_tok, s.norm_topk_prob
            )
            experts = t.experts([f"{m}.experts"], ("gate_proj", "up_proj", "down_proj"), s.num_experts, E, I)
            ffn = MoE(router, experts, None)
        else:
            ffn = t.dense_mlp(m, s.intermediate_size, E)
        blocks.append(t.block(p, attn, ffn, s))
    return t.decoder(blocks, s)
