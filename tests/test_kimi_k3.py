"""Kimi K3 against the independent PyTorch reference of the spec (tests/k3_reference.py): the same greedy
ids, logits within 1e-4 x max|logit|, incremental == recompute, threads 1 == 2; each invariant the spec
calls out is shown to matter (its wrong variant changes the logits); a 255 E8M0 scale is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moestream
from k3_reference import K3Reference, Variant
from moestream.errors import CheckpointError
from moestream.synth import synth

REL_TOL = 1e-4

K3_CONFIGS = {
    "default": {},
    "odd": dict(
        hidden_size=96,
        num_hidden_layers=5,
        attn_res_block_size=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=40,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        num_experts=7,
        num_experts_per_token=3,
        num_shared_experts=1,
        routed_expert_hidden_size=64,
        moe_intermediate_size=32,
        intermediate_size=160,
        moe_renormalize=False,
        routed_scaling_factor=2.5,
        linear_attn_config={
            "num_heads": 3,
            "head_dim": 16,
            "short_conv_kernel_size": 3,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [3, 5],
            "kda_layers": [1, 2, 4],
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(K3_CONFIGS))
def k3(request, tmp_path_factory) -> Path:
    return synth("kimi_k3", tmp_path_factory.mktemp("k3") / request.param, K3_CONFIGS[request.param], seed=7)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(0, 256, n)]


def engine_generate(path: Path, ids: list[int], n: int, threads: int = 2, use_cache: bool = True):
    model = moestream.load(path, threads=threads)
    logits: list[np.ndarray] = []
    out = list(model.generate(ids, n, stop_at_eos=False, use_cache=use_cache, logits_out=logits))
    return out, np.stack(logits)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("prompt_len", [8, 100])
def test_matches_reference(k3, prompt_len):
    ids = prompt(prompt_len)
    ref_ids, ref_logits = K3Reference(k3).generate(ids, 32)
    out, logits = engine_generate(k3, ids, 32)
    assert out == ref_ids
    assert rel(logits, ref_logits.numpy()) <= REL_TOL


def test_all_positions_match_reference(k3):
    ids = prompt(24, seed=1)
    assert rel(moestream.load(k3).logits(ids), K3Reference(k3).logits(ids).numpy()) <= REL_TOL


def test_incremental_equals_recompute(k3):
    ids = prompt(8, seed=2)
    a = engine_generate(k3, ids, 10)
    b = engine_generate(k3, ids, 10, use_cache=False)
    assert a[0] == b[0]
    assert rel(a[1], b[1]) <= 1e-5


def test_threads_byte_identical(k3):
    ids = prompt(40, seed=3)
    a = engine_generate(k3, ids, 6, threads=1)
    b = engine_generate(k3, ids, 6, threads=2)
    assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()


@pytest.mark.parametrize(
    "flag",
    [
        "bias_in_weights",  # the correction bias steers selection only
        "norm_per_expert",  # RMSNorm on the aggregate
        "situ_capped_sigmoid",  # sigmoid of the uncapped gate
        "kda_gate_before_norm",  # norm before gate in KDA
        "mla_scale_nope_only",  # MLA scale 192^-0.5 ...
        "mla_rotate_k_r",  # ... with the shared, unrotated k_r
        "ar_normed_sum",  # raw sources in the attention-residual sum
        "a_log_per_channel",  # A_log per head
    ],
)
def test_invariant_matters(k3, flag):
    """The engine follows the spec's reading, and the wrong reading gives clearly different logits."""
    ids = prompt(12, seed=4)
    ours = moestream.load(k3).logits(ids)
    right = K3Reference(k3).logits(ids).numpy()
    wrong = K3Reference(k3, Variant(**{flag: True})).logits(ids).numpy()
    assert rel(ours, right) <= REL_TOL
    assert rel(wrong, right) > 100 * REL_TOL


def test_e8m0_scale_255_refused(tmp_path):
    src = synth("kimi_k3", tmp_path / "m", seed=1)
    tensors = load_file(src / "model.safetensors")
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    tensors[name][3, 1] = 255
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        moestream.load(src)  # preloaded: checked at load
    lazy = moestream.load(src, preload=False)  # mapped: checked when the expert is first used
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        lazy.decoder.layers[2].ffn.experts[5].up.matmul(np.zeros((1, 96), np.float32))
    p = subprocess.run(
        [sys.executable, "-m", "moestream.cli", "run", str(src), "--ids", "1,2"], capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stdout == "" and name in p.stderr and "255" in p.stderr


def test_both_end_tokens_end_generation(tmp_path):
    """Kimi's base model ends text with [EOS]; config.json names <|end_of_msg|>: both stop."""
    path = synth("kimi_k3", tmp_path / "m", seed=1)
    model = moestream.load(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
    assert set(model.eos_ids) == {specials["[EOS]"], specials["<|end_of_msg|>"]}
    assert model.tokenize("a[EOS]")[-1] == specials["[EOS]"]


def test_sharded_k3_checkpoint(tmp_path):
    one = synth("kimi_k3", tmp_path / "one", seed=3)
    many = synth("kimi_k3", tmp_path / "many", seed=3, shard_bytes=200_000)
    assert (many / "model.safetensors.index.json").exists()
    ids = prompt(8)
    assert engine_generate(one, ids, 4)[1].tobytes() == engine_generate(many, ids, 4)[1].tobytes()
    shutil.rmtree(many)


def test_attn_res_has_the_bits_of_its_formula():
    """The attention residual (with its completed blocks' norms kept by the caller, or not) gives the bits
    of softmax_i(<s_i / sqrt(mean(s_i^2) + eps), f>) applied to the raw sources, written plainly."""
    from moestream.models.base import softmax
    from moestream.models.kimi_k3 import attn_res, res_normed

    rng = np.random.default_rng(4)
    eps = 1e-6
    for T, E, n in ((1, 64, 1), (3, 96, 2), (5, 256, 4)):
        sources = [(rng.standard_normal((T, E)) * np.exp(rng.standard_normal())).astype(np.float32) for _ in range(n)]
        f = rng.standard_normal(E).astype(np.float32)
        scores = np.stack(
            [
                np.sum(s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + np.float32(eps)) * f, axis=-1)
                for s in sources
            ]
        )
        p = softmax(scores, axis=0)
        want = p[0][:, None] * sources[0]
        for i in range(1, n):
            want = want + p[i][:, None] * sources[i]
        assert attn_res(sources, f, eps).tobytes() == want.astype(np.float32).tobytes()
        kept = [res_normed(s, eps) for s in sources[:-1]]
        assert attn_res(sources, f, eps, kept).tobytes() == want.astype(np.float32).tobytes()
