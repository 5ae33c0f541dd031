"""State files: a state is accepted only by a model with the very same weights (one changed byte anywhere
is refused), and a damaged or hostile file is one InputError, decided from the zip directory and the
.npy headers before anything is allocated (a header claiming 1 TiB allocates nothing)."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuzzing
import moestream
from fuzzing import byte_mutations, dump_json, expect_only_own_errors, json_mutations
from moestream import state_file
from moestream.default_model import default_model_path
from moestream.errors import InputError
from moestream.formats import packed
from moestream.state_file import load_state, save_state
from moestream.synth import synth
from test_cli import ENV, assert_user_error, cli

FUZZ_INPUTS = 2000 * fuzzing.SCALE  # per mutator
AN_HOUR_AGO = time.time() - 3600


@pytest.fixture(autouse=True)
def digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "moestream" / "digests"


def age(root: Path) -> None:
    """Dates every file under root an hour back, as a model downloaded earlier is (digests of files
    modified within the last seconds are not cached)."""
    for p in root.rglob("*"):
        os.utime(p, (AN_HOUR_AGO, AN_HOUR_AGO))


def flip_last_byte(info: Any) -> None:
    """One bit of the last byte of a tensor: past the leading bytes any sampling would look at."""
    with open(info.path, "r+b") as f:
        f.seek(info.offset + info.nbytes - 1)
        b = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([b ^ 1]))


def a_deep_tensor(store: Any) -> Any:
    """The last tensor by name of the last shard: not among the first few a sampled digest reads."""
    last_shard = max(i.path for i in store.tensors.values())
    return store.tensors[max(n for n, i in store.tensors.items() if i.path == last_shard)]


def prefilled(model: Any, n: int = 9) -> Any:
    st = model.new_state()
    model.decoder.forward(list(range(3, 3 + n)), st, model.ctx)
    return st


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A small Kimi K3 checkpoint (KDA and MLA caches), dated in the past."""
    path = synth("kimi_k3", tmp_path / "k3", {"num_hidden_layers": 2}, progress=False, shard_bytes=1 << 20)
    age(path)
    return path


def test_one_changed_weight_byte_in_a_checkpoint_is_refused_on_the_command_line(tmp_path, digest_cache):
    model = tmp_path / "demo"
    shutil.copytree(default_model_path(), model)
    age(model)
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    s = tmp_path / "s.npz"
    run = ("run", str(model), "--prompt", "def f(x):", "--gen", "3", "--json")
    assert cli(*run, "--save-state", str(s), env=env).returncode == 0
    assert len(list(digest_cache.glob("*.json"))) == 2  # one per shard
    again = cli("run", str(model), "--load-state", str(s), "--gen", "3", "--json", env=env)
    assert again.returncode == 0, again.stderr
    flip_last_byte(a_deep_tensor(moestream.load(model).store))
    assert_user_error(cli("run", str(model), "--load-state", str(s), "--gen", "3", env=env), "another model")


def test_the_digest_covers_every_byte_and_its_cache_follows_the_file(small, monkeypatch, digest_cache):
    m = moestream.load(small)
    first = state_file.fingerprint(m)
    assert len(list(digest_cache.glob("*.json"))) == len({i.path for i in m.store.tensors.values()}) > 1

    def no_hashing(*args):
        raise AssertionError("hashed again although the shard is unchanged")

    with monkeypatch.context() as mp:
        mp.setattr(state_file, "_hash_tensors", no_hashing)
        assert state_file.fingerprint(moestream.load(small)) == first  # from the cache
    info = a_deep_tensor(m.store)
    flip_last_byte(info)  # in place: the same path, inode and size, a new mtime
    changed = state_file.fingerprint(moestream.load(small))
    assert changed != first
    flip_last_byte(info)
    os.utime(info.path, (AN_HOUR_AGO, AN_HOUR_AGO))
    assert state_file.fingerprint(moestream.load(small)) == first


def test_a_just_modified_shard_is_hashed_but_not_cached(small, digest_cache):
    shard = sorted(small.glob("*.safetensors"))[0]
    os.utime(shard)  # now
    state_file.fingerprint(moestream.load(small))
    cached = [json.loads(p.read_text())["key"]["path"] for p in digest_cache.glob("*.json")]
    assert str(shard.resolve()) not in cached and len(cached) == len(list(small.glob("*.safetensors"))) - 1


