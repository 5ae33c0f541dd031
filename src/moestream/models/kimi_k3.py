"""Kimi K3 (model_type kimi_k3), exactly as ../shared/specs/kimi_k3.md describes it: attention
residuals over blocks of `attn_res_block_size` layers, KDA with gate_lower_bound and a full-rank output
gate, gated NoPE MLA (latent-only cache, absorbed decode), SiTU-GLU everywhere, a dense layer 0, and the
latent MoE (route on the full width, experts in the latent with MXFP4 weights, RMSNorm on the aggregate,
shared experts on the full width added unweighted). Tensor names start with `language_model.`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import MAX_LAYERS, Keys, ModelSpec, check_experts, check_heads, read_dtype
from ..errors import CheckpointError, ConfigError
from ..formats.checkpoint import Checkpoint
from .base import (
    Attention,
    Ctx,
    DenseMLP,
    Expert,
    ExpertSource,
    Glu,
    Linear,
    Rows,
    SigmoidGroupRouter,
    State,
    TrunkHooks,
    attend,
    expert_source,
    mix_experts,
    rms_norm,
    sigmoid,
    softmax,
)
from .kimi_linear import kda_attention, layers_from_lists
from .loading import Tensors

PREFIX = "language_model.model."
HEAD = "language_model.lm_head.weight"


@dataclass(frozen=True)
class KimiK3Spec(ModelSpec):
    situ_beta: float = 4.0  # activation_situ_beta, beta1
    situ_linear_beta: float = 25.0  # activation_situ_linear_beta, beta2
    intermediate_size: int = 0
    first_k_dense_replace: int = 1
    attn_res_block_size: int = 12
    num_attention_heads: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_output_gate: bool = True
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    routed_expert_hidden_size: int = 0  # L
    moe_intermediate_size: int = 0  # I
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    linear_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 4
    gate_lower_bound: float | None = None
    layer_types: tuple[str, ...] = ()  # "kda" | "mla"


def read_spec(config: dict[str, Any]) -> KimiK3Spec:
    top = Keys(config, "config.json")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: missing required key text_config")
    k = Keys(text, "config.json text_config")
    act = k.req("hidden_act", str)
    if act != "situ":
        raise ConfigError(f"config.json text_config: hidden_act {act!r} is not supported for kimi_k3 (situ is)")
    if k.req("mla_use_nope", bool) is not True:
        raise ConfigError("config.json text_config: mla_use_nope false is not supported (Kimi K3 has no RoPE)")
    for key, want in (("moe_router_activation_func", "sigmoid"), ("topk_method", "noaux_tc")):
        got = k.opt(key, str, want)
        if got != want:
            raise ConfigError(f"config.json text_config: {key} {got!r} is not supported ({want} is)")
    n_layers = k.req("num_hidden_layers", int)
    heads = k.req("num_attention_heads", int)
    check_heads(k, heads, k.opt("num_key_value_heads", int, heads))
    n_experts, top_k = k.req("num_experts", int), k.req("num_experts_per_token", int)
    k.positive("num_hidden_layers", n_layers)
    check_experts(k, n_experts, top_k, "num_experts", n_layers)
    n_group, topk_group = k.opt("num_expert_group", int, 1), k.opt("topk_group", int, 1)
    if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"config.json text_config: num_expert_group {n_group} / topk_group {topk_group} do not fit")
    lac = text.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise ConfigError("config.json text_config: missing required key linear_attn_config")
    lk = Keys(lac, "config.json text_config.linear_attn_config")
    layer_types = layers_from_lists(lac, n_layers)
    bos = top.opt_none("bos_token_id", int)
    if bos is not None:
        top.token_id("bos_token_id", bos)
    eos = top.token_ids("eos_token_id", config.get("eos_token_id", text.get("eos_token_id")))
    spec = KimiK3Spec(
        model_type="kimi_k3",
        vocab_size=k.req("vocab_size", int),
        hidden_size=k.req("hidden_size", int),
        num_hidden_layers=n_layers,
        rms_norm_eps=k.req("rms_norm_eps", float),
        tie_word_embeddings=top.opt("tie_word_embeddings", bool, k.opt("tie_word_embeddings", bool, False)),
        max_position_embeddings=k.opt("max_position_embeddings", int, k.opt("model_max_length", int, 1 << 20)),
        bos_token_id=bos,
        eos_token_ids=eos,
        hidden_act="situ",
        torch_dtype=read_dtype(top) or read_dtype(k),
        situ_beta=k.req("activation_situ_beta", float),
        situ_linear_beta=k.req("activation_situ_linear_beta", float),
        intermediate_size=k.req("intermediate_size", int),
        first_k_dense_replace=k.req("first_k_dense_replace", int),
        attn_res_block_size=k.req("attn_res_block_size", int),
        num_attention_heads=heads,
        q_lora_rank=k.req("q_lora_rank", int),
        kv_lora_rank=k.req("kv_lora_rank", int),
        qk_nope_head_dim=k.req("qk_nope_head_dim", int),
        qk_rope_head_dim=k.req("qk_rope_head_dim", int),
        v_head_dim=k.req("v_head_dim", int),
        mla_use_output_gate=k.req("mla_use_output_gate", bool),
        num_experts=n_experts,
        num_experts_per_token=top_k,
        num_shared_experts=k.req("num_shared_experts", int),
        routed_expert_hidden_size=k.req("routed_expert_hidden_size", int),
        moe_intermediate_size=k.req("moe_intermediate_size", int),
        latent_moe_use_norm=k.req("latent_moe_use_norm", bool),
        moe_renormalize=k.req("moe_renormalize", bool),
        routed_scaling_factor=k.req("routed_scaling_factor", float),
        num_expert_group=n_group,
        topk_group=topk_group,
        linear_heads=lk.req("num_heads", int),
        linear_head_dim=lk.req("head_dim", int),
        conv_kernel=lk.req("short_conv_kernel_size", int),
        gate_lower_bound=lk.opt_none("gate_lower_bound", float),
        layer_types=layer_types,
    )
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "attn_res_block_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "routed_expert_hidden_size",
        "moe_intermediate_size",
        "linear_heads",
        "linear_head_dim",
        "conv_kernel",
        "rms_norm_eps",
        "situ_beta",
        "situ_linear_beta",
        "intermediate_size",
        "max_position_embeddings",
        "routed_scaling_factor",
    ):
        k.positive(key, getattr(spec, key))
    k.non_negative("qk_rope_head_dim", spec.qk_rope_head_dim)
    k.non_negative("num_shared_experts", spec.num_shared_experts)
    k.non_negative("first_k_dense_replace", spec.first_k_dense_replace, MAX_LAYERS)
    if spec.routed_expert_hidden_size % 32 or spec.moe_intermediate_size % 32:
        raise ConfigError(
            "config.json text_config: MXFP4 experts need routed_expert_hidden_size and "
            "moe_intermediate_size divisible by 32"
        )
    return spec


def situ_glu(beta1: float, beta2: float) -> Glu:
    """act(g, u) = [b1 tanh(g/b1) * sigmoid(g)] * [b2 tanh(u/b2)]: the sigmoid takes the uncapped g (numpy,
    on the calling thread whatever the threads)."""
    b1, b2 = np.float32(beta1), np.float32(beta2)

    def act(g: np.ndarray, u: np.ndarray, threads: int = 1) -> np.ndarray:
        return ((b1 * np.tanh(g / b1)) * sigmoid(g)) * (b2 * np.tanh(u / b2))

    return act


def res_normed(s: np.ndarray, eps: float) -> np.ndarray:
    """s / sqrt(mean(s^2) + eps) per row [T, E]: a source as attn_res scores it (np.mean's bits: a float32
    pairwise sum divided by the count)."""
    ms = np.add.reduce(s * s, axis=-1, keepdims=True) / np.float32(s.shape[-1])
    return s / np.sqrt(ms + np.float32(eps))


def attn_res(
    sources: list[np.ndarray], f: np.ndarray, eps: float, normed: list[np.ndarray] | None = None
) -> np.ndarray:
    """Attention residual: softmax over sources of <rms(s_i), f>, applied to the raw sources. normed: the
    res_normed of every source but the last, when the caller keeps them (completed blocks are scored by
    every later layer)."""
    kept = normed if normed is not None else [res_normed(s, eps) for s in sources[:-1]]
    rows = [*kept, res_normed(sources[-1], eps)]
    scores = np.empty((len(sources), sources[0].shape[0]), np.float32)  # [n, T]
    for i, r in enumerate(rows):
        np.add.reduce(r * f, axis=-1, out=scores[i])
    p = softmax(scores, axis=0)
    out = p[0][:, None] * sources[0]
    for i in range(1, len(sources)):
        out = out + p[i][:, None] * sources[i]
    return out.astype(np.float32)


class LatentMoE:
    """Route on the full width; experts run in the latent; RMSNorm on the aggregate; back up to the full
    width; shared experts on the full width, added unweighted."""

    def __init__(
        self,
        router: SigmoidGroupRouter,
        down: Linear,  # [L, E]
        experts: ExpertSource | list[Expert],  # latent: [I, L] / [L, I]
        norm: np.ndarray | None,  # [L]
        up: Linear,  # [E, L]
        shared: DenseMLP | None,
        eps: float,
    ):
        self.router, self.down, self.norm, self.up = router, down, norm, up
        self.experts = expert_source(experts)
        self.shared, self.eps = shared, eps

    def __call__(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        idx, w = self.router(x, ctx)  # [T, k]
        self.experts.announce(x, ctx)
        z = self.down(x, ctx)  # [T, L]
        acc = mix_experts(self.experts, z, idx, w, ctx)  # [T, L]
        if self.norm is not None:
            acc = rms_norm(acc, self.norm, self.eps)
        out = self.up(acc, ctx)  # [T, E]
        if self.shared is not None:
            out += self.shared(x, ctx)
        return out


@dataclass
class K3Layer:
    input_norm: np.ndarray
    attn: Attention
    post_norm: np.ndarray
    ffn: DenseMLP | LatentMoE
    f_attn: np.ndarray  # self_attention_res_norm * self_attention_res_proj [E]
    f_mlp: np.ndarray  # mlp_res_norm * mlp_res_proj [E]


class K3Decoder:
    def __init__(
        self, embed: Any, layers: list[K3Layer], norm: np.ndarray, f_out: np.ndarray, lm_head: Any, spec: KimiK3Spec
    ):
        self.embed, self.layers, self.norm, self.f_out, self.lm_head = embed, layers, norm, f_out, lm_head
        self.eps, self.block = spec.rms_norm_eps, spec.attn_res_block_size
        self.vocab_size = spec.vocab_size
        self.hooks: TrunkHooks | None = None

    def new_state(self) -> State:
        return State([layer.attn.new_cache() for layer in self.layers])

    def forward(self, ids: list[int], state: State, ctx: Ctx, all_logits: bool = False) -> np.ndarray:
        return self.forward_batch([ids], [state], ctx, [all_logits])[0]

    def forward_batch(
        self,
        ids: list[list[int]],
        states: list[State],
        ctx: Ctx,
        all_logits: list[bool] | None = None,
        stepwise: list[bool] | None = None,
    ) -> list[np.ndarray]:
        """One step over several sequences, each row as it would be alone (base.Rows)."""
        rows = Rows.of(ids, all_logits, stepwise)
        eps, hooks = self.eps, self.hooks
        if hooks:
            hooks.enter("embed")
        h = self.embed.dequantize_rows(rows.flat_ids)  # [T, E]
        if hooks:
            hooks.leave("embed")
        blocks: list[np.ndarray] = []  # completed block sums, each [T, E]
        normed: list[np.ndarray] = []  # their res_normed, scored by every later layer
        for i, layer in enumerate(self.layers):
            if hooks:
                hooks.enter(f"layer.{i}")
            prefix: np.ndarray | None = h
            if blocks:
                h = attn_res([*blocks, h], layer.f_attn, eps, normed)
            if i % self.block == 0:
                assert prefix is not None
                blocks.append(prefix)
                normed.append(res_normed(prefix, eps))
                prefix = None
            a = attend(layer.attn, rms_norm(h, layer.input_norm, eps), rows, [st.caches[i] for st in states], ctx)
            prefix = a if prefix is None else prefix + a
            h = attn_res([*blocks, prefix], layer.f_mlp, eps, normed)
            m = layer.ffn(rms_norm(h, layer.post_norm, eps), ctx)
            h = prefix + m
            if hooks:
                hooks.leave(f"layer.{i}")
        if hooks:
            hooks.enter("head")
        for st, seq in zip(states, ids, strict=True):
            st.ids.extend(int(i) for i in seq)
        h = attn_res([*blocks, h], self.f_out, eps, normed)
        logits = self.lm_head.matmul(rms_norm(h[rows.head], self.norm, eps), ctx.threads)
        if hooks:
            hooks.leave("head")
        return rows.split_head(logits)


def a_log_first_heads(t: Tensors, name: str, heads: int, stored: int) -> np.ndarray:
    """A_log holds one value per head; the K3 checkpoint stores more values than heads (128 for 96) and
    the first H are the heads' (indexing it per channel instead gives a different model)."""
    shape = getattr(t.ckpt.info(name), "shape", None) or (stored,)
    arr = np.asarray(t.ckpt.array(name, tuple(shape)), np.float32).reshape(-1)
    if arr.size < heads:
        raise CheckpointError(f"{t.ckpt.path}: tensor {name} has {arr.size} values, fewer than the {heads} heads")
    return arr[:heads]


