"""Tiny random models made with transformers, saved as real checkpoints, and transformers' own
greedy generation on them (the reference every engine test compares against)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

# Several configs per architecture, including odd sizes: hidden not a multiple of 64, an odd number of
# experts, top-k of 1 and above 2, GQA ratios 1 and 4, MLA with and without q_lora_rank, n_group > 1.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe-gqa4-k3": (
        "qwen3_moe",
        dict(
            vocab_size=211,
            hidden_size=72,
            intermediate_size=88,
            moe_intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=12,
            num_experts=7,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=512,
        ),
    ),
    "qwen3_moe-gqa1-k1": (
        "qwen3_moe",
        dict(
            vocab_size=160,
            hidden_size=40,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=10,
            num_experts=5,
            num_experts_per_tok=1,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=512,
            attention_bias=True,
        ),
    ),
    "mixtral-gqa4-k2": (
        "mixtral",
        dict(
            vocab_size=190,
            hidden_size=48,
            intermediate_size=56,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=5,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            max_position_embeddings=512,
        ),
    ),
    "mixtral-gqa1-k3": (
        "mixtral",
        dict(
            vocab_size=150,
            hidden_size=36,
            intermediate_size=50,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            num_local_experts=4,
            num_experts_per_tok=3,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=512,
        ),
    ),
    "deepseek_v3-qlora-groups": (
        "deepseek_v3",
        dict(
            vocab_size=200,
            hidden_size=56,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            kv_lora_rank=20,
            q_lora_rank=28,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=10,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    "deepseek_v3-noqlora-k1": (
        "deepseek_v3",
        dict(
            vocab_size=170,
            hidden_size=44,
            intermediate_size=60,
            moe_intermediate_size=20,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            n_routed_experts=5,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=6,
            qk_nope_head_dim=10,
            v_head_dim=14,
            first_k_dense_replace=0,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=512,
        ),
    ),
    "kimi_linear-qlora-groups": (
        "kimi_linear",
        dict(
            vocab_size=180,
            hidden_size=52,
            intermediate_size=72,
            moe_intermediate_size=20,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=10,
            num_experts=6,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_renormalize=True,
            num_expert_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            first_k_dense_replace=1,
            rms_norm_eps=1e-5,
            linear_attn_config={
                "num_heads": 3,
                "head_dim": 8,
                "short_conv_kernel_size": 4,
                "full_attn_layers": [2, 4],
                "kda_layers": [1, 3],
            },
        ),
    ),
    "kimi_linear-noqlora-k3": (
        "kimi_linear",
        dict(
            vocab_size=150,
            hidden_size=40,
            intermediate_size=56,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            kv_lora_rank=12,
            q_lora_rank=None,
            qk_rope_head_dim=6,
            qk_nope_head_dim=10,
            v_head_dim=8,
            num_experts=5,
            num_experts_per_token=3,
            num_shared_experts=2,
            moe_renormalize=False,
            num_expert_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            rms_norm_eps=1e-5,
            linear_attn_config={
                "num_heads": 2,
                "head_dim": 12,
                "short_conv_kernel_size": 3,
                "full_attn_layers": [3],
                "kda_layers": [1, 2],
            },
        ),
    ),
}

CONFIG_CLASSES = {
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
    "deepseek_v3": transformers.DeepseekV3Config,
    "kimi_linear": transformers.KimiLinearConfig,
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy choices are not near-ties and norm or bias bugs show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.startswith("lm_head"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def make_model(kind: str, cfg: dict[str, Any], seed: int = 0) -> transformers.PreTrainedModel:
    config = CONFIG_CLASSES[kind](**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the grouped_mm path refuses odd sizes
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    # Generate exactly n tokens without touching the logits: no EOS stop (min_new_tokens would set
    # the EOS logit to -inf, which the engine rightly does not do).
    model.generation_config.eos_token_id = None
    return model.eval()


def save(model: transformers.PreTrainedModel, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(out)
    model.to(torch.float32)
    return out


@dataclass
class Reference:
    ids: list[int]
    logits: np.ndarray  # [gen, vocab]


def hf_generate(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> Reference:
    inp = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    ids = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(out.logits, 1)[0].float().numpy()
    return Reference(ids, logits)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, vocab, size=n)]


def write_config_override(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
