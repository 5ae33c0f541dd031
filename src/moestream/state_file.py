"""Saved sequence state (--save-state / --load-state): every layer's cache (KV, MLA latent, KDA
recurrent state) and the token ids so far, so a long prompt is prefilled once and continued later.

The file is an uncompressed .npz (a zip of .npy arrays) holding `meta.npy` (JSON as uint8 bytes: format
name, version, the model's digest, ids, each layer's cache class and integer fields) and one array per
cache field, `L{layer}.{field}.npy`. It is written atomically (atomic.py).

A state is only accepted by the model it came from: the digest covers config.json, the tensor table and
every weight byte (a packed store: its manifest, which holds every entry's CRC; a checkpoint: a sha256 of
each tensor's bytes, computed once per shard and cached). Loading trusts nothing in the file: the zip
directory and each array's .npy header are checked against the caches this model makes (class, dtype,
shape, the position axis within twice the tokens held) and against the bytes the file really holds
before anything is allocated or read, and the digest is compared before any array data is read."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import stat
import struct
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write
from .errors import InputError
from .formats.safetensors import TensorInfo
from .models.base import State
from .ordered_map import ordered_map

FORMAT = "moestream-state"
VERSION = 2  # 2: the digest covers every weight byte (1 sampled a few tensors' first bytes)
META = "meta"
META_KEYS = {"format", "version", "fingerprint", "model_type", "ids", "pending", "layers"}
LAYER_KEYS = {"class", "scalars", "arrays"}
MAX_META_BYTES = 1 << 28  # meta is ids and a few fields per layer; this is far beyond any real context
MIN_CAPACITY = 16  # a cache's buffer never holds fewer positions (models/base.py: _grow)

# ---- the model's digest ---------------------------------------------------------------------------

HASH_CHUNK = 16 << 20  # bytes hashed per update: large, so hashlib runs without the GIL most of the time
DIGEST_CACHE_VERSION = 1
# A shard modified this recently may change again within the file system's timestamp granularity with
# the same size and mtime; its digests are computed but not cached.
RACY_NS = 2_000_000_000


def fingerprint(model: Any) -> str:
    """sha256 hex of what makes two loaded models compute the same thing: the config, the tensor table
    and every weight byte."""
    h = hashlib.sha256()
    store = model.store
    h.update(json.dumps(store.config, sort_keys=True).encode())
    for name in sorted(store.tensors):
        t = store.tensors[name]
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|{t.nbytes}\n".encode())
    manifest = getattr(store, "manifest", None)
    if isinstance(manifest, dict):  # a packed store: its manifest names every entry's CRC
        h.update(b"manifest\n" + json.dumps(manifest, sort_keys=True).encode())
    else:
        for name, digest in sorted(tensor_digests(store.tensors).items()):
            h.update(f"{name}={digest}\n".encode())
    return h.hexdigest()


def digest_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "moestream" / "digests"


def tensor_digests(tensors: dict[str, TensorInfo], threads: int | None = None) -> dict[str, str]:
    """sha256 hex of each tensor's bytes, by name; each shard's digests come from the cache when the
    shard is unchanged (same resolved path, size, mtime_ns and inode)."""
    by_shard: dict[Path, list[TensorInfo]] = {}
    for info in tensors.values():
        by_shard.setdefault(Path(info.path), []).append(info)
    n = threads if threads is not None else min(len(by_shard), os.cpu_count() or 1)
    out: dict[str, str] = {}
    for _, digests in ordered_map(lambda s: shard_digests(s, by_shard[s]), sorted(by_shard), n, lambda _: 0, 1):
        out.update(digests)
    return out


def _shard_key(path: Path) -> dict[str, Any]:
    real = os.path.realpath(path)
    st = os.stat(real)
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _cache_file(key: dict[str, Any]) -> Path:
    return digest_cache_dir() / (hashlib.sha256(key["path"].encode()).hexdigest()[:32] + ".json")


def shard_digests(path: Path, infos: list[TensorInfo]) -> dict[str, str]:
    """The digests of the tensors infos (all in the file at path), from the cache or computed."""
    try:
        key = _shard_key(path)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    wanted = {i.name: [i.offset, i.nbytes] for i in infos}
    cached = _read_cached(_cache_file(key), key, wanted)
    if cached is not None:
        return cached
    digests = _hash_tensors(path, infos)
    recent = time.time_ns() - key["mtime_ns"] < RACY_NS
    if not recent and _shard_key(path) == key:  # unchanged while it was hashed
        _write_cached(_cache_file(key), key, {n: [*wanted[n], d] for n, d in digests.items()})
    return digests


def _read_cached(cache: Path, key: dict[str, Any], wanted: dict[str, list[int]]) -> dict[str, str] | None:
    """The cached digests if the entry is for this very file and covers every wanted tensor where it
    lies; None (recompute) for anything else, a damaged cache file included."""
    try:
        entry = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or entry.get("version") != DIGEST_CACHE_VERSION or entry.get("key") != key:
        return None
    tensors = entry.get("tensors")
    if not isinstance(tensors, dict):
        return None
    out = {}
    for name, where in wanted.items():
        got = tensors.get(name)
        if not (isinstance(got, list) and len(got) == 3 and got[:2] == where and isinstance(got[2], str)):
            return None
        out[name] = got[2]
    return out


def _write_cached(cache: Path, key: dict[str, Any], tensors: dict[str, list[Any]]) -> None:
    """Best effort: a cache that cannot be written (read-only home) only costs the hashing next time."""
    entry = {"version": DIGEST_CACHE_VERSION, "key": key, "tensors": tensors}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(cache, "w") as f:
            json.dump(entry, f)
    except OSError:
        pass


def _hash_tensors(path: Path, infos: list[TensorInfo]) -> dict[str, str]:
    """sha256 of each tensor's bytes, read in file order through one reused buffer."""
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    out = {}
    try:
        with open(path, "rb", buffering=0) as f:
            for info in sorted(infos, key=lambda i: i.offset):
                out[info.name] = _hash_range(f, info, view)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    return out


