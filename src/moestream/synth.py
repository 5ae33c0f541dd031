"""`moestream synth`: a random-weight checkpoint of a supported architecture, in the real format
(config.json, sharded safetensors with an index, tokenizer.json), written tensor by tensor so that a
checkpoint larger than RAM can be made. The tensor list comes from the architecture's own builder, so
the names are defined in one place per architecture."""

from __future__ import annotations

import base64
import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from .atomic import atomic_dir
from .errors import ConfigError, InputError
from .formats.safetensors import DTYPES as ST_DTYPES
from .formats.safetensors import write_streaming
from .models.inventory import tensor_shapes

# Small defaults per architecture; --set overrides any key.
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    "mixtral": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        sliding_window=None,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    "deepseek_v3": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    "kimi_linear": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=1,
        moe_renormalize=True,
        num_expert_group=1,
        topk_group=1,
        routed_scaling_factor=2.0,
        first_k_dense_replace=1,
        moe_router_activation_func="sigmoid",
        mla_use_nope=True,
        rms_norm_eps=1e-5,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "full_attn_layers": [4],
            "kda_layers": [1, 2, 3],
        },
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    # text_config of a small Kimi K3 (the full model: see K3_FULL).
    "kimi_k3": dict(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        intermediate_size=256,
        first_k_dense_replace=1,
        attn_res_block_size=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        mla_use_nope=True,
        mla_use_output_gate=True,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=2,
        routed_expert_hidden_size=96,
        moe_intermediate_size=64,
        latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=1.0,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        num_nextn_predict_layers=0,
        model_type="kimi_linear",
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
        },
    ),
}
ARCHS = sorted(DEFAULTS)

# The released Kimi K3 text_config (../shared/specs/kimi_k3.md).
K3_FULL: dict[str, Any] = dict(
    DEFAULTS["kimi_k3"],
    vocab_size=163840,
    hidden_size=7168,
    num_hidden_layers=93,
    intermediate_size=33792,
    attn_res_block_size=12,
    num_attention_heads=96,
    num_key_value_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=896,
    num_experts_per_token=16,
    num_shared_experts=2,
    routed_expert_hidden_size=3584,
    moe_intermediate_size=3072,
    linear_attn_config={
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "full_attn_layers": [*range(4, 93, 4), 93],
        "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
    },
)


def k3_full(overrides: dict[str, Any]) -> dict[str, Any]:
    """The released K3 text_config with overrides on top; with a layer count of its own, K3's layer
    pattern is laid out anew for it."""
    full = dict(K3_FULL)
    if "num_hidden_layers" in overrides:
        lac = {k: v for k, v in full["linear_attn_config"].items() if not k.endswith("_layers")}
        full["linear_attn_config"] = lac
    return {**full, **overrides}


K3_SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
# Kimi's pre-tokenizer (o200k-style, Han first); written into tokenization_kimi.py as Kimi ships it.
KIMI_PAT = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
N_BYTE_TOKENS = 256
SPECIALS = ["<s>", "</s>"]
DTYPES = {"bf16": ("BF16", ml_dtypes.bfloat16), "f32": ("F32", np.float32), "f16": ("F16", np.float16)}


def parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set expects key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def tensor_dtype(name: str, weights: str) -> str:
    """The safetensors dtype synth writes a tensor in, as the released checkpoints keep them: norms, the
    router bias, KDA's conv weights, A_log and dt_bias in F32; MXFP4 experts as U8; the rest in `weights`."""
    if name.endswith((".weight_packed", ".weight_scale")):
        return "U8"
    if "norm" in name or name.endswith(("e_score_correction_bias", "conv1d.weight", ".A_log", ".dt_bias")):
        return "F32"
    return weights