def res_vector(t: Tensors, prefix: str, E: int) -> np.ndarray:
    """f = norm.weight * proj.weight for an attention-residual aggregator named prefix_{norm,proj}."""
    norm = t.vector(f"{prefix}_norm.weight", E)
    proj = np.asarray(t.ckpt.array(f"{prefix}_proj.weight", (1, E)), np.float32).reshape(E)
    return (norm * proj).astype(np.float32)


def build(ckpt: Checkpoint, s: KimiK3Spec) -> K3Decoder:
    t = Tensors(ckpt)
    E, H = s.hidden_size, s.num_attention_heads
    N, R, V, C, Q = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank, s.q_lora_rank
    LH, LD = s.linear_heads, s.linear_head_dim
    P = LH * LD
    L, I = s.routed_expert_hidden_size, s.moe_intermediate_size  # noqa: E741
    act = situ_glu(s.situ_beta, s.situ_linear_beta)
    eps = s.rms_norm_eps

    def lin(name: str, rows: int, cols: int) -> Linear:
        return Linear(t.weight(f"{name}.weight", rows, cols))

    def mlp(prefix: str, inter: int) -> DenseMLP:
        m = t.dense_mlp(prefix, inter, E)
        m.act = act
        return m

    layers = []
    for i in range(s.num_hidden_layers):
        p = f"{PREFIX}layers.{i}"
        a = f"{p}.self_attn"
        attn: Attention
        if s.layer_types[i] == "kda":
            a_log = a_log_first_heads(t, f"{a}.A_log", LH, max(LH, LD))
            gate = lin(f"{a}.g_proj", P, E)
            attn = kda_attention(t, a, E, LH, LD, s.conv_kernel, eps, gate, a_log, s.gate_lower_bound)
        else:
            attn = t.mla(a, E, H, N, R, V, C, Q, None, (N + R) ** -0.5, eps, out_gate=s.mla_use_output_gate)
        moe = f"{p}.block_sparse_moe"
        ffn: DenseMLP | LatentMoE
        if i < s.first_k_dense_replace:
            ffn = mlp(f"{p}.mlp" if t.has(f"{p}.mlp.gate_proj.weight") else moe, s.intermediate_size)
        else:
            router = SigmoidGroupRouter(
                t.weight(f"{moe}.gate.weight", s.num_experts, E),
                t.optional_vector(f"{moe}.gate.e_score_correction_bias", s.num_experts),
                s.num_experts_per_token,
                s.num_expert_group,
                s.topk_group,
                s.moe_renormalize,
                s.routed_scaling_factor,
            )
            experts = [
                Expert(
                    t.mxfp4(f"{moe}.experts.{e}.w1", I, L),
                    t.mxfp4(f"{moe}.experts.{e}.w3", I, L),
                    t.mxfp4(f"{moe}.experts.{e}.w2", L, I),
                    act,
                )
                for e in range(s.num_experts)
            ]
            ffn = LatentMoE(
                router,
                lin(f"{moe}.routed_expert_down_proj", L, E),
                experts,
                t.vector(f"{moe}.routed_expert_norm.weight", L) if s.latent_moe_use_norm else None,
                lin(f"{moe}.routed_expert_up_proj", E, L),
                mlp(f"{moe}.shared_experts", I * s.num_shared_experts) if s.num_shared_experts else None,
                eps,
            )
        layers.append(
            K3Layer(
                t.vector(f"{p}.input_layernorm.weight", E),
                attn,
                t.vector(f"{p}.post_attention_layernorm.weight", E),
                ffn,
                res_vector(t, f"{p}.self_attention_res", E),
                res_vector(t, f"{p}.mlp_res", E),
            )
        )
    embed = t.weight(f"{PREFIX}embed_tokens.weight", s.vocab_size, E)
    head = embed if s.tie_word_embeddings else t.weight(HEAD, s.vocab_size, E)
    return K3Decoder(
        embed, layers, t.vector(f"{PREFIX}norm.weight", E), res_vector(t, f"{PREFIX}output_attn_res", E), head, s
    )