def _hash_range(f: io.FileIO, info: TensorInfo, view: memoryview) -> str:
    h = hashlib.sha256()
    f.seek(info.offset)
    left = info.nbytes
    while left:
        n = f.readinto(view[: min(left, len(view))])
        if not n:
            raise InputError(f"{info.path}: truncated (tensor {info.name} runs past the end of the file)")
        h.update(view[:n])
        left -= n
    return h.hexdigest()


# ---- saving ---------------------------------------------------------------------------------------


def save_state(path: Path, model: Any, state: State, pending: list[int] | None = None) -> None:
    """pending: tokens chosen but not yet fed (the last generated token); a run that loads the state
    feeds them before its own prompt, so generation continues exactly where it stopped."""
    path = Path(path)
    if not path.parent.is_dir():
        raise InputError(f"--save-state: directory {path.parent} does not exist")
    arrays: dict[str, np.ndarray] = {}
    layers = []
    for i, cache in enumerate(state.caches):
        scalars: dict[str, int] = {}
        names = []
        for f in dataclasses.fields(cache):
            v = getattr(cache, f.name)
            if isinstance(v, np.ndarray):
                arrays[f"L{i}.{f.name}"] = v
                names.append(f.name)
            else:
                scalars[f.name] = int(v)
        layers.append({"class": type(cache).__name__, "scalars": scalars, "arrays": names})
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint(model),
        "model_type": model.spec.model_type,
        "ids": [int(i) for i in state.ids],
        "pending": [int(i) for i in pending or []],
        "layers": layers,
    }
    arrays[META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with atomic_write(path) as out:
        np.savez(out, **arrays)  # type: ignore[arg-type]


# ---- loading --------------------------------------------------------------------------------------

# what a damaged zip or .npy header raises from zipfile and numpy.lib.format
_DAMAGE = (
    OSError,
    EOFError,
    ValueError,
    zipfile.BadZipFile,
    zlib.error,
    struct.error,
    NotImplementedError,  # a compression method zipfile lacks
    RuntimeError,  # an encrypted member
)


@dataclasses.dataclass(frozen=True)
class _Header:
    """An array member: where its data starts in the member's stream, its dtype and shape."""

    member: zipfile.ZipInfo
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * self.dtype.itemsize


def load_state(path: Path, model: Any, max_tokens: int | None = None) -> tuple[State, list[int]]:
    """The saved state and its pending tokens, checked against this model (and, given max_tokens, holding
    at most that many tokens with the pending ones); any mismatch or damage is one InputError."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"state file {path} does not exist") from None
    except OSError as e:
        raise InputError(f"state file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"state file {path} is not a regular file")
    try:
        with zipfile.ZipFile(path) as zf:
            return _load(zf, path, st.st_size, model, max_tokens)
    except _DAMAGE as e:
        raise InputError(f"{path}: not a moestream state file ({type(e).__name__}: {e})") from None


def _load(
    zf: zipfile.ZipFile, path: Path, file_size: int, model: Any, max_tokens: int | None
) -> tuple[State, list[int]]:
    state = model.new_state()
    members = _members(zf, path, file_size, _expected_members(state))
    meta = _read_meta(zf, path, members[META])
    if meta.get("fingerprint") != fingerprint(model):
        raise InputError(
            f"{path}: the state was saved from another model ({str(meta.get('model_type'))[:40]}, fingerprint "
            f"{str(meta.get('fingerprint'))[:12]}), not {model.path}"
        )
    ids, pending = _check_meta(path, meta, state, model.vocab_size, max_tokens)
    headers = {}
    for name, member in members.items():
        if name != META:
            headers[name] = _array_header(zf, path, member)
    for i, cache in enumerate(state.caches):
        for field, template in _array_fields(cache):
            header = headers[f"L{i}.{field}"]
            _check_array(path, f"layer {i} field {field}", header, template, len(ids))
    for i, (cache, saved) in enumerate(zip(state.caches, meta["layers"], strict=True)):
        for field, _ in _array_fields(cache):
            setattr(cache, field, _read_array(zf, path, headers[f"L{i}.{field}"]))
        for field, value in saved["scalars"].items():
            setattr(cache, field, value)
    state.ids = ids
    return state, pending


def _array_fields(cache: Any) -> list[tuple[str, np.ndarray]]:
    return [(f.name, v) for f in dataclasses.fields(cache) if isinstance(v := getattr(cache, f.name), np.ndarray)]


def _scalar_fields(cache: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cache) if not isinstance(getattr(cache, f.name), np.ndarray)]


def _expected_members(state: State) -> set[str]:
    names = {META}
    for i, cache in enumerate(state.caches):
        names.update(f"L{i}.{field}" for field, _ in _array_fields(cache))
    return names


def _members(zf: zipfile.ZipFile, path: Path, file_size: int, expected: set[str]) -> dict[str, zipfile.ZipInfo]:
    """The zip's members by array name: exactly the expected ones, once each, stored (not compressed or
    encrypted) and lying inside the file."""
    out: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        name = info.filename.removesuffix(".npy")
        if name not in expected or not info.filename.endswith(".npy"):
            raise InputError(f"{path}: unexpected member {info.filename[:80]!r} (not a state for this model)")
        if name in out:
            raise InputError(f"{path}: member {info.filename} appears twice")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise InputError(f"{path}: member {info.filename} is compressed or encrypted (a state file is neither)")
        if info.compress_size != info.file_size or info.header_offset + info.file_size > file_size:
            raise InputError(f"{path}: member {info.filename} claims more bytes than the file holds")
        out[name] = info
    missing = sorted(expected - set(out))
    if missing:
        raise InputError(f"{path}: member {missing[0]}.npy is missing (not a state for this model)")
    return out


def _array_header(zf: zipfile.ZipFile, path: Path, member: zipfile.ZipInfo) -> _Header:
    """The .npy header of member, read without its data: a plain C-order array of a non-object dtype
    whose data fills the rest of the member exactly."""
    with zf.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise InputError(f"{path}: {member.filename} has .npy format version {version}")
        data_start = f.tell()
    plain = not (fortran or dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None)
    if not plain or any(d < 0 for d in shape):
        raise InputError(f"{path}: {member.filename} is not a plain C-order numeric array")
    header = _Header(member, dtype, tuple(shape))
    if data_start + header.nbytes != member.file_size:
        raise InputError(
            f"{path}: {member.filename} claims {list(shape)} {dtype} ({header.nbytes} bytes), "
            f"the member holds {member.file_size - data_start}"
        )
    return header


def _read_meta(zf: zipfile.ZipFile, path: Path, member: zipfile.ZipInfo) -> dict[str, Any]:
    header = _array_header(zf, path, member)
    if header.dtype != np.uint8 or len(header.shape) != 1 or header.nbytes > MAX_META_BYTES:
        raise InputError(f"{path}: meta is not JSON bytes of at most {MAX_META_BYTES} bytes")
    try:
        meta = json.loads(_read_array(zf, path, header).tobytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise InputError(f"{path}: meta is not JSON ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{path}: not a moestream state file")
    version = meta.get("version")
    if type(version) is not int or version != VERSION:
        raise InputError(f"{path}: state format version {str(version)[:20]} (this moestream reads {VERSION})")
    if set(meta) != META_KEYS:
        raise InputError(f"{path}: meta has keys {sorted(meta)[:10]}, expected {sorted(META_KEYS)}")
    return meta


def _is_int(v: Any) -> bool:
    return type(v) is int


def _token_ids(path: Path, what: str, value: Any, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < vocab for t in value):
        raise InputError(f"{path}: meta {what} is not a list of token ids in 0..{vocab - 1}")
    return value


def _check_meta(
    path: Path, meta: dict[str, Any], state: State, vocab: int, max_tokens: int | None
) -> tuple[list[int], list[int]]:
    """ids and pending, once every field of meta is what this model's state needs."""
    ids = _token_ids(path, "ids", meta["ids"], vocab)
    pending = _token_ids(path, "pending", meta["pending"], vocab)
    if max_tokens is not None and len(ids) + len(pending) > max_tokens:
        raise InputError(f"{path}: the state holds {len(ids) + len(pending)} tokens, over the context of {max_tokens}")
    layers = meta["layers"]
    if not isinstance(layers, list) or len(layers) != len(state.caches):
        n = len(layers) if isinstance(layers, list) else "no"
        raise InputError(f"{path}: {n} layers in the state, the model has {len(state.caches)}")
    for i, (cache, saved) in enumerate(zip(state.caches, layers, strict=True)):
        _check_layer(path, i, cache, saved, len(ids))
    return ids, pending


