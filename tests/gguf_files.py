"""GGUF files written in the tests, with gguf's own GGUFWriter, from the tiny transformers models of
hf_models.py: the tensor names (gguf's TensorNameMap, as llama.cpp's convert_hf_to_gguf.py maps them),
the stacked experts, llama's permuted q/k rows, DeepSeek's kv_b split into attn_k_b / attn_v_b (or kept
whole, as older converters did), the metadata keys and the byte-level BPE vocabulary as the converter
writes them. Experts can be quantized with our reference quantizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

import hf_models
from moestream.formats.checkpoint import Checkpoint
from moestream.quant import blocks
from moestream.quant.formats import quantize_mxfp4_reference

VOCAB = 320  # room for the 256 byte tokens, the specials and some merges
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's split pattern, as its tokenizer.json has it
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 42 o'clock, isn't it?",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
    "汉字和中文 日本語のテキスト Ünïcödé façade 🙂 1234567890",
]

# Configs of hf_models.py made convertible: llama.cpp's qwen3moe renormalises the top-k and its
# converter writes no dense layers; every vocabulary holds a byte-level BPE.
GGUF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "qwen3_moe",
        {**hf_models.CONFIGS["qwen3_moe-gqa4-k3"][1], "mlp_only_layers": [], "vocab_size": VOCAB},
    ),
    "mixtral": ("mixtral", {**hf_models.CONFIGS["mixtral-gqa4-k2"][1], "vocab_size": VOCAB}),
    "deepseek_v3": ("deepseek_v3", {**hf_models.CONFIGS["deepseek_v3-qlora-groups"][1], "vocab_size": VOCAB}),
    # widths that are whole 256-element blocks, for the k-quant experts
    "qwen3_moe-wide": (
        "qwen3_moe",
        dict(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=256,
            moe_intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=512,
        ),
    ),
}
ARCH = {
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
}
QUANT_TYPES = {
    "f32": T.F32,
    "f16": T.F16,
    "bf16": T.BF16,
    "q8_0": T.Q8_0,
    "q4_k": T.Q4_K,
    "q6_k": T.Q6_K,
    "q3_k": T.Q3_K,
    "q2_k": T.Q2_K,
    "tq1_0": T.TQ1_0,
    "tq2_0": T.TQ2_0,
    "mxfp4": T.MXFP4,
}


def tokenizer_files(out: Path, vocab: int = VOCAB, pre: str = "qwen2") -> Tokenizer:
    """A byte-level BPE trained on CORPUS (tokenizer.json and tokenizer_config.json in out, as a
    checkpoint has them), with SPECIALS and USER_DEFINED added tokens."""
    tok = Tokenizer(models.BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(USER_DEFINED),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens(USER_DEFINED)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


def _vocab(tok_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges as the converter's get_vocab_base and SpecialVocab write them."""
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    reverse = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a for a in data["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        elif i in reverse:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def _quantized(fmt: str, w: np.ndarray) -> tuple[np.ndarray, T | None]:
    """A [.., rows, cols] f32 array as the bytes of a GGUF tensor of type fmt."""
    if fmt == "f32":
        return w.astype(np.float32), None
    if fmt == "f16":
        return w.astype(np.float16), None
    lead, (rows, cols) = w.shape[:-2], w.shape[-2:]
    mats = w.reshape(-1, rows, cols)
    if fmt == "bf16":
        import ml_dtypes

        return w.astype(ml_dtypes.bfloat16).view(np.uint8), T.BF16
    if fmt == "mxfp4":
        out = []
        for m in mats:
            packed, scales = quantize_mxfp4_reference(m)
            nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols // 32, 32)
            qs = nib[..., :16] | (nib[..., 16:] << 4)
            out.append(np.concatenate([scales[..., None], qs], axis=-1).reshape(rows, -1))
        return np.stack(out).reshape(*lead, rows, -1).astype(np.uint8), T.MXFP4
    data = np.stack([blocks.quantize(fmt, m) for m in mats])
    return data.reshape(*lead, rows, -1), QUANT_TYPES[fmt]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama's converter: each head's rows (2, pairs) -> (pairs, 2), for llama.cpp's rope."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    ckpt_dir: Path,
    out: Path,
    tok_dir: Path | None,
    *,
    experts: str = "f32",
    kv_b: str = "split",
    split_max_tensors: int = 0,
    pre: str = "qwen2",
    drop: tuple[str, ...] = (),
) -> Path:
    """The GGUF the converter would write from the checkpoint in ckpt_dir (experts in format `experts`,
    the rest f32); kv_b "split" as newer converters write DeepSeek (attn_k_b / attn_v_b), "joined" as
    older ones did. With split_max_tensors, a split GGUF (out names the first part's stem). GGUF tensor
    names in drop are left out."""
    ckpt = Checkpoint(ckpt_dir)
    c = ckpt.config
    kind = c["model_type"]
    arch = ARCH[kind]
    L = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, L)
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    _metadata(w, c, kind, kv_b)
    if tok_dir is not None:
        tokens, types, merges = _vocab(tok_dir, c["vocab_size"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    def add(hf_name: str, arr: np.ndarray, fmt: str = "f32") -> None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if name in drop:
            return
        data, raw_dtype = _quantized(fmt, arr) if arr.ndim >= 2 else (arr.astype(np.float32), None)
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    expert_groups: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for hf in ckpt.tensors:
        arr = np.asarray(ckpt.array(hf), dtype=np.float32)
        if c.get("tie_word_embeddings") and hf == "lm_head.weight":
            continue
        if ".experts." in hf and ".shared_experts." not in hf:
            prefix, e, proj = hf.removesuffix(".weight").rsplit(".", 2)
            expert_groups.setdefault(prefix, {}).setdefault(int(e), {})[proj] = arr
            continue
        if kind == "mixtral" and hf.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        if kind == "mixtral" and hf.endswith("k_proj.weight"):
            arr = _permute(arr, kv_heads)
        if hf.endswith("e_score_correction_bias"):
            hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        if kind == "deepseek_v3" and hf.endswith("kv_b_proj.weight") and kv_b == "split":
            N, V = c["qk_nope_head_dim"], c["v_head_dim"]
            per_head = arr.reshape(heads, N + V, arr.shape[-1])
            add(hf.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(per_head[:, :N].transpose(0, 2, 1)))
            add(hf.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(per_head[:, N:]))
            continue
        add(hf, arr)
    for prefix, per_expert in expert_groups.items():
        layer = prefix.split(".")[2]
        for proj in sorted(per_expert[0]):
            stacked = np.stack([per_expert[e][proj] for e in range(len(per_expert))])
            if kind == "mixtral":
                name = f"layers.{layer}.feed_forward.experts.{proj}.weight"
            else:
                name = f"{prefix}.{proj}.weight"
            add(name, stacked, experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split_max_tensors else out.with_name(f"{out.stem}-00001-of-{len(w.tensors):05d}.gguf")


def _metadata(w: gguf.GGUFWriter, c: dict[str, Any], kind: str, kv_b: str) -> None:
    """The keys TextModel.set_gguf_parameters and each model class write."""
    heads = c["num_attention_heads"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if kind == "qwen3_moe":
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    elif kind == "mixtral":
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_rope_dimension_count(c["hidden_size"] // heads)
    else:
        C, R, N, V = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        if c.get("q_lora_rank"):
            w.add_q_lora_rank(c["q_lora_rank"])
        w.add_kv_lora_rank(C)
        if kv_b == "split":  # MLA as MQA over the latent, per-head sizes in the _mla keys
            w.add_head_count_kv(1)
            w.add_key_length(C + R)
            w.add_value_length(C)
            w.add_key_length_mla(N + R)
            w.add_value_length_mla(V)
        else:
            w.add_head_count_kv(heads)
            w.add_key_length(N + R)
            w.add_value_length(V)
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        if c.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(R)
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def small_gguf(path: Path) -> Path:
    """A small GGUF of every value type and a few tensors, so that a mutation often lands in the header."""
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_string("s", "text")
    w.add_array("a.str", ["a", "bc", ""])
    w.add_array("a.int", [1, 2, 3])
    w.add_array("a.float", [0.5, 1.5])
    w.add_bool("b", True)
    w.add_float32("f", 0.25)
    w.add_uint64("u", 7)
    w.add_tensor("t.f32", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.add_tensor(
        "t.q8", blocks.quantize("q8_0", np.ones((2, 32), np.float32)), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
