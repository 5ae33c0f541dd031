"""Integrity at run time (issue 42): the CRC-32C kernel; a packed store's bytes checked against the
manifest when read (--ram) or first used (resident), a mismatch ending the run with exit 4 and no token;
a file truncated under its map is one line and exit 4; non-finite weights refused by pack and non-finite
logits ending a run with exit 4; the manifest validated as it is read, fuzzed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fuzzing
import moestream
from fuzzing import byte_mutations, dump_json, expect_only_own_errors, json_mutations
from moestream import _C
from moestream.errors import CheckpointError, IntegrityError
from moestream.formats.packed import MANIFEST, PackedStore, pack, verify
from moestream.formats.safetensors import read_header
from moestream.synth import synth

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
PROMPT = "3,14,15,92,65,35,89,79"
FUZZ_BUDGET = 1000 * fuzzing.SCALE


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream", *args], capture_output=True, text=True, env=ENV, timeout=600
    )


def one_error_line(p: subprocess.CompletedProcess, code: int) -> str:
    assert p.returncode == code, p.stderr
    assert p.stdout == "" and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error: "), p.stderr
    return lines[0]


# ---- the CRC-32C kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("portable", [False, True])
def test_crc32c_known_vectors(portable):
    # the check value of the catalogue of CRCs, and RFC 3720's (iSCSI) vectors
    assert _C.crc32c(b"123456789", portable=portable) == 0xE3069283
    assert _C.crc32c(b"", portable=portable) == 0
    assert _C.crc32c(bytes(32), portable=portable) == 0x8A9136AA
    assert _C.crc32c(b"\xff" * 32, portable=portable) == 0x62A8AB43
    assert _C.crc32c(bytes(range(32)), portable=portable) == 0x46DD794E
    assert _C.crc32c(bytes(range(31, -1, -1)), portable=portable) == 0x113FDB5C


def test_crc32c_hardware_equals_portable_and_is_incremental():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 17, dtype=np.uint8)
    lengths = [0, 1, 7, 8, 9, 63, 4095, 4096, 12287, 12288, 12289, 3 * 4096 * 3 + 5, 100_000]
    lengths += [int(n) for n in rng.integers(0, 60_000, 40)]
    for n in lengths:
        for start in (0, 1, 3, 7, int(rng.integers(0, 4096))):
            buf = data[start : start + n]
            one = _C.crc32c(buf)
            assert one == _C.crc32c(buf, portable=True), (n, start)
            cut = int(rng.integers(0, len(buf) + 1))
            assert _C.crc32c(buf[cut:], _C.crc32c(buf[:cut])) == one, (n, start, cut)
    with pytest.raises(ValueError):
        _C.crc32c(b"x", 1 << 32)


# ---- a small packed model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    src = synth("qwen3_moe", root / "src", {"num_hidden_layers": 3}, seed=3, progress=False)
    return pack(src, root / "packed", experts="q8_0", trunk="keep", progress=False)


@pytest.fixture(scope="module")
def low_budget(store) -> str:
    p = cli("run", str(store), "--ids", PROMPT, "--gen", "4", "--ram", "1M")
    m = re.search(r"needs at least (\d+) MB", p.stderr)
    assert m, p.stderr
    return f"{int(m.group(1)) + 1}M"


@pytest.fixture(scope="module")
def used_experts(store, tmp_path_factory) -> list[tuple[int, int]]:
    """The (layer, expert)s a run of the prompt asks for, in order (from --trace of a good run)."""
    trace = tmp_path_factory.mktemp("trace") / "t.jsonl"
    p = cli("run", str(store), "--ids", PROMPT, "--gen", "4", "--json", "--trace", str(trace))
    assert p.returncode == 0, p.stderr
    records = [json.loads(x) for x in trace.read_text().splitlines()]
    return [(r["layer"], e) for r in records for e in r["experts"]]


def copy_store(store: Path, dst: Path) -> Path:
    shutil.copytree(store, dst)
    return dst


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x5A]))


def trunk_entry_of_layer(store: Path, layer: int) -> dict:
    m = json.loads((store / MANIFEST).read_text())
    return next(
        e
        for n, e in [*m["tensors"].items(), *m["matrices"].items()]
        if e["file"] == "trunk" and f"layers.{layer}." in n
    )


def test_manifest_carries_crc32c_of_entries_and_blobs(store):
    m = json.loads((store / MANIFEST).read_text())
    assert m["version"] == 2
    s = PackedStore(store)
    entries = s.entries()
    assert any(n.startswith("expert blob ") for n, _ in entries)
    for _, e in entries:
        assert e["crc32c"] == _C.crc32c(s._bytes(e))
    verify(store)


@pytest.mark.parametrize("where", ["experts", "trunk"])
@pytest.mark.parametrize("budget", ["resident", "ram"])
def test_flipped_bytes_exit_4_without_output(store, low_budget, used_experts, tmp_path, where, budget):
    bad = copy_store(store, tmp_path / "bad")
    m = json.loads((bad / MANIFEST).read_text())
    if where == "experts":
        layer, expert = used_experts[0]
        blob = m["expert_blobs"][f"{layer}.{expert}"]
        offset = blob["offset"] + blob["nbytes"] // 2
    else:
        e = trunk_entry_of_layer(bad, 1)
        offset = e["offset"] + e["nbytes"] // 2
    flip_byte(bad / f"{where}.bin", offset)
    extra = ["--ram", low_budget] if budget == "ram" else []
    p = cli("run", str(bad), "--ids", PROMPT, "--gen", "4", *extra)  # text streamed as it comes
    line = one_error_line(p, 4)
    assert f"{where}.bin: checksum mismatch at offset" in line, line
    # the same store unharmed runs (the check is of the bytes, not of the run)
    assert cli("run", str(store), "--ids", PROMPT, "--gen", "4", *extra).returncode == 0


def test_only_the_blobs_used_are_checked(store, low_budget, used_experts, tmp_path):
    """A corrupt blob of an expert no token asks for costs nothing (resident: blobs are checked on first
    use; --ram: when read); the one asked for fails in the pass that needs it, through the Python API too."""
    bad = copy_store(store, tmp_path / "bad")
    m = json.loads((bad / MANIFEST).read_text())
    unused = next(k for k in m["expert_blobs"] if tuple(map(int, k.split("."))) not in set(used_experts))
    flip_byte(bad / "experts.bin", m["expert_blobs"][unused]["offset"] + 3)
    for extra in ([], ["--ram", low_budget, "--no-prefetch"]):
        p = cli("run", str(bad), "--ids", PROMPT, "--gen", "4", "--json", *extra)
        assert p.returncode == 0, p.stderr
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        verify_store_entries(bad)
    layer, expert = used_experts[-1]
    flip_byte(bad / "experts.bin", m["expert_blobs"][f"{layer}.{expert}"]["offset"] + 3)
    model = moestream.load(bad, threads=1)
    with pytest.raises(IntegrityError, match=r"experts\.bin: checksum mismatch"):
        list(model.generate([int(x) for x in PROMPT.split(",")], 4, stop_at_eos=False))


@pytest.mark.parametrize("where", ["experts", "trunk"])
def test_a_part_that_failed_its_check_is_checked_again(store, used_experts, tmp_path, where):
    """A process that goes on after an IntegrityError (the server) must not run the failed bytes unchecked
    the next time: resident checks mark a part or blob checked only once it passed."""
    bad = copy_store(store, tmp_path / "bad")
    m = json.loads((bad / MANIFEST).read_text())
    if where == "experts":
        layer, expert = used_experts[0]
        flip_byte(bad / "experts.bin", m["expert_blobs"][f"{layer}.{expert}"]["offset"] + 3)
    else:
        flip_byte(bad / "trunk.bin", trunk_entry_of_layer(bad, 1)["offset"] + 3)
    model = moestream.load(bad, threads=1)
    for _ in range(2):
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            list(model.generate([int(x) for x in PROMPT.split(",")], 4, stop_at_eos=False))


def test_a_failed_streamed_read_gives_back_its_slot_and_pins(store, low_budget, used_experts, tmp_path):
    """After a read fails its check under --ram, every slot is free or holds an expert, nothing stays pinned,
    and the next request of other experts is served (the server goes on after the error)."""
    from moestream.runtime.planner import parse_size
    from moestream.runtime.streaming import attach

    bad = copy_store(store, tmp_path / "bad")
    m = json.loads((bad / MANIFEST).read_text())
    layer, expert = used_experts[0]
    flip_byte(bad / "experts.bin", m["expert_blobs"][f"{layer}.{expert}"]["offset"] + 3)
    model = moestream.load(bad, threads=1)
    streaming = attach(model, model.store, parse_size(low_budget), context=64, prompt_tokens=8, prefetch=False)
    try:
        cache = streaming.cache
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            cache.request(layer, [expert])
        assert len(cache.free) + len(cache.slot_of) == cache.n_slots and not cache.pins
        others = [e for (la, e) in cache.templates if la == layer and e != expert]
        for e in others:  # more experts than slots, or all of the layer's: the slots are usable again
            cache.request(layer, [e])
            cache.release(layer, [e])
        assert not cache.pins
    finally:
        streaming.close()


def verify_store_entries(path: Path) -> None:
    s = PackedStore(path)
    for _, e in s.entries():
        s.check_entry(e)


def test_version_1_store_is_refused_with_repack(store, tmp_path):
    old = copy_store(store, tmp_path / "old")
    m = json.loads((old / MANIFEST).read_text())
    m["version"] = 1
    (old / MANIFEST).write_text(json.dumps(m))
    line = one_error_line(cli("run", str(old), "--ids", PROMPT, "--gen", "1"), 2)
    assert "repack" in line


# ---- a file truncated under its map ------------------------------------------------------------------

TRUNCATE_SCRIPT = """
import os, sys
import moestream
path, victim = sys.argv[1], sys.argv[2]
model = moestream.load(path, threads=1, preload=False)
ids = [3, 14, 15, 92]
model.logits(ids)
os.truncate(victim, 0)
model.logits(ids)
print("survived")
"""


@pytest.mark.parametrize("victim", ["experts.bin", "trunk.bin", "checkpoint"])
def test_truncated_while_mapped_is_one_line_and_exit_4(store, tmp_path, victim):
    if victim == "checkpoint":
        model = synth("qwen3_moe", tmp_path / "ckpt", {"num_hidden_layers": 2}, seed=4, progress=False)
        target = next(model.glob("*.safetensors"))
    else:
        model = copy_store(store, tmp_path / "s")
        target = model / victim
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRUNCATE_SCRIPT), str(model), str(target)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    line = one_error_line(p, 4)
    assert line.startswith(f"moestream: error: {target} was truncated or changed while mapped (SIGBUS at offset ")


# ---- non-finite weights and logits -------------------------------------------------------------------


OTHER_SIGBUS_SCRIPT = """
import mmap, os, sys
import numpy as np
from moestream.formats.packed import guard_map
guarded, other = sys.argv[1], sys.argv[2]
keep = np.memmap(guarded, np.uint8, "r")
guard_map(keep, guarded)  # the guard is installed, for another file
with open(other, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
    os.truncate(other, 0)
    m[4096 * 3]  # a fault outside every guarded map
"""


def test_a_sigbus_outside_the_guarded_maps_is_not_reported_as_one(tmp_path):
    """The guard speaks only for the model's own maps: any other SIGBUS goes to the handler before it (here
    the default), so a crash elsewhere is not passed off as a changed model file."""
    guarded, other = tmp_path / "guarded.bin", tmp_path / "other.bin"
    guarded.write_bytes(b"x" * 8192)
    other.write_bytes(b"y" * 4096 * 8)
    p = subprocess.run([sys.executable, "-c", OTHER_SIGBUS_SCRIPT, str(guarded), str(other)], capture_output=True)
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stderr)
    assert b"truncated or changed" not in p.stderr


def poison(ckpt: Path, name: str) -> None:
    """Writes a NaN over the first element of tensor `name` in its shard."""
    for shard in ckpt.glob("*.safetensors"):
        info = read_header(shard).get(name)
        if info is not None:
            with open(shard, "r+b") as f:
                f.seek(info.offset)
                f.write(np.array([np.nan], info.np_dtype).tobytes())
            return
    raise AssertionError(f"no tensor {name}")


@pytest.mark.parametrize(
    ("tensor", "experts"),
    [("model.norm.weight", "keep"), ("model.layers.1.mlp.experts.2.down_proj.weight", "q8_0")],
)
def test_pack_refuses_nonfinite_weights_unless_allowed(tmp_path, tensor, experts):
    src = synth("qwen3_moe", tmp_path / "src", {"num_hidden_layers": 2}, seed=7, progress=False)
    poison(src, tensor)
    line = one_error_line(cli("pack", str(src), str(tmp_path / "p"), "--experts", experts), 2)
    assert tensor in line and "--allow-nonfinite" in line
    assert not (tmp_path / "p").exists()
    p = cli("pack", str(src), str(tmp_path / "p"), "--experts", experts, "--allow-nonfinite")
    assert p.returncode == 0, p.stderr


def test_nonfinite_logits_exit_4(tmp_path):
    src = synth("qwen3_moe", tmp_path / "src", {"num_hidden_layers": 2}, seed=7, progress=False)
    poison(src, "model.norm.weight")
    assert cli("pack", str(src), str(tmp_path / "p"), "--allow-nonfinite").returncode == 0
    for model in (src, tmp_path / "p"):
        line = one_error_line(cli("run", str(model), "--ids", PROMPT, "--gen", "3"), 4)
        assert f"position {len(PROMPT.split(',')) - 1}" in line and "not finite" in line


# ---- the manifest loader -----------------------------------------------------------------------------


def edited(store: Path, dst: Path, edit) -> Path:
    s = copy_store(store, dst)
    m = json.loads((s / MANIFEST).read_text())
    edit(m)
    (s / MANIFEST).write_text(json.dumps(m))
    return s


def first_tensor(m: dict) -> dict:
    return next(iter(m["tensors"].values()))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m["files"].update(trunk="../trunk.bin"), "not a plain file name"),
        (lambda m: m["files"].update(trunk="/etc/passwd"), "not a plain file name"),
        (lambda m: first_tensor(m).update(offset=1 << 40), "reaches byte"),
        (lambda m: first_tensor(m).update(offset=-1), "integer offset"),
        (lambda m: first_tensor(m).update(dtype="F128"), "does not make"),
        (lambda m: first_tensor(m).update(shape=[3, 3]), "does not make"),
        (lambda m: next(iter(m["matrices"].values())).update(format="q9_z"), "unknown format"),
        (lambda m: next(iter(m["matrices"].values())).update(rows=2), "does not make"),
        (lambda m: next(iter(m["expert_blobs"].values())).update(crc32c=1 << 32), "crc32c"),
        (lambda m: m["expert_blobs"].update({"../1": {"offset": 0, "nbytes": 0, "crc32c": 0}}), "LAYER.EXPERT"),
        (lambda m: m.update(tensors=[]), "must be an object"),
    ],
)
def test_bad_manifests_are_one_checkpoint_error(store, tmp_path, edit, match):
    bad = edited(store, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        PackedStore(bad)


def test_a_fifo_in_the_store_is_refused_without_blocking(store, tmp_path):
    bad = copy_store(store, tmp_path / "bad")
    (bad / "experts.bin").unlink()
    os.mkfifo(bad / "experts.bin")
    line = one_error_line(cli("run", str(bad), "--ids", PROMPT, "--gen", "1"), 2)  # cli's timeout guards a hang
    assert "not a regular file" in line


def touch_everything(s: PackedStore) -> None:
    """A tiny use of a loaded store: every tensor and matrix built over its bytes, every CRC taken."""
    for name in s.tensors:
        s.array(name).view(np.uint8)[:1].sum()
    for name, e in s.manifest["matrices"].items():
        w = s.matrix(name, e["rows"], e["cols"])
        assert w is not None
        w.data.reshape(-1)[:1].sum()
    for _, e in s.entries():
        s.crc_ok(e)


def test_fuzzed_manifests_give_only_own_errors(store, tmp_path):
    work = copy_store(store, tmp_path / "fuzz")
    manifest = json.loads((work / MANIFEST).read_text())

    def load_json(doc) -> None:
        (work / MANIFEST).write_bytes(dump_json(doc))
        touch_everything(PackedStore(work))

    def load_bytes(raw: bytes) -> None:
        (work / MANIFEST).write_bytes(raw)
        touch_everything(PackedStore(work))

    accepted = expect_only_own_errors(load_json, json_mutations(manifest, FUZZ_BUDGET, seed=42))
    assert accepted < FUZZ_BUDGET  # the mutations reach the validation
    expect_only_own_errors(load_bytes, byte_mutations((store / MANIFEST).read_bytes(), FUZZ_BUDGET // 4, seed=43))
