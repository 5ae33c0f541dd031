"""Hugging Face ids: parsing, which files a model needs, and `moestream download` / `moestream run org/name`
against a local stand-in for the hub (tests/hub_server.py, through HF_ENDPOINT, with a temporary HF_HOME):
the same bytes as the source, revisions, a dropped connection, Ctrl-C, gated / missing / unreachable repos,
offline mode, a GGUF quantization pick. No network."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fuzzing
from hub_server import HubServer, files_of, free_port
from moestream.hub import HubId, parse_hub_id, select_files
from moestream.synth import synth

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
EXTRAS = {
    "README.md": b"# tiny\n",
    "pytorch_model.bin": b"\x80\x02" * 64,
    "assets/logo.png": b"\x89PNG" * 8,
    "original/consolidated.safetensors": b"\0" * 32,
    ".gitattributes": b"*.safetensors filter=lfs\n",
}
GGUF_FILES = {
    "tiny-Q8_0.gguf": b"GGUF" + bytes(range(256)) * 300,
    "Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf": b"GGUF" + b"\1" * 40_000,
    "Q4_K_M/tiny-Q4_K_M-00002-of-00002.gguf": b"\2" * 30_000,
    "mmproj-Q8_0.gguf": b"GGUF" + b"\3" * 100,
    "README.md": b"# tiny GGUF\n",
}


# ---- parsing and selection (no server) ----------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Qwen/Qwen3-30B-A3B", HubId("Qwen/Qwen3-30B-A3B")),
        ("org/name@v1.0", HubId("org/name", "v1.0")),
        ("org/name@refs/pr/4", HubId("org/name", "refs/pr/4")),
        ("org/name@" + "a" * 40, HubId("org/name", "a" * 40)),
        ("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M", HubId("unsloth/Qwen3-30B-A3B-GGUF", None, "Q4_K_M")),
        ("org/x-GGUF:UD-Q4_K_XL@main", HubId("org/x-GGUF", "main", "UD-Q4_K_XL")),
        ("org/x-GGUF@main:Q8_0", HubId("org/x-GGUF", "main", "Q8_0")),
        ("my_org/model.v2", HubId("my_org/model.v2")),
    ],
)
def test_parse_hub_id(text, expected):
    assert parse_hub_id(text) == expected
    assert parse_hub_id(str(expected)) == expected  # str() writes it back


@pytest.mark.parametrize(
    "text",
    [
        "",
        "demo",
        "name",
        "./org/name",
        "../org/name",
        "/abs/name",
        "~/models/x",
        "org/name/extra",
        "org//name",
        "org/name/",
        "-org/name",
        "org/name-",
        "org/na--me",
        "org/na..me",
        ".org/name",
        "org/name.gguf",
        "org/model.safetensors",
        "org/na me",
        "org/näme",
        "org/\udcff",
        "org/name@",
        "org/name@../x",
        "org/name@a//b",
        "org/name@-x",
        "org/name@x.lock",
        "org/name:",
        "org/name:Q4:Q8",
        "org/name:Q4@main:Q8",
        "org/name@a@b",
        "C:/models/x",
        "org/" + "n" * 97,
    ],
)
def test_parse_hub_id_refuses_non_ids(text):
    assert parse_hub_id(text) is None


def test_parse_hub_id_mutations():
    """Mutants of valid ids end in an id or None (never an exception), and an accepted id writes back
    to itself."""

    def parse(data: bytes) -> object:
        hub_id = parse_hub_id(data.decode("utf-8", "replace"))
        if hub_id is not None:
            assert parse_hub_id(str(hub_id)) == hub_id
        return hub_id

    seeds = [b"org/name", b"org/name@refs/pr/1", b"unsloth/Qwen3-GGUF:UD-Q4_K_XL@main"]
    for n, seed in enumerate(seeds):
        fuzzing.expect_only_own_errors(parse, fuzzing.byte_mutations(seed, 2000 * fuzzing.SCALE, seed=n))


def test_select_checkpoint_files():
    listing = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "tiktoken.model",
        "tokenization_kimi.py",
        "modeling_kimi.py",
        SHARD_1,
        SHARD_2,
        "model.safetensors.index.json",
        *EXTRAS,
        "pytorch_model-00001-of-00002.bin",
    ]
    kind, files = select_files(listing, HubId("org/m"))
    assert kind == "checkpoint"
    assert files == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "tiktoken.model",
            "tokenization_kimi.py",
            SHARD_1,
            SHARD_2,
            "model.safetensors.index.json",
        ]
    )


def test_select_gguf_files():
    listing = [*GGUF_FILES, "tiny-Q4_K.gguf", "tiny-IQ4_XS.gguf"]
    assert select_files(listing, HubId("o/m", None, "Q8_0")) == ("gguf", ["tiny-Q8_0.gguf"])
    assert select_files(listing, HubId("o/m", None, "q8_0")) == ("gguf", ["tiny-Q8_0.gguf"])  # any case
    assert select_files(listing, HubId("o/m", None, "Q4_K")) == ("gguf", ["tiny-Q4_K.gguf"])  # not Q4_K_M
    assert select_files(listing, HubId("o/m", None, "Q4_K_M")) == (
        "gguf",
        ["Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/tiny-Q4_K_M-00002-of-00002.gguf"],
    )
    assert select_files(["a-Q8_0.gguf", "mmproj-F16.gguf"], HubId("o/m")) == ("gguf", ["a-Q8_0.gguf"])
    from moestream.errors import InputError

    with pytest.raises(InputError, match=r"several GGUF models.*pick one with o/m:QUANT.*IQ4_XS, Q4_K, Q4_K_M, Q8_0"):
        select_files(listing, HubId("o/m"))
    with pytest.raises(InputError, match=r"no \.gguf file for Q5_K_M"):
        select_files(listing, HubId("o/m", None, "Q5_K_M"))
    with pytest.raises(InputError, match="lacks part 2 of 3"):
        select_files(["x-Q2_K-00001-of-00003.gguf", "x-Q2_K-00003-of-00003.gguf"], HubId("o/m", None, "Q2_K"))
    with pytest.raises(InputError, match=r"not pytorch \.bin"):
        select_files(["config.json", "pytorch_model.bin"], HubId("o/m"))
    with pytest.raises(InputError, match=r"no config\.json"):
        select_files(["model.safetensors"], HubId("o/m"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["./org/x"], "'./org/x' is not a Hugging Face id"),
        (["org/x", "--revision", "../x"], "--revision: '../x' is not a branch, tag or commit"),
        (["org/x@v1", "--revision", "main"], "--revision main contradicts org/x@v1"),
    ],
)
def test_download_refuses_bad_arguments(args, message, capsys):
    from moestream.cli import main

    assert main(["download", *args]) == 2  # refused before any request
    err = capsys.readouterr().err
    assert err.startswith(f"moestream: error: {message}") and err.count("\n") == 1, err


# ---- against the stand-in hub -------------------------------------------------------------------


def _synth(out: Path, seed: int) -> dict[str, bytes]:
    synth("qwen3_moe", out, {"num_hidden_layers": 2, "num_experts": 5}, seed=seed, shard_bytes=500_000, progress=False)
    return files_of(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-models")
    return {"main": (root / "main", _synth(root / "main", 0)), "v1": (root / "v1", _synth(root / "v1", 1))}


@pytest.fixture
def hub(models):
    with HubServer() as server:
        tiny = server.repo("org/tiny")
        tiny.add({**models["v1"][1], **EXTRAS}, "v1")
        tiny.add({**models["main"][1], **EXTRAS}, "main")
        server.repo("org/gated").add(models["main"][1])
        server.repos["org/gated"].gated = True
        server.repo("org/tiny-GGUF").add(GGUF_FILES)
        server.repo("org/private").add(models["main"][1])
        server.repos["org/private"].token = "hf_test_token"
        yield server


def env_for(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    if env.get("PYTHONPATH"):  # absolute, for runs in another directory
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep))
    return env


def cli(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )


def assert_one_line_error(p: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> None:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert p.stdout == ""
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("moestream: error: ")
    assert [line for line in p.stderr.splitlines() if line.startswith("moestream")] == [last], p.stderr
    for f in fragments:
        assert f in last, (f, last)


def download(env: dict[str, str], hub_id: str, *extra: str) -> Path:
    p = cli(env, "download", hub_id, *extra)
    assert p.returncode == 0, p.stderr
    return Path(p.stdout.strip())


def test_download_fetches_the_model_files_only(hub, models, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    p = cli(env, "download", "org/tiny")
    assert p.returncode == 0, p.stderr
    assert "org/tiny: fetching 6 files" in p.stderr  # (huggingface_hub's bars show on a terminal only)
    path = Path(p.stdout.strip())
    assert path.parent.name == "snapshots"
    assert path.is_relative_to(tmp_path / "hub")  # HF_HOME's cache
    assert files_of(path) == models["main"][1]  # byte for byte; no .bin, README, images, subfolders
    fetched = {p.rsplit("/", 1)[-1] for p, _ in hub.gets()}
    assert fetched == set(models["main"][1])
    before = len(hub.gets())
    assert download(env, "org/tiny", "--quiet") == path  # cached: nothing fetched again
    assert len(hub.gets()) == before


def test_run_hub_id_matches_the_directory(hub, models, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    args = ("--prompt", "hi", "--gen", "3", "--json", "--ignore-eos")
    from_hub = cli(env, "run", "org/tiny", *args)
    assert from_hub.returncode == 0, from_hub.stderr
    local = cli(env, "run", str(models["main"][0]), *args)
    assert local.returncode == 0, local.stderr
    a, b = json.loads(from_hub.stdout), json.loads(local.stdout)
    assert a["prompt_ids"] == b["prompt_ids"] and a["generated_ids"] == b["generated_ids"]
    assert len(a["generated_ids"]) == 3
    budget = cli(env, "run", "org/tiny", *args, "--ram", "64M", "--threads", "1")  # from the cache, streamed
    assert budget.returncode == 0, budget.stderr
    assert json.loads(budget.stdout)["generated_ids"] == a["generated_ids"]
    api = (  # the same through the API, in a process that has the stand-in hub's environment
        "import json, moestream\n"
        "with moestream.load('org/tiny', ram='64M', context=16, threads=1) as m:\n"
        "    ids = m.tokenize('hi')\n"
        "    print(json.dumps([ids, list(m.generate(ids, 3, stop_at_eos=False))]))\n"
    )
    p = subprocess.run([sys.executable, "-c", api], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [a["prompt_ids"], a["generated_ids"]]


def test_inspect_fetches_the_config_only(hub, models, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    p = cli(env, "inspect", "org/tiny")
    assert p.returncode == 0, p.stderr
    assert "model: org/tiny" in p.stdout and "architecture: qwen3_moe, 2 layers" in p.stdout
    assert "bytes: as released" in p.stdout
    assert [path.rsplit("/", 1)[-1] for path, _ in hub.gets()] == ["config.json"]


def test_revisions(hub, models, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    v1 = download(env, "org/tiny@v1")
    assert files_of(v1) == models["v1"][1]
    assert download(env, "org/tiny", "--revision", "v1") == v1
    assert download(env, f"org/tiny@{v1.name}") == v1  # by commit
    assert_one_line_error(cli(env, "download", "org/tiny@nope"), "no revision 'nope'")


def test_dropped_connection_is_resumed(hub, tmp_path):
    """huggingface_hub writes what it receives in 10 MiB pieces: a file dropped at 12 MiB resumes at 10."""
    big = bytes(range(256)) * (24 << 12)  # 24 MiB
    hub.repo("org/big").add({"config.json": b"{}", "model.safetensors": big})
    hub.drop_once.add("model.safetensors")
    path = download(env_for(tmp_path, hub.endpoint), "org/big", "--quiet")
    assert (path / "model.safetensors").read_bytes() == big
    assert [r for _, r in hub.gets("model.safetensors")] == [None, f"bytes={10 << 20}-"]


def test_interrupted_download_resumes_in_the_next_run(hub, tmp_path):
    """Ctrl-C stops at once (exit 130); the next run fetches neither the files already complete nor the
    bytes of the interrupted file already written, and checks the pieced file's SHA-256."""
    env = env_for(tmp_path, hub.endpoint)
    big = bytes(range(256)) * (24 << 12)  # 24 MiB: stalls at 12, after the first 10 MiB piece is written
    hub.repo("org/big").add({"config.json": b"{}", "model.safetensors": big})
    hub.stall.add("model.safetensors")
    p = subprocess.Popen(
        [sys.executable, "-m", "moestream.cli", "download", "org/big", "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    partial = tmp_path / "hub" / "models--org--big" / "blobs" / f"{hashlib.sha256(big).hexdigest()}.incomplete"
    try:
        assert hub.stalled.wait(60)
        while not (partial.exists() and partial.stat().st_size == 10 << 20):  # the client has written its piece
            assert p.poll() is None
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130 and out == "" and "interrupted" in err, err
    hub.stall.clear()
    hub.release.set()
    before = len(hub.gets())
    path = download(env, "org/big", "--quiet")
    assert (path / "model.safetensors").read_bytes() == big
    assert hub.gets()[before:] == [(hub.gets()[-1][0], f"bytes={10 << 20}-")]  # config.json not again
    assert not list((tmp_path / "hub" / "models--org--big" / "blobs").glob("*incomplete*"))


def test_a_bad_partial_file_is_caught(hub, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    big = bytes(range(256)) * (12 << 12)  # 12 MiB
    hub.repo("org/big").add({"config.json": b"{}", "model.safetensors": big})
    blobs = tmp_path / "hub" / "models--org--big" / "blobs"
    blobs.mkdir(parents=True)
    etag = hashlib.sha256(big).hexdigest()
    (blobs / f"{etag}.incomplete").write_bytes(b"\xff" * 1000)  # not the file's first bytes
    assert_one_line_error(cli(env, "download", "org/big", "--quiet"), "fails its SHA-256", code=4)
    assert (download(env, "org/big", "--quiet") / "model.safetensors").read_bytes() == big


def test_listed_size_is_checked(hub, models, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    hub.listed_size[SHARD_1] = 1 << 60  # more than any disk: refused before a byte is fetched
    assert_one_line_error(cli(env, "download", "org/tiny", "--quiet"), "needs 1152921504.61 GB", "free")
    assert hub.gets() == []
    hub.listed_size = {"tokenizer.json": 7}
    p = cli(env, "download", "org/tiny", "--quiet")
    assert_one_line_error(p, "tokenizer.json has", "the hub lists 7", code=4)
    hub.listed_size.clear()
    assert files_of(download(env, "org/tiny", "--quiet")) == models["main"][1]  # the bad copy was removed


def test_hub_errors_are_one_line(hub, tmp_path):
    env = env_for(tmp_path, hub.endpoint)
    assert_one_line_error(cli(env, "download", "org/gated"), "org/gated", "gated", "HF_TOKEN")
    assert_one_line_error(cli(env, "download", "org/missing"), "org/missing", "no such model")
    assert_one_line_error(cli(env, "download", "org/private"), "no such model", "if it is private", "HF_TOKEN")
    (tmp_path / "org").mkdir()  # then org/missing was likely meant as a local path
    p = cli(env, "run", "org/missing", "--ids", "1", cwd=tmp_path)
    assert_one_line_error(p, "no such model", "nor is there a local org/missing")
    down = env_for(tmp_path, f"http://127.0.0.1:{free_port()}")
    assert_one_line_error(cli(down, "download", "org/tiny"), "cannot reach the Hugging Face hub", "not in the")


def test_token_from_the_environment(hub, models, tmp_path):
    path = download(env_for(tmp_path, hub.endpoint, HF_TOKEN="hf_test_token"), "org/private", "--quiet")
    assert files_of(path) == models["main"][1]


def test_offline_uses_the_cache(hub, models, tmp_path):
    env = env_for(tmp_path / "home", hub.endpoint)
    path = download(env, "org/tiny")
    before = len(hub.log)
    offline = env_for(tmp_path / "home", hub.endpoint, HF_HUB_OFFLINE="1")
    assert download(offline, "org/tiny") == path
    run = cli(offline, "run", "org/tiny", "--ids", "1,2,3", "--gen", "2", "--json")
    assert run.returncode == 0, run.stderr
    assert len(hub.log) == before  # not one request
    down = env_for(tmp_path / "home", f"http://127.0.0.1:{free_port()}")
    assert download(down, "org/tiny") == path  # the hub down: the cache serves
    empty = env_for(tmp_path / "empty", hub.endpoint, HF_HUB_OFFLINE="1")
    assert_one_line_error(cli(empty, "download", "org/tiny"), "not in the Hugging Face cache", "HF_HUB_OFFLINE")
    (path / SHARD_2).unlink()  # as if that file had never arrived
    assert_one_line_error(cli(offline, "download", "org/tiny"), f"lacks {SHARD_2}", "HF_HUB_OFFLINE")


def test_gguf_quant_pick(hub, tmp_path):
    env = env_for(tmp_path, hub.endpoint, HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    p = cli(env, "download", "org/tiny-GGUF:Q8_0", "--quiet")
    assert p.returncode == 0 and p.stderr == "", p.stderr  # --quiet: not a line
    path = Path(p.stdout.strip())
    assert path.is_relative_to(tmp_path / "hub-cache" / "models--org--tiny-GGUF")  # HF_HUB_CACHE over HF_HOME
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    assert [p.rsplit("/", 1)[-1] for p, _ in hub.gets()] == ["tiny-Q8_0.gguf"]  # not the other quants
    first = download(env, "org/tiny-GGUF:Q4_K_M", "--quiet")
    assert first.name == "tiny-Q4_K_M-00001-of-00002.gguf"
    for name in ("tiny-Q4_K_M-00001-of-00002.gguf", "tiny-Q4_K_M-00002-of-00002.gguf"):
        assert (first.parent / name).read_bytes() == GGUF_FILES[f"Q4_K_M/{name}"]
    assert_one_line_error(cli(env, "download", "org/tiny-GGUF"), "pick one with org/tiny-GGUF:QUANT", "Q8_0")