def _random(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic per tensor name. Matrices ~ N(0, 0.8/sqrt(cols)) (lm_head 3x), norms 1 +- 0.1,
    router correction bias N(0, 0.05): large enough that greedy choices are not near-ties."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(".weight_packed"):
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if name.endswith(".weight_scale"):
        # E2M1 magnitudes average ~2.3: pick the exponent that gives values ~ 0.8/sqrt(cols)
        cols = shape[1] * 32
        s = round(127 + math.log2(0.8 / math.sqrt(cols) / 2.3))
        return rng.integers(s - 1, s + 2, shape, dtype=np.uint8)
    if "norm" in name:
        return (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.05 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    std = 0.8 / math.sqrt(shape[-1])
    if name.endswith("lm_head.weight"):
        std *= 3
    if name.endswith("_res_proj.weight"):  # attention-residual scores: keep the softmax soft
        std = 1.0 / math.sqrt(shape[-1])
    return (std * rng.standard_normal(shape, np.float32)).astype(np.float32)


# A few merges so the tokenizer is a real BPE (llama.cpp refuses a GGUF vocabulary without merges).
MERGES = [("Ġ", "t"), ("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"), ("o", "n")]


def _byte_level_tokenizer(vocab_size: int) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """A byte-level BPE tokenizer.json: the 256 byte tokens, two specials (ids 256, 257), a few merges."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tmodels
    from tokenizers.pre_tokenizers import ByteLevel

    n = N_BYTE_TOKENS + len(SPECIALS) + len(MERGES)
    if vocab_size < n:
        raise ConfigError(f"synth: vocab_size must be at least {n} for the tokenizer")
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]

    def byte_of(ch: str) -> int:  # GPT-2's byte <-> printable character map
        o = ord(ch)
        return o if o in printable else rest[o - 256]

    vocab = {ch: byte_of(ch) for ch in ByteLevel.alphabet()}
    vocab.update({sp: N_BYTE_TOKENS + i for i, sp in enumerate(SPECIALS)})
    vocab.update({a + b: N_BYTE_TOKENS + len(SPECIALS) + i for i, (a, b) in enumerate(MERGES)})
    tok = Tokenizer(tmodels.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    bos, eos = N_BYTE_TOKENS, N_BYTE_TOKENS + 1
    assert (tok.token_to_id("<s>"), tok.token_to_id("</s>")) == (bos, eos)
    cfg: dict[str, Any] = {
        "add_bos_token": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIALS},
    }
    return json.loads(tok.to_str()), cfg, bos, eos


ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}
TOP_LEVEL_K3 = {"bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "quantization_config"}


def make_config(arch: str, overrides: dict[str, Any], dtype: str) -> tuple[dict[str, Any], dict[str, str]]:
    """config.json and the tokenizer files for a synthetic checkpoint of arch."""
    torch_dtype = {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}[dtype]
    if arch != "kimi_k3":
        config: dict[str, Any] = {"model_type": arch, "architectures": [ARCHITECTURES[arch]], **DEFAULTS[arch]}
        config.update(overrides)
        tok_json, tok_cfg, bos, eos = _byte_level_tokenizer(int(config["vocab_size"]))
        config.setdefault("bos_token_id", bos)
        config.setdefault("eos_token_id", eos)
        config["torch_dtype"] = torch_dtype
        return config, {"tokenizer.json": json.dumps(tok_json), "tokenizer_config.json": json.dumps(tok_cfg, indent=2)}
    text = {**DEFAULTS["kimi_k3"], **{k: v for k, v in overrides.items() if k not in TOP_LEVEL_K3}}
    lac = dict(text["linear_attn_config"])
    n = int(text["num_hidden_layers"])
    given = overrides.get("linear_attn_config") or {}
    lists_given = "full_attn_layers" in given and "kda_layers" in given
    if not lists_given and max(lac.get("full_attn_layers", [0]) + lac.get("kda_layers", [0])) != n:
        # a layer count of its own: K3's pattern (every fourth layer and the last are MLA, one-based)
        full = sorted({i for i in range(1, n + 1) if i % 4 == 0} | {n})
        lac.update(full_attn_layers=full, kda_layers=[i for i in range(1, n + 1) if i not in full])
        text["linear_attn_config"] = lac
    files, bos, eos = kimi_tokenizer(int(text["vocab_size"]))
    config = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": int(text["vocab_size"]) - 1,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "float"}}},
            "ignore": ["re:.*shared_experts.*"],
        },
        "text_config": text,
    }
    config.update({k: v for k, v in overrides.items() if k in TOP_LEVEL_K3})
    return config, files


def kimi_tokenizer(vocab_size: int, tokens: list[bytes] | None = None) -> tuple[dict[str, str], int, int]:
    """tiktoken.model (tokens in rank order; by default the 256 byte tokens), tokenizer_config.json with
    Kimi's special tokens at the top of the vocabulary (from 163584 at full size), and tokenization_kimi.py
    carrying the pattern."""
    tokens = tokens if tokens is not None else [bytes([i]) for i in range(N_BYTE_TOKENS)]
    n_special = min(256, vocab_size - len(tokens))
    if n_special < len(K3_SPECIALS):
        need = len(tokens) + len(K3_SPECIALS)
        raise ConfigError(f"synth: vocab_size must be at least {need} for the tokenizer")
    base = vocab_size - n_special
    names = K3_SPECIALS + [f"<|reserved_token_{i}|>" for i in range(len(K3_SPECIALS), n_special)]
    ranks = "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens))
    cfg = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "add_bos_token": True,
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {str(base + i): {"content": n, "special": True} for i, n in enumerate(names)},
    }
    pattern = "".join(f'            r"""{p}""",\n' for p in KIMI_PAT)
    py = (
        '"""Kimi tokenizer (tiktoken). moestream reads pat_str from this file; it never runs it."""\n\n\n'
        "class TikTokenTokenizer:\n"
        '    pat_str = "|".join(\n        [\n' + pattern + "        ]\n    )\n"
    )
    files = {"tiktoken.model": ranks, "tokenizer_config.json": json.dumps(cfg, indent=2), "tokenization_kimi.py": py}
    return files, base, base + 2  # [BOS]; <|end_of_msg|> ends a message, as config.json says


def synth(
    arch: str,
    out: Path,
    overrides: dict[str, Any] | None = None,
    *,
    dtype: str = "bf16",
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    force: bool = False,
    progress: bool | None = None,
) -> Path:
    if arch not in DEFAULTS:
        raise InputError(f"synth: unknown architecture {arch!r} (supported: {', '.join(ARCHS)})")
    if dtype not in DTYPES:
        raise InputError(f"synth: unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"synth: {out} exists (use --force to replace it)")
    config, files = make_config(arch, overrides or {}, dtype)
    shapes = tensor_shapes(config)
    st_name = DTYPES[dtype][0]

    def np_dtype(name: str) -> np.dtype:
        return ST_DTYPES[tensor_dtype(name, st_name)]

    def make(name: str) -> Callable[[], np.ndarray]:
        return lambda: _random(name, shapes[name], seed).astype(np_dtype(name))

    entries = {name: (tensor_dtype(name, st_name), shape, make(name)) for name, shape in shapes.items()}
    write_checkpoint(out, config, files, entries, shard_bytes=shard_bytes, desc=f"synth {arch}", progress=progress)
    return out


Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]  # safetensors dtype, shape, producer


def write_checkpoint(
    out: Path,
    config: dict[str, Any],
    files: dict[str, str],
    entries: dict[str, Entry],
    *,
    shard_bytes: int = 2 << 30,
    desc: str = "write",
    progress: bool | None = None,
) -> Path:
    """A checkpoint directory written atomically: config.json, the text files given (tokenizer), and the
    tensors in order (each made by its producer just before it is written) in shards of at most
    shard_bytes with an index when there is more than one."""
    out = Path(out)

    def nbytes(name: str) -> int:
        dtype, shape, _ = entries[name]
        return math.prod(shape) * ST_DTYPES[dtype].itemsize

    shards: list[list[str]] = [[]]
    size = 0
    for name in entries:
        if shards[-1] and size + nbytes(name) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(name)
    with atomic_dir(out, what="synth") as tmp:
        bar = tqdm(total=len(entries), desc=desc, unit="tensor", disable=None if progress is None else not progress)
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
            items = []
            for name in names:
                dtype, shape, make = entries[name]

                def produce(make: Callable[[], np.ndarray] = make) -> np.ndarray:
                    bar.update(1)
                    return make()

                items.append((name, dtype, shape, produce))
                weight_map[name] = fname
            write_streaming(tmp / fname, items, {"format": "pt"})
        bar.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(nbytes(n) for n in entries)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for fname, text in files.items():
            (tmp / fname).write_text(text)
    return out
