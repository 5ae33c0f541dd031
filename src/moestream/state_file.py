"""Saved sequence state (--save-state / --load-state): every layer's cache (KV, MLA latent, KDA
recurrent state) and the token ids so far, so a long prompt is prefilled once and continued later.

The file is an uncompressed .npz (a zip of .npy arrays) holding `meta` (JSON as bytes: format name,
version, the model fingerprint, ids, each layer's cache class and integer fields) and one array per
cache field named `L{layer}.{field}`. It is written to a temporary name and renamed. A state is only
accepted by the model it came from: the fingerprint covers config.json, the tensor table (names, dtypes,
shapes, sizes) and the first bytes of a few tensors, so a requantized pack or another seed is refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write
from .errors import InputError
from .models.base import State

FORMAT = "moestream-state"
VERSION = 1
_SAMPLED_TENSORS = 4  # the first tensors by name whose leading bytes enter the fingerprint
_SAMPLE_BYTES = 256


def fingerprint(model: Any) -> str:
    """sha256 hex of what makes two loaded models compute the same thing."""
    h = hashlib.sha256()
    h.update(json.dumps(model.store.config, sort_keys=True).encode())
    tensors = model.store.tensors
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|{t.nbytes}\n".encode())
    sampled = sorted(tensors)[:_SAMPLED_TENSORS] + sorted(n for n in tensors if "embed" in n)[:1]
    for name in sampled:
        t = tensors[name]
        with open(t.path, "rb") as f:
            f.seek(t.offset)
            h.update(f.read(min(_SAMPLE_BYTES, t.nbytes)))
    return h.hexdigest()


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
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with atomic_write(path) as out:
        np.savez(out, **arrays)  # type: ignore[arg-type]


def load_state(path: Path, model: Any) -> tuple[State, list[int]]:
    """The saved state and its pending tokens, checked against this model; any mismatch or damage is one
    InputError."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"state file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a moestream state file ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{path}: not a moestream state file")
    if meta.get("version") != VERSION:
        raise InputError(f"{path}: state format version {meta.get('version')} (this moestream reads {VERSION})")
    if meta.get("fingerprint") != fingerprint(model):
        raise InputError(
            f"{path}: the state was saved from another model ({meta.get('model_type')}, fingerprint "
            f"{str(meta.get('fingerprint'))[:12]}), not {model.path}"
        )
    state = model.new_state()
    layers = meta.get("layers", [])
    if len(layers) != len(state.caches):
        raise InputError(f"{path}: {len(layers)} layers in the state, the model has {len(state.caches)}")
    for i, (cache, saved) in enumerate(zip(state.caches, layers, strict=True)):
        if saved.get("class") != type(cache).__name__:
            raise InputError(f"{path}: layer {i} holds a {saved.get('class')}, the model needs {type(cache).__name__}")
        for f in dataclasses.fields(cache):
            cur = getattr(cache, f.name)
            if isinstance(cur, np.ndarray):
                arr = arrays.get(f"L{i}.{f.name}")
                if arr is None or arr.dtype != cur.dtype or arr.ndim != cur.ndim:
                    raise InputError(f"{path}: layer {i} field {f.name} is missing or has the wrong type")
                setattr(cache, f.name, np.array(arr))
            else:
                setattr(cache, f.name, int(saved["scalars"][f.name]))
    state.ids = [int(t) for t in meta["ids"]]
    pending = [int(t) for t in meta.get("pending", [])]
    model.check_ids(state.ids + pending or [0])
    return state, pending