def test_a_state_from_a_pack_of_other_weights_is_refused(small, tmp_path):
    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "other"
    packed.pack(small, a, progress=False)
    packed.pack(small, b, progress=False)  # the same weights in another place
    ma = moestream.load(a)
    st = prefilled(ma)
    s = tmp_path / "s.npz"
    save_state(s, ma, st, [4])
    back, pending = load_state(s, moestream.load(b))
    assert back.ids == st.ids and pending == [4]
    flip_last_byte(a_deep_tensor(moestream.load(small).store))
    packed.pack(small, other, progress=False)
    with pytest.raises(InputError, match="another model"):
        load_state(s, moestream.load(other))


def test_round_trip_continues_with_the_same_logits(small, tmp_path):
    m = moestream.load(small)
    st = prefilled(m, 21)
    s = tmp_path / "s.npz"
    save_state(s, m, st)
    back, pending = load_state(s, m, max_tokens=21)
    assert pending == [] and back.ids == st.ids
    assert np.array_equal(m.decoder.forward([5], st, m.ctx), m.decoder.forward([5], back, m.ctx))
    with pytest.raises(InputError, match="over the context of 20"):
        load_state(s, m, max_tokens=20)


# ---- hostile files --------------------------------------------------------------------------------


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_zip(path: Path, items: list[tuple[str, bytes]], compress: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compress) as z, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a duplicate name is what some cases want
        for name, data in items:
            z.writestr(name, data)
    return path


def npy(arr: np.ndarray | None = None, *, header: dict[str, Any] | None = None, data: bytes = b"") -> bytes:
    """An .npy member: arr's, or a bare header (descr, fortran_order, shape) followed by data."""
    f = io.BytesIO()
    if arr is not None:
        np.save(f, arr, allow_pickle=True)
        return f.getvalue()
    np.lib.format.write_array_header_1_0(f, header)
    return f.getvalue() + data


@pytest.fixture
def saved(small, tmp_path) -> tuple[Any, Path, dict[str, bytes]]:
    m = moestream.load(small)
    s = tmp_path / "s.npz"
    save_state(s, m, prefilled(m), [4])
    return m, s, members(s)


def a_latent(items: dict[str, bytes]) -> str:
    """A member whose array has a position axis (an MLA latent cache)."""
    return next(n for n in items if n.endswith(".c.npy"))


def test_a_header_claiming_a_tebibyte_is_refused_without_allocating_it(saved, tmp_path):
    m, _, items = saved
    name = a_latent(items)
    huge = {"descr": "<f4", "fortran_order": False, "shape": (1 << 28, 1 << 10)}  # 1 TiB of float32
    cases = {
        "short member": npy(header=huge, data=b"\0" * 64),
        "right dims": npy(header={**huge, "shape": (1 << 40, np.load(io.BytesIO(items[name])).shape[1])}),
    }
    for what, member in cases.items():
        bad = write_zip(tmp_path / "bad.npz", [(n, member if n == name else d) for n, d in items.items()])
        tracemalloc.start()
        try:
            with pytest.raises(InputError, match="claims") as e:
                load_state(bad, m)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, (what, peak)
        assert len(str(e.value).splitlines()) == 1


def test_more_positions_than_the_state_can_have_are_refused(saved, tmp_path):
    m, s, items = saved
    name = a_latent(items)
    arr = np.load(io.BytesIO(items[name]))
    n_ids = len(load_state(s, m)[0].ids)
    padded = np.zeros((max(16, 2 * n_ids) + 1, arr.shape[1]), np.float32)  # real bytes, one row too many
    bad = write_zip(tmp_path / "bad.npz", [(n, npy(padded) if n == name else d) for n, d in items.items()])
    with pytest.raises(InputError, match="positions on axis 0"):
        load_state(bad, m)


def meta_of(items: dict[str, bytes]) -> dict[str, Any]:
    return json.loads(np.load(io.BytesIO(items["meta.npy"])).tobytes())


def with_meta(items: dict[str, bytes], meta: Any) -> list[tuple[str, bytes]]:
    raw = np.frombuffer(dump_json(meta), np.uint8)
    return [(n, npy(raw) if n == "meta.npy" else d) for n, d in items.items()]


