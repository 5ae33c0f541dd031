"""Prefill in fixed chunks: a prompt longer than the chunk gives the logits of one pass over the whole
prompt (within the engine's float tolerance) and the same tokens; the plan's activation scratch no
longer grows with the prompt, so a long prompt fits the budget a short one needs."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

import moestream
from moestream.formats.packed import pack
from moestream.generate import PREFILL_CHUNK
from moestream.runtime.streaming import layout, plan_budget


def long_prompt(model) -> list[int]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    ids = model.tokenize(text)
    assert len(ids) > 2 * PREFILL_CHUNK + 7
    return ids[: 2 * PREFILL_CHUNK + 7]


def test_chunked_prefill_matches_one_pass():
    m = moestream.load()
    ids = long_prompt(m)
    seen: list[np.ndarray] = []
    tokens = list(m.generate(ids, 8, logits_out=seen))
    whole = m.logits(ids)[-1]  # one forward pass over the whole prompt
    assert np.abs(seen[0] - whole).max() <= 1e-4 * np.abs(whole).max()
    assert tokens[0] == int(np.argmax(whole))
    stepwise = list(m.generate(ids, 8, use_cache=False))  # recomputes the whole sequence every step
    assert tokens == stepwise


def test_long_prompts_need_no_more_scratch(tmp_path):
    m = moestream.load(pack(moestream.load().path, tmp_path / "p", progress=False), preload=False)
    lay = layout(m, m.store)
    short = plan_budget(m, lay, 1 << 30, context=4096, prompt_tokens=PREFILL_CHUNK)
    long = plan_budget(m, lay, 1 << 30, context=4096, prompt_tokens=4000)
    assert long.scratch_bytes == short.scratch_bytes


def test_loaded_model_keeps_numpy_blas_on_one_thread():
    """numpy's BLAS threads spin after each small attention product and would take the cores from the
    kernels' own threads: loading a model limits BLAS to the calling thread."""
    import subprocess
    import sys

    code = (
        "import threadpoolctl, moestream\n"
        "moestream.load()\n"
        "blas = [i for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas']\n"
        "print(sorted({i['num_threads'] for i in blas}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[1]"
