"""The command line: output formats, the default model, and one clear line with exit code 2 for every
kind of bad input (never a traceback, never partial output)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moestream

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def cli(*args: str, env: dict | None = None, input_text: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream.cli", *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=300,
        input=input_text,
        stdin=None if input_text is not None else subprocess.DEVNULL,
    )


def assert_user_error(p: subprocess.CompletedProcess, *fragments: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("moestream: error: ")
    assert "Traceback" not in p.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_json_and_dump_logits_match_api(small_case, tmp_path):
    prompt = small_case.prompt(8)
    dump = tmp_path / "logits.npy"
    p = cli(
        "run",
        str(small_case.path),
        "--ids",
        ",".join(map(str, prompt)),
        "--gen",
        "6",
        "--json",
        "--ignore-eos",
        "--dump-logits",
        str(dump),
    )
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["prompt_ids"] == prompt
    ref = small_case.reference(8)
    assert obj["generated_ids"] == ref.ids[:6]
    assert set(obj["stats"]) >= {
        "prompt_tokens",
        "generated_tokens",
        "prefill_seconds",
        "decode_tokens_per_second",
    }
    logits = np.load(dump)
    assert logits.dtype == np.float32 and logits.shape == (6, small_case.cfg["vocab_size"])
    api_logits: list[np.ndarray] = []
    list(moestream.load(small_case.path).generate(prompt, 6, stop_at_eos=False, logits_out=api_logits))
    assert logits.tobytes() == np.stack(api_logits).tobytes()
    assert not [f for f in tmp_path.iterdir() if f.name != "logits.npy"]  # no temporary left behind


def test_no_cache_and_threads_same_ids(small_case):
    ids = ",".join(map(str, small_case.prompt(8)))
    outs = [
        json.loads(
            cli("run", str(small_case.path), "--ids", ids, "--gen", "5", "--json", "--ignore-eos", *extra).stdout
        )
        for extra in ([], ["--no-cache"], ["--threads", "1"])
    ]
    assert outs[0]["generated_ids"] == outs[1]["generated_ids"] == outs[2]["generated_ids"]


def test_default_model_text_run(tmp_path):
    env = {**ENV, "MOESTREAM_HOME": str(tmp_path)}
    p = cli("run", "--prompt", "Hello", "--gen", "5", env=env)
    assert p.returncode == 0, p.stderr
    assert "tok/s" in p.stderr
    p2 = cli("run", "--prompt", "Hello", "--gen", "5", "--json", env=env)
    obj = json.loads(p2.stdout)
    bos = json.loads((Path(obj["model"]) / "config.json").read_text())["bos_token_id"]
    assert len(obj["generated_ids"]) <= 5 and obj["prompt_ids"][0] == bos  # BOS from tokenizer_config
    assert p.stdout.rstrip("\n") == obj["text"]  # streamed text is the detokenized ids
    p3 = cli("run", "--prompt", "Hello", "--gen", "5", "--json", env=env)  # reuses the cached model
    assert json.loads(p3.stdout)["generated_ids"] == obj["generated_ids"]


def test_synth_cli_round_trip(tmp_path):
    out = tmp_path / "m"
    p = cli(
        "synth",
        "--arch",
        "qwen3_moe",
        str(out),
        "--set",
        "num_hidden_layers=2",
        "--set",
        "num_experts=5",
        "--shard-size",
        "0.0005",
    )
    assert p.returncode == 0, p.stderr
    assert (out / "model.safetensors.index.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["num_experts"] == 5
    r = cli("run", str(out), "--prompt", "abc", "--gen", "3", "--json")
    assert r.returncode == 0 and len(json.loads(r.stdout)["generated_ids"]) <= 3
    assert_user_error(cli("synth", "--arch", "qwen3_moe", str(out)), "exists")


def test_help_explains_every_flag():
    p = cli("run", "--help")
    for flag in (
        "--prompt",
        "--prompt-file",
        "--ids",
        "--gen",
        "--threads",
        "--no-cache",
        "--json",
        "--dump-logits",
    ):
        assert flag in p.stdout


# ---- bad input ------------------------------------------------------------------------------------


@pytest.fixture()
def broken(small_case, tmp_path):
    """A fresh copy of a good checkpoint to break."""
    dst = tmp_path / "model"
    shutil.copytree(small_case.path, dst)
    return dst


def test_missing_directory(tmp_path):
    assert_user_error(cli("run", str(tmp_path / "nope"), "--ids", "1"), "does not exist")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    assert_user_error(cli("run", str(broken), "--ids", "1"), "config.json")


def test_corrupt_config(broken):
    (broken / "config.json").write_text("{not json")
    assert_user_error(cli("run", str(broken), "--ids", "1"), "corrupt config.json")


def test_unknown_model_type(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama9"
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("run", str(broken), "--ids", "1"), "unknown model_type 'llama9'")


def test_missing_config_key(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("run", str(broken), "--ids", "1"), "missing required key hidden_size")


def test_inconsistent_config(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # 8 heads are not a multiple of 3
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("run", str(broken), "--ids", "1"), "num_key_value_heads")


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])  # offsets are relative to the data


def test_missing_tensor(broken):
    def drop(h):
        name = "model.layers.0.self_attn.q_proj.weight"
        h["model.layers.0.self_attn.q_proj.weighX"] = h.pop(name)

    _rewrite_header(broken / "model.safetensors", drop)
    assert_user_error(cli("run", str(broken), "--ids", "1"), "missing tensor model.layers.0.self_attn.q_proj.weight")


def test_truncated_shard(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    assert_user_error(cli("run", str(broken), "--ids", "1"), "truncated")


def test_header_length_past_end(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    assert_user_error(cli("run", str(broken), "--ids", "1"), "header length")


def test_offsets_outside_file(broken):
    def move(h):
        name = "model.norm.weight"
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + 10**9, e + 10**9]

    _rewrite_header(broken / "model.safetensors", move)
    assert_user_error(cli("run", str(broken), "--ids", "1"), "outside the file")


def test_shape_not_matching_config(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["moe_intermediate_size"] = cfg["moe_intermediate_size"] + 2
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("run", str(broken), "--ids", "1"), "has shape")


def test_dtype_not_supported(broken):
    def retype(h):
        h["model.layers.0.self_attn.q_proj.weight"]["dtype"] = "I32"  # same itemsize as F32

    _rewrite_header(broken / "model.safetensors", retype)
    assert_user_error(cli("run", str(broken), "--ids", "1"), "q_proj.weight")


def test_missing_shard(small_case, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(small_case.path, dst)
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    assert_user_error(cli("run", str(dst), "--ids", "1"), "missing")


def test_ids_outside_vocab(small_case):
    assert_user_error(cli("run", str(small_case.path), "--ids", "1,5000"), "token id 5000", "outside the vocabulary")
    assert_user_error(cli("run", str(small_case.path), "--ids", "-1"), "token id -1")


def test_malformed_ids(small_case):
    assert_user_error(cli("run", str(small_case.path), "--ids", "1,x"), "--ids")


def test_text_prompt_without_tokenizer(small_case):
    assert_user_error(cli("run", str(small_case.path), "--prompt", "hi"), "no tokenizer")


def test_missing_prompt_file(small_case, tmp_path):
    assert_user_error(cli("run", str(small_case.path), "--prompt-file", str(tmp_path / "p.txt")), "does not exist")


def test_no_prompt(small_case):
    assert_user_error(cli("run", str(small_case.path)), "no prompt")


@pytest.mark.parametrize("flag", ["--dump-logits", "--report", "--trace"])
def test_bad_output_dir(small_case, tmp_path, flag):
    p = cli("run", str(small_case.path), "--ids", "1", "--json", flag, str(tmp_path / "x" / "out"))
    assert_user_error(p, flag)


def test_inspect_full_kimi_k3_config(tmp_path):
    from moestream.synth import K3_FULL, make_config

    config, _ = make_config("kimi_k3", K3_FULL, "bf16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = cli("inspect", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "2.78 T total" in p.stdout
    assert "56.74 G parameters, 113.49 GB" in p.stdout  # the bf16 trunk of the spec
    assert "82,432 experts of 17.55 MB" in p.stdout  # 17,547,264 bytes each
    assert "kKKMKKKMKKKM" in p.stdout and p.stdout.count("M") >= 24


def test_inspect_measures_bytes(tmp_path):
    out = tmp_path / "m"
    assert cli("synth", "--arch", "kimi_k3", str(out)).returncode == 0
    p = cli("inspect", str(out))
    assert p.returncode == 0 and "bytes: measured" in p.stdout and "48 experts" in p.stdout
    assert_user_error(cli("inspect", str(tmp_path / "nope")), "does not exist")
