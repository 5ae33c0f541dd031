"""Run-time integrity of a packed store. Every entry and expert blob has a CRC-32C in the manifest, and is
checked before numbers computed from it can reach a token:

  resident (the whole store mapped): each trunk part the first time it runs (ResidentChecks, as trunk
      hooks) and each expert blob the first time it is used (CheckedExperts);
  streamed (--ram): each expert blob on every read, in the I/O thread that read it (BlobReader); each
      unpinned trunk part every time it is read, by a thread one part ahead of compute (TrunkVerifier);
      pinned parts and the embedding (of which a token reads only its rows) once.

A mismatch is an IntegrityError naming the file and the offset (exit 4), raised inside the forward pass
that needed the bytes, so no token of that pass is printed."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _C
from ..errors import IntegrityError
from ..formats.packed import PackedStore, _group_key, checks_enabled, mismatch
from ..models.base import Expert, ResidentExperts
from .reader import aligned_empty

Entry = dict[str, Any]  # a manifest range: file, offset, nbytes, crc32c
VERIFY_CHUNK = 4 << 20  # bytes a streamed part is read in to be checked (the buffer the check holds)


def group_name(tensor: str) -> str:
    kind, layer = _group_key(tensor)
    return "embed" if kind == 0 else f"layer.{layer}" if kind == 1 else "head"


def part_entries(store: PackedStore) -> dict[str, list[Entry]]:
    """Trunk part ("embed", "layer.N", "head") -> its ranges of trunk.bin (a matrix's scales a range of
    their own). With tied embeddings the embedding is the head's matrix too, so it is part of "head"."""
    m = store.manifest
    named = [*m["tensors"].items(), *m["matrices"].items()]
    tied = not any("lm_head" in n for n, _ in named)
    parts: dict[str, list[Entry]] = {}
    for name, e in named:
        if e["file"] != "trunk":
            continue
        g = group_name(name)
        if tied and g == "embed":
            g = "head"
        parts.setdefault(g, []).append(e)
        if e.get("scales"):
            parts[g].append({**e["scales"], "file": "trunk"})
    return parts


class ResidentChecks:
    """Trunk hooks of a resident model: a part's ranges are checked in the map the first time it runs."""

    def __init__(self, store: PackedStore):
        self.store = store
        self.unchecked = part_entries(store) if checks_enabled() else {}

    def enter(self, group: str) -> None:
        for e in self.unchecked.get(group, ()):
            self.store.check_entry(e)
        self.unchecked.pop(group, None)  # only once every range passed: a failed part is checked again

    def leave(self, group: str) -> None:
        pass


class CheckedExperts(ResidentExperts):
    """A resident layer's routed experts: an expert's blob is checked in the map the first time it is
    taken (mix_experts takes each chosen expert by index)."""

    def __init__(self, experts: list[Expert], layer: int, store: PackedStore):
        super().__init__(experts)
        self.layer, self.store = layer, store
        self.unchecked = set(range(len(experts))) if checks_enabled() else set()

    def __getitem__(self, e: Any) -> Any:
        if isinstance(e, int) and e in self.unchecked:
            blob = self.store.manifest["expert_blobs"].get(f"{self.layer}.{e}")
            if blob is None:  # a manifest without the blob must not switch its check off
                raise IntegrityError(f"{self.store.path}: the manifest has no blob for layer {self.layer} expert {e}")
            self.store.check_entry({**blob, "file": "experts"})
            self.unchecked.discard(e)  # only once it passed: a failed blob is checked again
        return super().__getitem__(e)


def install_resident_checks(decoder: Any, store: PackedStore) -> None:
    """Checks a resident model's parts and expert blobs on first use (streaming.attach replaces both)."""
    from .streaming import moe_layers

    if getattr(decoder, "hooks", False) is None:
        decoder.hooks = ResidentChecks(store)
    for i, moe in moe_layers(decoder):
        if type(moe.experts) is ResidentExperts:
            moe.experts = CheckedExperts(moe.experts, i, store)


class TrunkVerifier:
    """Checks streamed trunk parts through their own reads (pread into a small buffer, so the check adds
    nothing to the process's memory) on one thread, one part ahead of compute: start(part) when the part
    before it starts, finish(part) (raises on a mismatch) before it runs. Parts in `once` are checked the
    first time only."""

    def __init__(self, store: PackedStore, once: set[str]):
        self.path = store.path / store.manifest["files"]["trunk"]
        self.parts = part_entries(store) if checks_enabled() else {}
        self.once = once
        self.fd = os.open(self.path, os.O_RDONLY)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-verify")
        self.buf = aligned_empty(VERIFY_CHUNK)
        self.pending: dict[str, Future[None]] = {}

    def start(self, group: str) -> None:
        if group in self.parts and group not in self.pending:
            self.pending[group] = self.pool.submit(self._check, self.parts[group])

    def finish(self, group: str) -> None:
        if group not in self.parts:
            return
        self.start(group)
        fut = self.pending.pop(group)
        fut.result()
        if group in self.once:
            del self.parts[group]

    def _check(self, entries: list[Entry]) -> None:
        for e in entries:
            if self._crc(e) != e["crc32c"]:
                raise IntegrityError(mismatch(self.path, e))

    def _crc(self, e: Entry) -> int:
        crc, done, n = 0, 0, e["nbytes"]
        while done < n:
            want = min(VERIFY_CHUNK, n - done)
            try:
                got = _C.pread(self.fd, self.buf, e["offset"] + done, want)
            except OSError as err:
                raise IntegrityError(
                    f"{self.path}: read at offset {e['offset'] + done} failed: {err.strerror}"
                ) from None
            if got < want:
                raise IntegrityError(
                    f"{self.path}: short read at offset {e['offset'] + done}: {got} of {want} bytes (truncated?)"
                )
            crc = _C.crc32c(self.buf[:got], crc)
            done += got
        return crc

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)


def check_logits(logits: np.ndarray, position: int) -> None:
    """IntegrityError if any logit is NaN or Inf (non-finite weights or activations give every token id
    0, silently): one float64 sum over the vocabulary per step, which is NaN or Inf exactly when a logit
    is (a sum of float32 values cannot overflow float64)."""
    if not np.isfinite(np.sum(logits, dtype=np.float64)):
        raise IntegrityError(
            f"the logits at position {position} are not finite (NaN or Inf): the weights or the computation "
            "went wrong, no token is chosen from them"
        )
