"""The engine against transformers on tiny random models of every architecture: the same greedy ids,
logits within 1e-4 x max|logit| (float32), incremental decode = full recomputation, and byte-identical
results at 1 and 2 threads."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import hf_models
import moestream
from moestream.formats.safetensors import read_header, write_file
from moestream.quant.formats import FORMATS, dequantize_reference, quantize_fp8_reference

REL_TOL = 1e-4  # float32 checkpoints and bf16 checkpoints computed in float32 (see test_bf16_checkpoint)


def run(path: Path, prompt: list[int], n: int = 32, threads: int = 2, use_cache: bool = True):
    model = moestream.load(path, threads=threads)
    logits: list[np.ndarray] = []
    ids = list(model.generate(prompt, n, use_cache=use_cache, stop_at_eos=False, logits_out=logits))
    return ids, np.stack(logits)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("prompt_len", [8, 100])
def test_matches_transformers(case, prompt_len):
    ref = case.reference(prompt_len)
    ids, logits = run(case.path, case.prompt(prompt_len))
    assert ids == ref.ids
    assert rel_err(logits, ref.logits) <= REL_TOL


def test_incremental_equals_recompute(case):
    prompt = case.prompt(8)
    ids_c, logits_c = run(case.path, prompt, n=12)
    ids_n, logits_n = run(case.path, prompt, n=12, use_cache=False)
    assert ids_c == ids_n
    assert rel_err(logits_c, logits_n) <= 1e-5


def test_threads_byte_identical(case):
    prompt = case.prompt(100)
    ids1, logits1 = run(case.path, prompt, n=8, threads=1)
    ids2, logits2 = run(case.path, prompt, n=8, threads=2)
    assert ids1 == ids2
    assert logits1.tobytes() == logits2.tobytes()


def test_all_position_logits_match_transformers(case):
    prompt = case.prompt(40)
    ours = moestream.load(case.path).logits(prompt)
    with torch.no_grad():
        theirs = case.hf(torch.tensor([prompt])).logits[0].numpy()
    assert rel_err(ours, theirs) <= REL_TOL


@contextlib.contextmanager
def restored(hf):
    """Lets a test change the transformers model's weights and puts them back afterwards."""
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    try:
        yield hf
    finally:
        hf.load_state_dict(state)


def _rewrite_tensors(src: Path, dst: Path, convert) -> None:
    """Copies a single-file checkpoint, passing every tensor through convert(name, array) -> dict."""
    shutil.copytree(src, dst)
    header = read_header(src / "model.safetensors")
    from moestream.formats.safetensors import MappedFile

    mf = MappedFile(src / "model.safetensors")
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        out.update(convert(name, np.array(mf.view(info))))
    write_file(dst / "model.safetensors", out)


def test_bf16_checkpoint(case, tmp_path):
    """A bf16 checkpoint is computed in float32 from the exact bf16 values, so it matches transformers
    run in float32 on the same bf16-rounded weights within the same 1e-4 bound."""
    dst = tmp_path / "bf16"
    _rewrite_tensors(case.path, dst, lambda n, a: {n: a.astype(ml_dtypes.bfloat16) if "norm" not in n else a})
    prompt = case.prompt(8)
    with restored(case.hf) as hf, torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        ref = hf_models.hf_generate(hf, prompt, 32)
    ids, logits = run(dst, prompt)
    assert ids == ref.ids
    assert rel_err(logits, ref.logits) <= REL_TOL


def test_fp8_block_scaled_checkpoint(case, tmp_path):
    """F8_E4M3 weights with weight_scale_inv 128x128 block scales (as DeepSeek-V3 / Kimi K2 ship them)
    match transformers run on the dequantized weights."""
    if case.kind != "deepseek_v3":
        pytest.skip("fp8 block-scaled checkpoints are a DeepSeek-V3 / Kimi K2 format")
    fp8_names = {}

    def convert(name, a):
        if a.ndim == 2 and "embed" not in name and "lm_head" not in name and not name.endswith("gate.weight"):
            q, s = quantize_fp8_reference(a)
            fp8_names[name] = dequantize_reference(FORMATS["fp8"], q, s, *a.shape)
            return {name: q, name.removesuffix("weight") + "weight_scale_inv": s}
        return {name: a}

    dst = tmp_path / "fp8"
    _rewrite_tensors(case.path, dst, convert)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    assert fp8_names
    prompt = case.prompt(8)
    with restored(case.hf) as hf, torch.no_grad():
        sd = hf.state_dict()
        for name, deq in fp8_names.items():
            if name in sd:
                sd[name].copy_(torch.from_numpy(deq))
            else:  # per-expert names map onto transformers' fused expert tensors
                _load_expert(hf, name, deq)
        ref = hf_models.hf_generate(hf, prompt, 32)
    ids, logits = run(dst, prompt)
    assert ids == ref.ids
    assert rel_err(logits, ref.logits) <= REL_TOL


def _load_expert(hf, name: str, deq: np.ndarray) -> None:
    # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
    parts = name.split(".")
    layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
    experts = hf.model.layers[layer].mlp.experts
    t = torch.from_numpy(deq)
    inter = experts.down_proj.shape[-1]
    if proj == "gate_proj":
        experts.gate_up_proj[e, :inter].copy_(t)
    elif proj == "up_proj":
        experts.gate_up_proj[e, inter:].copy_(t)
    else:
        experts.down_proj[e].copy_(t)


def test_sharded_checkpoint_same_logits(small_case, tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json gives identical logits."""
    src = small_case.path
    dst = tmp_path / "sharded"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    from moestream.formats.safetensors import MappedFile

    header = read_header(src / "model.safetensors")
    mf = MappedFile(src / "model.safetensors")
    names = sorted(header)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        write_file(dst / fname, {n: np.array(mf.view(header[n])) for n in part})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = small_case.prompt(8)
    assert run(src, prompt, n=4)[1].tobytes() == run(dst, prompt, n=4)[1].tobytes()