def _check_layer(path: Path, i: int, cache: Any, saved: Any, n_ids: int) -> None:
    need = type(cache).__name__
    if not isinstance(saved, dict) or set(saved) != LAYER_KEYS:
        raise InputError(f"{path}: layer {i} is not an object with keys {sorted(LAYER_KEYS)}")
    if saved["class"] != need:
        raise InputError(f"{path}: layer {i} holds a {str(saved['class'])[:40]}, the model needs {need}")
    if saved["arrays"] != [field for field, _ in _array_fields(cache)]:
        raise InputError(f"{path}: layer {i} lists other arrays than a {need} has")
    scalars = saved["scalars"]
    names = _scalar_fields(cache)
    if not isinstance(scalars, dict) or sorted(scalars) != sorted(names):
        raise InputError(f"{path}: layer {i} has other fields than a {need} ({', '.join(names)})")
    if not all(_is_int(v) and v >= 0 for v in scalars.values()):
        raise InputError(f"{path}: layer {i} has a field that is not a count")
    if "length" in scalars and scalars["length"] != n_ids:
        raise InputError(f"{path}: layer {i} holds {scalars['length']} positions, the state has {n_ids} tokens")


def _check_array(path: Path, what: str, header: _Header, template: np.ndarray, n_ids: int) -> None:
    """header against the array a fresh cache holds: the same dtype and shape, except that the position
    axis (the first one a fresh cache has empty) holds the state's positions and room for at most as many
    again (a cache grows by doubling, from MIN_CAPACITY)."""
    axis = next((a for a, d in enumerate(template.shape) if d == 0), None)
    room = max(MIN_CAPACITY, 2 * n_ids)

    def fits(a: int, got: int, fresh: int) -> bool:
        return n_ids <= got <= room if a == axis else got == fresh

    same_rank = len(header.shape) == template.ndim
    ok = same_rank and all(fits(a, g, t) for a, (g, t) in enumerate(zip(header.shape, template.shape, strict=True)))
    if header.dtype != template.dtype or not ok:
        positions = "" if axis is None else f" with {n_ids} to {room} positions on axis {axis}"
        raise InputError(
            f"{path}: {what} is {list(header.shape)} {header.dtype}; the model needs {template.dtype} "
            f"{list(template.shape)}{positions}"
        )


def _read_array(zf: zipfile.ZipFile, path: Path, header: _Header) -> np.ndarray:
    """The member's data into a new array of the (checked) header's dtype and shape, read in chunks."""
    arr = np.empty(header.shape, header.dtype)
    flat = arr.reshape(-1).view(np.uint8)
    with zf.open(header.member) as f:
        f.seek(header.member.file_size - header.nbytes)
        done = 0
        while done < header.nbytes:
            chunk = f.read(min(HASH_CHUNK, header.nbytes - done))
            if not chunk:
                raise InputError(f"{path}: {header.member.filename} is truncated")
            flat[done : done + len(chunk)] = np.frombuffer(chunk, np.uint8)
            done += len(chunk)
        if f.read(1):  # reaching the end also checks the member's CRC
            raise InputError(f"{path}: {header.member.filename} holds more than its array")
    return arr
