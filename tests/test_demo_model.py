"""The trained demo Kimi K3 shipped in the package (src/moestream/demo): the engine matches the training
model's own PyTorch forward pass on held-out text, the training script reproduces the committed tokenizer
exactly and the first logged training steps, and `moestream run` uses it when no model is given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moestream
from moestream.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import train_demo  # noqa: E402

DEMO = default_model_path()
REL_TOL = 1e-4


def _log() -> list[dict]:
    return [json.loads(line) for line in (DEMO / "train_log.jsonl").read_text().splitlines()]


def _held_out_text() -> str:
    _rel, text = next((rel, text) for rel, text in train_demo.stdlib_files() if train_demo.is_held_out(rel))
    return text


@pytest.fixture(scope="module")
def engine() -> moestream.Model:
    return moestream.load(DEMO, threads=2)


def test_engine_matches_training_model_on_held_out_text(engine):
    ids = engine.tokenize(_held_out_text()[:3000])[:160]
    ours = engine.logits(ids)  # [T, vocab]
    torch.set_num_threads(2)
    ref_model = train_demo.load_exported(DEMO)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids]))[0].numpy()
    scale = float(np.abs(ref).max())
    err = float(np.abs(ours - ref).max())
    assert err <= REL_TOL * scale, (err, scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.99


def test_training_model_round_trips_its_export(engine, tmp_path):
    """Exporting the loaded training model writes the same tensors back: the trunk byte for byte, the
    MXFP4 experts to the same values (a -0 nibble may come back as +0)."""
    from safetensors.numpy import load_file

    model = train_demo.load_exported(DEMO)
    config = json.loads((DEMO / "config.json").read_text())
    files = {f: (DEMO / f).read_text() for f in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py")}
    model.export(tmp_path / "again", config, files)
    for f in sorted(DEMO.glob("*.safetensors")):
        a, b = load_file(f), load_file(tmp_path / "again" / f.name)
        assert a.keys() == b.keys()
        for name in a:
            if name.endswith(".weight_packed"):
                e2m1 = train_demo.E2M1.numpy()
                for nib in (lambda x: x & 15, lambda x: x >> 4):
                    assert np.array_equal(e2m1[nib(a[name])], e2m1[nib(b[name])]), name
            else:
                assert a[name].tobytes() == b[name].tobytes(), name


def test_tokenizer_is_reproduced_exactly():
    files, _, _ = train_demo.kimi_tokenizer(train_demo.DEMO["vocab_size"], list(train_demo.training_tokens()))
    assert files["tiktoken.model"] == (DEMO / "tiktoken.model").read_text()


def test_training_reproduces_the_logged_first_steps(tmp_path):
    start = next(r for r in _log() if r.get("event") == "start")
    logged = {r["step"]: r["loss"] for r in _log() if "loss" in r and r["step"] <= 3}
    args = ["--out", str(tmp_path), "--stop-after", "3", "--save-every", "1000"]
    for key in ("steps", "batch", "seq", "lr", "warmup", "seed", "threads"):
        args += [f"--{key}", str(start[key])]
    assert train_demo.main(args) == 0
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    ours = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(ours) == [1, 2, 3]
    for step, loss in logged.items():
        assert abs(ours[step] - loss) <= 2e-3 * loss, (step, ours[step], loss)


def test_default_run_is_the_demo_model():
    p = subprocess.run(
        [sys.executable, "-m", "moestream", "run", "--prompt", "def fibonacci(n):\n", "--gen", "24", "--json"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    direct = list(moestream.load(DEMO).generate(obj["prompt_ids"], 24))
    assert obj["generated_ids"] == list(direct[: len(obj["generated_ids"])])
    assert obj["prompt_ids"][0] == json.loads((DEMO / "config.json").read_text())["bos_token_id"]
