"""Safe writes: pack never writes over (or deletes) its own source, and every writer leaves either the
whole new output or the old one, with no temporary behind, whatever fails halfway."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from moestream import atomic, synth
from moestream.errors import InputError
from moestream.formats import packed
from moestream.formats.safetensors import write_streaming
from test_cli import assert_user_error, cli


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A small checkpoint in a directory of its own (tmp_path/models/src)."""
    return synth.synth("qwen3_moe", tmp_path / "models" / "src", {"num_hidden_layers": 2}, progress=False)


class Boom(Exception):
    pass


def test_pack_onto_its_own_source_is_refused_and_the_source_is_intact(ckpt):
    before = snapshot(ckpt)
    p = cli("pack", str(ckpt), str(ckpt), "--force")
    assert_user_error(p, "source")
    assert snapshot(ckpt) == before


@pytest.mark.parametrize("where", ["inside", "parent", "grandparent", "symlink", "dotdot"])
def test_pack_into_or_over_its_source_is_refused(ckpt, where):
    dst = {
        "inside": ckpt / "packed",
        "parent": ckpt.parent,
        "grandparent": ckpt.parent.parent,
        "symlink": ckpt.parent / "link",
        "dotdot": ckpt / ".." / "src",
    }[where]
    if where == "symlink":
        dst.symlink_to(ckpt, target_is_directory=True)
    before = snapshot(ckpt)
    with pytest.raises(InputError, match="lies inside the source"):
        packed.pack(ckpt, dst, force=True, progress=False)
    assert snapshot(ckpt) == before
    assert sorted(p.name for p in ckpt.parent.iterdir()) == sorted(["src", *(["link"] if where == "symlink" else [])])


def test_pack_beside_its_source_works_and_replaces_an_old_store_whole(ckpt):
    dst = ckpt.parent / "packed"
    packed.pack(ckpt, dst, experts="q8_0", progress=False)
    first = snapshot(dst)
    packed.pack(ckpt, dst, force=True, progress=False)  # keep: another store in the same place
    assert snapshot(dst) != first and packed.PackedStore(dst).manifest["format"] == "moestream-packed"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["packed", "src"]  # nothing left aside
    assert oct(dst.stat().st_mode & 0o777) == oct(atomic.DIR_MODE)


@pytest.mark.parametrize("when", ["writing", "verifying"])
def test_an_interrupted_pack_leaves_the_old_store_and_no_temporary(ckpt, monkeypatch, when):
    dst = ckpt.parent / "packed"
    packed.pack(ckpt, dst, experts="q8_0", progress=False)
    old = snapshot(dst)
    calls = []

    def fail_third_write(self, arr, crc=0):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("disk gone")
        return real_write(self, arr, crc)

    def fail_verify(*args):
        raise Boom("verify")

    real_write = packed._Writer.write
    if when == "writing":
        monkeypatch.setattr(packed._Writer, "write", fail_third_write)
    else:
        monkeypatch.setattr(packed, "verify", fail_verify)
    with pytest.raises(Boom):
        packed.pack(ckpt, dst, force=True, progress=False)
    assert snapshot(dst) == old
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["packed", "src"]
    # and with no old store: no destination at all
    new = ckpt.parent / "new"
    calls.clear()
    with pytest.raises(Boom):
        packed.pack(ckpt, new, progress=False)
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["packed", "src"]


def test_an_interrupted_synth_leaves_the_old_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    out = synth.synth("mixtral", tmp_path / "m", {"num_hidden_layers": 2}, progress=False, shard_bytes=1 << 18)
    old = snapshot(out)
    assert len([p for p in old if p.endswith(".safetensors")]) > 1  # the failure comes after a whole shard
    made = []
    real = synth._random

    def fail_late(name, shape, seed):
        made.append(name)
        if len(made) == 20:
            raise Boom("interrupted")
        return real(name, shape, seed)

    monkeypatch.setattr(synth, "_random", fail_late)
    with pytest.raises(Boom):
        synth.synth("mixtral", out, {"num_hidden_layers": 2}, seed=1, force=True, progress=False, shard_bytes=1 << 18)
    assert snapshot(out) == old
    made.clear()
    with pytest.raises(Boom):
        synth.synth("mixtral", tmp_path / "other", {"num_hidden_layers": 2}, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_atomic_write_keeps_the_old_file_on_failure_and_gives_the_usual_mode(tmp_path):
    target = tmp_path / "out.json"
    with atomic.atomic_write(target, "w") as f:
        f.write("old")
    assert target.read_text() == "old"
    assert target.stat().st_mode & 0o777 == atomic.FILE_MODE  # not mkstemp's private 0600
    with pytest.raises(Boom), atomic.atomic_write(target, "w") as f:
        f.write("new, half written")
        raise Boom
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_write_fsyncs_the_file_then_the_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    with atomic.atomic_write(tmp_path / "f.bin") as f:
        f.write(b"x")
    assert len(synced) == 2
    assert Path(synced[0]).parent == Path(os.path.realpath(tmp_path)) and Path(synced[0]).name != "f.bin"
    assert synced[1] == os.path.realpath(tmp_path)


def test_atomic_dir_refuses_a_target_that_holds_the_source(tmp_path):
    src = tmp_path / "a" / "b"
    src.mkdir(parents=True)
    (src / "keep").write_text("x")
    for target in (tmp_path, tmp_path / "a", src, src / "c"):
        with pytest.raises(InputError, match="source"), atomic.atomic_dir(target, protect=[src], what="test") as d:
            (d / "f").write_text("never")
    assert (src / "keep").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    with atomic.atomic_dir(tmp_path / "beside", protect=[src]) as d:
        (d / "f").write_text("y")
    assert (tmp_path / "beside" / "f").read_text() == "y"


def test_atomic_dir_replaces_a_file_or_a_symlink_not_its_target(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(elsewhere, target_is_directory=True)
    with atomic.atomic_dir(link) as d:
        (d / "f").write_text("new")
    assert not link.is_symlink() and (link / "f").read_text() == "new"
    assert (elsewhere / "keep").read_text() == "x"
    plain = tmp_path / "plain"
    plain.write_text("a file")
    with atomic.atomic_dir(plain) as d:
        (d / "f").write_text("new")
    assert (plain / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link", "plain"]


def test_write_streaming_that_fails_leaves_no_file(tmp_path):
    ok = np.ones(4, np.float32)

    def bad() -> np.ndarray:
        return np.ones(5, np.float32)  # not the declared shape

    with pytest.raises(ValueError, match="declared"):
        write_streaming(tmp_path / "x.safetensors", [("a", "F32", (4,), lambda: ok), ("b", "F32", (4,), bad)])
    assert os.listdir(tmp_path) == []
