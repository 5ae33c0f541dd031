"""DeepSeek-V3 / Kimi K2 (model_type deepseek_v3 or kimi_k2): MLA attention with optional q LoRA and
YaRN, sigmoid router with e_score_correction_bias for selection only and grouped top-k, shared
experts, and `first_k_dense_replace` dense layers. As transformers' DeepseekV3ForCausalLM."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import MAX_LAYERS, Keys, ModelSpec, RopeSpec, check_experts, check_heads, read_common, read_rope
from ..errors import ConfigError
from ..formats.checkpoint import Checkpoint
from .base import Decoder, DenseMLP, MoE, Rope, SigmoidGroupRouter
from .loading import Tensors

# q_a_layernorm and kv_a_layernorm are built with the RMSNorm default eps in the reference, not
# rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeepseekV3Spec(ModelSpec):
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    rope: RopeSpec | None = None

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        r = self.rope
        if r is not None and r.kind != "default" and r.mscale_all_dim:
            m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0 if r.factor > 1 else 1.0
            scale *= m * m
        return scale


def read_spec(config: dict[str, Any]) -> DeepseekV3Spec:
    k = Keys(config, "config.json")
    common = read_common(k, config["model_type"])
    heads = k.req("num_attention_heads", int)
    check_heads(k, heads, k.opt("num_key_value_heads", int, heads))
    n_experts = k.req("n_routed_experts", int)
    top_k = k.req("num_experts_per_tok", int)
    check_experts(k, n_experts, top_k, "n_routed_experts", common["num_hidden_layers"])
    scoring = k.opt("scoring_func", str, "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported (DeepSeek-V3 uses sigmoid)")
    method = k.opt("topk_method", str, "noaux_tc")
    if method != "noaux_tc":
        raise ConfigError(f"config.json: topk_method {method!r} is not supported (DeepSeek-V3 uses noaux_tc)")
    n_group = k.opt("n_group", int, 1)
    topk_group = k.opt("topk_group", int, 1)
    k.positive("n_group", n_group)
    if n_experts % n_group:
        raise ConfigError(f"config.json: n_routed_experts {n_experts} is not divisible by n_group {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"config.json: topk_group {topk_group} must be between 1 and n_group {n_group}")
    if n_group > 1 and n_experts // n_group < 2:
        raise ConfigError("config.json: grouped routing needs at least 2 experts per group")
    if top_k > topk_group * (n_experts // n_group):
        raise ConfigError(f"config.json: num_experts_per_tok {top_k} exceeds the experts in topk_group groups")
    rope_dim = k.req("qk_rope_head_dim", int)
    k.positive("qk_rope_head_dim", rope_dim)
    if rope_dim % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim {rope_dim} must be even")
    spec = DeepseekV3Spec(
        **common,
        num_attention_heads=heads,
        q_lora_rank=k.opt_none("q_lora_rank", int),
        kv_lora_rank=k.req("kv_lora_rank", int),
        qk_nope_head_dim=k.req("qk_nope_head_dim", int),
        qk_rope_head_dim=rope_dim,
        v_head_dim=k.req("v_head_dim", int),
        intermediate_size=k.req("intermediate_size", int),
        moe_intermediate_size=k.req("moe_intermediate_size", int),
        n_routed_experts=n_experts,
        n_shared_experts=k.opt("n_shared_experts", int, 0),
        num_experts_per_tok=top_k,
        first_k_dense_replace=k.opt("first_k_dense_replace", int, 0),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=k.opt("norm_topk_prob", bool, True),
        routed_scaling_factor=k.opt("routed_scaling_factor", float, 1.0),
        attention_bias=k.opt("attention_bias", bool, False),
        rope=read_rope(k, rope_dim, common["max_position_embeddings"], k.opt("rope_interleave", bool, True)),
    )
    for key in (
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "routed_scaling_factor",
    ):
        k.positive(key, getattr(spec, key))
    if spec.q_lora_rank is not None:
        k.positive("q_lora_rank", spec.q_lora_rank)
    k.non_negative("n_shared_experts", spec.n_shared_experts)
    k.non_negative("first_k_dense_replace", spec.first_k_dense_replace, MAX_LAYERS)
    return spec


def build(ckpt: Checkpoint, s: DeepseekV3Spec) -> Decoder:
    t = Tensors(ckpt)
    E, H = s.hidden_size, s.num_attention_heads
    N, R, V, C = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank
    assert s.rope is not None
    rope = Rope(s.rope)

    blocks = []
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        attn = t.mla(a, E, H, N, R, V, C, s.q_lora_rank, rope, s.softmax_scale, LATENT_NORM_EPS, bias=s.attention_bias)
        m = f"{p}.mlp"
        ffn: DenseMLP | MoE
        if i < s.first_k_dense_replace:
            ffn = t.dense_mlp(m, s.intermediate_size, E)
        else:
            I = s.moe_intermediate_size  # noqa: E741
            router = SigmoidGroupRouter(
                t.weight(f"{m}.gate.weight", s.n_routed_experts, E),
                t.optional_vector(f"{m}.gate.e_score_correction_bias", s.n_routed_experts),
                s.num_experts_per_tok,
                s.n_group,
                s.topk_group,
                s.norm_topk_prob,
                s.routed_scaling_factor,
            )
            experts = t.experts([f"{m}.experts"], ("gate_proj", "up_proj", "down_proj"), s.n_routed_experts, E, I)
            shared = None
            if s.n_shared_experts:
                shared = t.dense_mlp(f"{m}.shared_experts", I * s.n_shared_experts, E)
            ffn = MoE(router, experts, shared)
        blocks.append(t.block(p, attn, ffn, s))
    return t.decoder(blocks, s)