def hostile(items: dict[str, bytes], case: str) -> tuple[list[tuple[str, bytes]], int]:
    """(members, compression) of a damaged or hostile variant of a good state file."""
    latent = a_latent(items)
    arr = np.load(io.BytesIO(items[latent]))
    meta = meta_of(items)
    swap = {
        "pickle": npy(np.array([{"a": 1}], dtype=object)),
        "fortran": npy(np.asfortranarray(arr)),
        "big-endian": npy(arr.astype(">f4")),
        "float64": npy(arr.astype(np.float64)),
        "npy v3": items[latent][:6] + b"\x03\x00" + items[latent][8:],
    }
    if case in swap:
        return [(n, swap[case] if n == latent else d) for n, d in items.items()], zipfile.ZIP_STORED
    plain = list(items.items())
    if case == "compressed":
        return plain, zipfile.ZIP_DEFLATED
    if case == "unknown member":
        return [*plain, ("extra.npy", items[latent])], zipfile.ZIP_STORED
    if case == "duplicate member":
        return [*plain, (latent, items[latent])], zipfile.ZIP_STORED
    if case == "missing member":
        return [(n, d) for n, d in plain if n != latent], zipfile.ZIP_STORED
    edits: dict[str, Any] = {
        "ids not ints": {**meta, "ids": [1.5, *meta["ids"][1:]]},
        "ids as bools": {**meta, "ids": [True] * len(meta["ids"])},
        "id out of range": {**meta, "ids": [10**6, *meta["ids"][1:]]},
        "version true": {**meta, "version": True},
        "extra key": {**meta, "x": 1},
        "layers not dicts": {**meta, "layers": [1] * len(meta["layers"])},
        "wrong class": {**meta, "layers": [{**meta["layers"][0], "class": "KVCache"}, *meta["layers"][1:]]},
        "length mismatch": {
            **meta,
            "layers": [{**meta["layers"][0], "scalars": {"length": 10**9}}, *meta["layers"][1:]],
        },
        "meta a list": [meta],
    }
    return with_meta(items, edits[case]), zipfile.ZIP_STORED


HOSTILE = {  # the case and what the one line says
    "pickle": "not a plain C-order",
    "fortran": "not a plain C-order",
    "big-endian": "the model needs float32",
    "float64": "the model needs float32",
    "npy v3": "format version",
    "compressed": "compressed",
    "unknown member": "unexpected member",
    "duplicate member": "appears twice",
    "missing member": "is missing",
    "ids not ints": "token ids",
    "ids as bools": "token ids",
    "id out of range": "token ids",
    "version true": "version True",
    "extra key": "meta has keys",
    "layers not dicts": "not an object",
    "wrong class": "the model needs KDAState",
    "length mismatch": "holds 1000000000 positions",
    "meta a list": "not a moestream state file",
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_state_files_are_one_input_error(saved, tmp_path, case):
    m, _, items = saved
    parts, compression = hostile(items, case)
    bad = write_zip(tmp_path / "bad.npz", parts, compression)
    with pytest.raises(InputError, match=HOSTILE[case]) as e:
        load_state(bad, m)
    assert len(str(e.value).splitlines()) == 1


def test_a_fifo_is_refused_without_waiting(tmp_path, saved):
    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        load_state(fifo, saved[0])


# ---- fuzzing --------------------------------------------------------------------------------------


def test_fuzzed_state_files_give_only_input_errors(saved, tmp_path, monkeypatch):
    m, s, items = saved
    digest = state_file.fingerprint(m)
    monkeypatch.setattr(state_file, "fingerprint", lambda model: digest)  # the parsing is what is fuzzed
    target = tmp_path / "fuzzed.npz"

    def load_bytes(data: bytes) -> object:
        target.write_bytes(data)
        return load_state(target, m)

    def load_meta(meta: Any) -> object:
        write_zip(target, with_meta(items, meta))
        return load_state(target, m)

    accepted = expect_only_own_errors(load_bytes, byte_mutations(s.read_bytes(), FUZZ_INPUTS, seed=1))
    assert accepted < FUZZ_INPUTS  # most mutants are refused, a few (bytes of cache data) load
    expect_only_own_errors(load_meta, json_mutations(meta_of(items), FUZZ_INPUTS, seed=2))
