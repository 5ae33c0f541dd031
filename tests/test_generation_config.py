"""generation_config.json: read as transformers writes it, refused in one line when malformed, and its
defaults used by `moestream run`, `chat` and the server for every setting not given (an explicit flag or
request field wins); its eos ids end generation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import moestream
from moestream.default_model import default_model_path
from moestream.errors import CheckpointError
from moestream.generation_config import GenerationDefaults, read_generation_config
from moestream.sampling import SamplingParams
from moestream.server import ChatRequest, CompletionRequest, Engine
from test_cli import assert_user_error, cli

PROMPT = "import os\n"


def demo_with(root: Path, name: str, gen_cfg: object | None) -> Path:
    """A copy of the demo model with this generation_config.json (None: none)."""
    d = root / name
    if not d.exists():
        shutil.copytree(default_model_path(), d)
    if gen_cfg is not None:
        (d / "generation_config.json").write_text(json.dumps(gen_cfg))
    return d


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("genconfig")


def run_json(*args: str) -> dict:
    p = cli("run", "--json", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# ---- reading the file ----------------------------------------------------------------------------


def test_reads_what_transformers_writes(tmp_path):
    from transformers import GenerationConfig

    GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, eos_token_id=[7, 9]
    ).save_pretrained(tmp_path)
    assert read_generation_config(tmp_path) == GenerationDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=None, eos_token_ids=(7, 9)
    )
    GenerationConfig(eos_token_id=3, repetition_penalty=1.1).save_pretrained(tmp_path)
    assert read_generation_config(tmp_path) == GenerationDefaults(repetition_penalty=1.1, eos_token_ids=(3,))


@pytest.mark.parametrize(
    "cfg, want",
    [
        ({}, GenerationDefaults()),
        ({"do_sample": False, "temperature": 0.7, "top_p": 0.8}, GenerationDefaults(temperature=0.0, top_p=0.8)),
        ({"do_sample": True}, GenerationDefaults(temperature=1.0)),
        ({"do_sample": True, "temperature": 0.3}, GenerationDefaults(temperature=0.3)),
        ({"temperature": 0.3, "top_k": 0}, GenerationDefaults(temperature=0.3, top_k=0)),
        ({"temperature": None, "eos_token_id": None, "bos_token_id": 1}, GenerationDefaults()),
        ({"eos_token_id": [5, 5, 2]}, GenerationDefaults(eos_token_ids=(5, 2))),
        ({"repetition_penalty": 1, "transformers_version": "5.0"}, GenerationDefaults(repetition_penalty=1.0)),
    ],
)
def test_fields(tmp_path, cfg, want):
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    got = read_generation_config(tmp_path)
    assert got == want
    assert got is not None and all(type(v) is type(getattr(want, k)) for k, v in vars(got).items())


def test_no_file_or_a_gguf_path_is_none(tmp_path):
    assert read_generation_config(tmp_path) is None
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert read_generation_config(f) is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{", "corrupt generation_config.json"),
        ("[1, 2]", "corrupt generation_config.json (not an object)"),
        ('{"temperature": "hot"}', "temperature must be a number, got 'hot'"),
        ('{"temperature": -0.5}', "temperature must be in [0.0, 100.0], got -0.5"),
        ('{"temperature": true}', "temperature must be a number, got True"),
        ('{"top_p": 0}', "top_p must be in (0.0, 1.0], got 0"),
        ('{"top_p": 1.5}', "top_p must be in (0.0, 1.0], got 1.5"),
        ('{"top_k": 2.5}', "top_k must be an integer, got 2.5"),
        ('{"top_k": -1}', "top_k must be in [0, 10000000], got -1"),
        ('{"min_p": 2}', "min_p must be in [0.0, 1.0], got 2"),
        ('{"repetition_penalty": 0}', "repetition_penalty must be in (0.0, 100.0], got 0"),
        ('{"do_sample": "yes"}', "do_sample must be true, false or null, got 'yes'"),
        ('{"eos_token_id": "2"}', "eos_token_id must be a token id or a list of them, got '2'"),
        ('{"eos_token_id": [2, -1]}', "eos_token_id must be a token id or a list of them, got [2, -1]"),
        ('{"eos_token_id": [2, [3]]}', "eos_token_id must be a token id or a list of them"),
        ('{"temperature": 1e999}', "temperature must be in [0.0, 100.0], got inf"),
    ],
)
def test_bad_files_are_one_line(tmp_path, text, fragment):
    path = tmp_path / "generation_config.json"
    path.write_text(text)
    with pytest.raises(CheckpointError) as e:
        read_generation_config(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and fragment in msg and "\n" not in msg, msg


def test_a_bad_file_stops_the_cli_in_one_line(root):
    d = demo_with(root, "bad", None)
    (d / "generation_config.json").write_text('{"top_k": "many"}')
    try:
        p = cli("run", str(d), "--prompt", "x")
    finally:
        (d / "generation_config.json").unlink()
    assert_user_error(p, f"{d / 'generation_config.json'}: top_k must be an integer, got 'many'")


# ---- what load() makes of it ---------------------------------------------------------------------


def test_load_sets_generation_and_eos_ids(root):
    plain = moestream.load()
    assert plain.generation is None
    d = demo_with(root, "eos", {"eos_token_id": [17, plain.eos_ids[0]], "top_k": 3})
    m = moestream.load(d)
    assert m.generation == GenerationDefaults(top_k=3, eos_token_ids=(17, plain.eos_ids[0]))
    assert m.eos_ids == tuple(sorted({17, *plain.eos_ids}))


def test_run_stops_at_an_eos_id_of_generation_config(root):
    ref = run_json("--prompt", PROMPT, "--gen", "8")
    assert ref["finish_reason"] == "length" and len(ref["generated_ids"]) == 8
    stop_id = ref["generated_ids"][3]
    first = ref["generated_ids"].index(stop_id)
    d = demo_with(root, "eos-run", {"eos_token_id": stop_id})
    out = run_json(str(d), "--prompt", PROMPT, "--gen", "8")
    assert out["generated_ids"] == ref["generated_ids"][: first + 1]
    assert out["finish_reason"] == "stop"
    assert run_json(str(d), "--prompt", PROMPT, "--gen", "8", "--ignore-eos")["generated_ids"] == ref["generated_ids"]


# ---- the CLI's defaults --------------------------------------------------------------------------

SAMPLED = {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2}
SAME_AS_FLAGS = [
    "--temperature",
    "0.9",
    "--top-k",
    "40",
    "--top-p",
    "0.9",
    "--min-p",
    "0.02",
    "--repeat-penalty",
    "1.2",
]


def test_run_takes_the_models_defaults_and_flags_win(root):
    d = demo_with(root, "sampled", SAMPLED)
    with_defaults = run_json(str(d), "--prompt", PROMPT, "--gen", "24", "--seed", "4")
    by_flags = run_json("--prompt", PROMPT, "--gen", "24", "--seed", "4", *SAME_AS_FLAGS)
    greedy = run_json("--prompt", PROMPT, "--gen", "24")
    assert with_defaults["generated_ids"] == by_flags["generated_ids"]
    assert with_defaults["generated_ids"] != greedy["generated_ids"]
    # explicit flags override each default: greedy and no penalty is the plain greedy run
    over = run_json(str(d), "--prompt", PROMPT, "--gen", "24", "--temperature", "0", "--repeat-penalty", "1")
    assert over["generated_ids"] == greedy["generated_ids"]
    # one flag given, the others still from the file
    hot = run_json(str(d), "--prompt", PROMPT, "--gen", "24", "--seed", "4", "--temperature", "1.5")
    hot_flags = [*SAME_AS_FLAGS[2:], "--temperature", "1.5"]
    assert (
        hot["generated_ids"] == run_json("--prompt", PROMPT, "--gen", "24", "--seed", "4", *hot_flags)["generated_ids"]
    )


def test_chat_takes_the_models_defaults(root):
    d = demo_with(root, "sampled", SAMPLED)
    a = cli("chat", str(d), "--gen", "16", "--seed", "2", input_text="def f(x):\n")
    b = cli("chat", "--gen", "16", "--seed", "2", *SAME_AS_FLAGS, input_text="def f(x):\n")
    g = cli("chat", "--gen", "16", input_text="def f(x):\n")
    assert a.returncode == b.returncode == g.returncode == 0, a.stderr + b.stderr + g.stderr
    assert a.stdout == b.stdout != g.stdout


def test_help_names_the_default():
    p = cli("run", "--help")
    text = " ".join(p.stdout.split())
    assert "--temperature TEMPERATURE, --temp TEMPERATURE default: the model's generation_config.json, else 0.0" in text
    assert "keep the k most likely tokens (0: all; default: the model's generation_config.json, else 0)" in text
    assert "default: the model's generation_config.json, else" in " ".join(cli("chat", "--help").stdout.split())


# ---- the server's defaults -----------------------------------------------------------------------


def test_server_fills_missing_request_fields(root):
    d = demo_with(root, "sampled", SAMPLED)
    engine = Engine(moestream.load(d), "m", ctx=256, max_tokens=32)
    plain = Engine(moestream.load(), "m", ctx=256, max_tokens=32)
    try:
        from_model = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
        job = engine.completion_job(CompletionRequest(model="m", prompt=PROMPT))
        assert job.sampling == from_model
        chat = engine.chat_job(ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}]))
        assert chat.sampling == from_model
        # fields the request gives win, even when they equal the server's own defaults
        req = CompletionRequest(model="m", prompt=PROMPT, temperature=1.0, top_k=0, seed=3)
        assert engine.completion_job(req).sampling == SamplingParams(
            temperature=1.0, top_k=0, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=3
        )
        # without generation_config.json: OpenAI's defaults, as before
        assert plain.completion_job(CompletionRequest(model="m", prompt=PROMPT)).sampling == SamplingParams(
            temperature=1.0
        )
    finally:
        engine.stop()
        plain.stop()


def test_bench_stays_greedy_whatever_the_model_says(small_case, tmp_path):
    from moestream.formats.packed import pack

    packed = pack(small_case.path, tmp_path / "packed", experts="keep", trunk="keep", progress=False)
    (packed / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 2.0}))
    p = cli("bench", str(packed), "--ram", "max,max,max", "--gen", "12", "--prompt-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert "generated ids identical at every budget: yes" in p.stdout
