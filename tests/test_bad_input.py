"""One line and exit code 2 for every class of bad input a hostile tester tried (issue 42): wrong types
and non-finite values in config.json, sizes that would make `inspect` run for minutes, index file names
that leave the model directory, FIFOs where files belong (refused, not waited on), corrupt safetensors
headers, and out-of-range numbers on the command line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from moestream.cli import main
from moestream.formats.checkpoint import INDEX
from test_cli import assert_user_error, cli


@pytest.fixture()
def model(small_case, tmp_path):
    """A fresh copy of a good single-file checkpoint to break."""
    dst = tmp_path / "model"
    shutil.copytree(small_case.path, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))  # NaN and Infinity as Python writes them


def main_in_process(*args: str) -> subprocess.CompletedProcess:
    """The CLI's main() in this process (a subprocess costs seconds of imports per case), its exit code
    and output as cli() returns them. For inputs refused before anything could block."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = int(e.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return main_in_process("run", str(path), "--ids", "1,2", "--gen", "1", "--json", *extra)


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, ("rope_theta", "must be float")),
        ({"rms_norm_eps": float("nan")}, ("rms_norm_eps", "finite")),
        ({"rms_norm_eps": float("inf")}, ("rms_norm_eps", "finite")),
        ({"rms_norm_eps": -1e-6}, ("rms_norm_eps", "positive")),
        ({"rope_parameters": {"rope_theta": float("-inf")}}, ("rope_theta", "finite")),
        ({"vocab_size": 10**400}, ("vocab_size", "out of range")),
        ({"hidden_size": 10**9}, ("hidden_size", "more than")),
        ({"eos_token_id": ["x"]}, ("eos_token_id", "token ids")),
        ({"head_dim": -12}, ("head_dim", "negative")),
    ],
)
def test_config_values_refused(model, changes, fragments):
    edit_config(model, **changes)
    assert_user_error(run(model), "config.json", *fragments)


def test_nan_eps_through_the_cli(model):
    """NaN rms_norm_eps made every generated id 0 with exit 0."""
    edit_config(model, rms_norm_eps=float("nan"))
    assert_user_error(cli("run", str(model), "--ids", "1", "--json"), "rms_norm_eps", "finite")


def test_inspect_refuses_a_billion_layers_at_once(tmp_path):
    """inspect builds every layer of the config it describes: a bound on the sizes keeps it quick."""
    from moestream.synth import make_config

    config, _ = make_config("qwen3_moe", {}, "bf16")
    for key, value in (("num_hidden_layers", 10**9), ("num_experts", 10**6)):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        assert_user_error(main_in_process("inspect", str(tmp_path)), key)


def write_index(path: Path, weight_map: object) -> None:
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("name", ["../model.safetensors", "/etc/passwd", "a/../../model.safetensors", ""])
def test_index_names_that_leave_the_directory(model, name):
    write_index(model, {"model.norm.weight": name})
    assert_user_error(run(model), INDEX, "leaves the model directory")


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"model.norm.weight": 5}, None])
def test_index_of_the_wrong_shape(model, weight_map):
    write_index(model, weight_map)
    assert_user_error(run(model), INDEX)


def test_hugging_face_cache_symlinks_are_fine(small_case, tmp_path):
    """snapshots/<rev>/ holds symlinks to ../../blobs/: names in the index stay in the directory, the
    files they point to do not, and that is how the cache is laid out."""
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    weights = {}
    for f in small_case.path.iterdir():
        shutil.copy(f, blobs / f"blob-{f.name}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob-{f.name}")
        weights[f.name] = f
    header = json.loads(cli_header(small_case.path / "model.safetensors"))
    write_index(snapshot, {name: "model.safetensors" for name in header if name != "__metadata__"})
    p = run(snapshot)
    assert p.returncode == 0, p.stderr


def cli_header(path: Path) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n]


@pytest.mark.parametrize("fifo_name", ["config.json", "model.safetensors", INDEX])
def test_fifo_refused_without_waiting(model, fifo_name):
    """A FIFO never gets a writer here: opening it to read would block forever."""
    target = model / fifo_name
    if target.exists():
        target.unlink()
    if fifo_name == INDEX:
        write_index(model, {"model.norm.weight": "model.safetensors"})
        target.unlink()
    os.mkfifo(target)
    p = cli("run", str(model), "--ids", "1", "--json")  # a subprocess: cli() gives up after 300 s
    assert_user_error(p, fifo_name, "not a regular file")
    if fifo_name == "config.json":
        assert_user_error(cli("inspect", str(model)), fifo_name, "not a regular file")


def rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _overlap(h):
    a, b = [n for n in h if n != "__metadata__" and h[n]["dtype"] == "F32" and len(h[n]["shape"]) == 2][:2]
    h[b]["data_offsets"] = h[a]["data_offsets"]
    h[b]["shape"] = h[a]["shape"]


def _float_shape(h):
    h["model.norm.weight"]["shape"] = [float(h["model.norm.weight"]["shape"][0])]


def _three_offsets(h):
    h["model.norm.weight"]["data_offsets"].append(0)


def _not_an_object(h):
    h["model.norm.weight"] = "F32"


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (_overlap, "overlap"),
        (_float_shape, "shape"),
        (_three_offsets, "data_offsets"),
        (_not_an_object, "model.norm.weight"),
    ],
)
def test_corrupt_safetensors_header(model, edit, fragment):
    rewrite_header(model / "model.safetensors", edit)
    assert_user_error(run(model), "model.safetensors", fragment)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--seed", "-1"), "--seed"),
        (("--seed", str(2**64)), "--seed"),
        (("--ram", "9" * 400), "--ram"),
        (("--ram", "0"), "--ram"),
        (("--ram", "5P"), "--ram"),
        (("--gen", "1" + "0" * 30), "--gen"),
        (("--threads", "1000000"), "--threads"),
        (("--temperature", "nan"), "--temperature"),
        (("--top-p", "inf"), "--top-p"),
        (("--repeat-penalty", "inf"), "--repeat-penalty"),
        (("--top-k", "1e3"), "--top-k"),
    ],
)
def test_cli_numbers_out_of_range(tmp_path, args, fragment):
    """Refused while the arguments are parsed, before any model is looked for."""
    assert_user_error(main_in_process("run", str(tmp_path), "--ids", "1", *args), fragment)


def test_seed_and_ram_through_the_cli(tmp_path):
    """The two numbers that gave tracebacks, end to end."""
    assert_user_error(cli("run", str(tmp_path), "--ids", "1", "--seed", "-1"), "--seed")
    assert_user_error(cli("run", str(tmp_path), "--ids", "1", "--ram", "9" * 400), "--ram")


@pytest.mark.parametrize(
    "args",
    [
        ("chat", "--ctx", "0"),
        ("serve", "--port", "70000"),
        ("doctor", "--seconds", "nan"),
        ("synth", "--arch", "qwen3_moe", "out", "--shard-size", "nan"),
        ("synth", "--arch", "qwen3_moe", "out", "--seed", "-5"),
        ("bench", "m", "--ram", "1G," + "9" * 400),
    ],
)
def test_numbers_of_other_commands(args):
    flag = next(a for a in args if a.startswith("--") and a != "--arch")
    assert_user_error(main_in_process(*args), flag)
