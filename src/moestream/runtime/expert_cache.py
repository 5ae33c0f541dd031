"""The expert cache: a fixed arena of equal slots (sized by the plan), each holding one (layer, expert)
exactly as its bytes lie on disk: the packed store's blob, or the ranges of a checkpoint's shards or a
GGUF file that hold the expert's matrices, read by the BlobReader. Experts computed from a slot are
Weights over the slot's bytes: the same bytes and the same kernels as a resident run, so the cache
changes how fast a token comes, never which token."""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..models.base import Ctx, Expert
from ..quant import Weight
from .policies import Policy
from .reader import ALIGN, BlobReader, aligned_empty

Key = tuple[int, int]  # (MoE layer index, expert id)
MATRICES = ("gate", "up", "down")


@dataclass
class Part:
    """Where one buffer of a template Weight lies inside its expert's slot."""

    attr: str  # "data" or "scales"
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass
class Range:
    """One read that fills part of a slot: nbytes at offset of file number `file`, into the slot at
    slot_offset (offset and slot_offset are 4096-aligned, as O_DIRECT needs)."""

    file: int
    offset: int
    nbytes: int
    slot_offset: int = 0
    crc: int | None = None  # CRC-32C of the nbytes, checked on every read (packed stores)


@dataclass
class Template:
    """One expert as the builder made it over the memory maps (never touched), and where its bytes are."""

    expert: Expert
    ranges: list[Range]
    nbytes: int  # of the slot the ranges fill
    parts: dict[str, list[Part]]  # "gate" / "up" / "down" -> buffers inside the slot


class FileMaps:
    """The memory maps a model's weights are views of: which file, and where in it, a buffer lies."""

    def __init__(self, files: list[tuple[Path, np.ndarray]]):
        self.paths = [p for p, _ in files]
        self.maps = [m for _, m in files]
        order = sorted(range(len(files)), key=lambda i: int(files[i][1].ctypes.data))
        self._bases = [int(files[i][1].ctypes.data) for i in order]
        self._order = order

    def locate(self, buf: np.ndarray) -> tuple[int, int] | None:
        """(file number, byte offset) of buf's first byte when all of buf lies in one map, else None."""
        addr = int(buf.ctypes.data)
        j = bisect.bisect_right(self._bases, addr) - 1
        if j < 0:
            return None
        i = self._order[j]
        off = addr - self._bases[j]
        return (i, off) if off + int(buf.nbytes) <= int(self.maps[i].size) else None


def _buffers(expert: Expert) -> Iterator[tuple[str, str, np.ndarray]]:
    for name in MATRICES:
        w: Weight = getattr(expert, name)
        for attr in ("data", "scales"):
            buf = getattr(w, attr)
            if buf is not None:
                yield name, attr, buf


def template_of(
    expert: Expert, blob_offset: int, blob_nbytes: int, map_addr: int, map_size: int, crc: int | None = None
) -> Template:
    """An expert of a packed store: its blob is one read, and its buffers lie inside it."""
    parts: dict[str, list[Part]] = {name: [] for name in MATRICES}
    for name, attr, buf in _buffers(expert):
        addr = buf.ctypes.data
        if not map_addr <= addr < map_addr + map_size:
            if attr == "data":
                raise ValueError("an expert matrix is not a view of the packed expert file")
            continue  # a converted copy (small scales): stays as it is
        off = addr - map_addr - blob_offset
        if not 0 <= off and off + buf.nbytes <= blob_nbytes:
            raise ValueError("an expert matrix lies outside its blob")
        parts[name].append(Part(attr, off, int(buf.nbytes), buf.dtype, tuple(buf.shape)))
    return Template(expert, [Range(0, blob_offset, blob_nbytes, 0, crc)], blob_nbytes, parts)


def mapped_template(expert: Expert, maps: FileMaps, where: str) -> Template:
    """An expert whose matrices are views of a checkpoint's or a GGUF's files: each run of its buffers
    that lie together in one file (their 4096-aligned spans touch) is one read, placed in the slot at the
    next aligned offset; each buffer sits in the slot at its distance from its read's aligned start."""
    located = []
    for name, attr, buf in _buffers(expert):
        at = maps.locate(buf)
        if at is None:
            if attr == "data":
                raise InputError(
                    f"{where}: an expert matrix is converted at load, so it cannot be read from the file "
                    "within a budget; make a packed store with `moestream pack`"
                )
            continue  # a converted copy (small scales): stays as it is
        located.append((at[0], at[1], name, attr, buf))
    located.sort(key=lambda b: (b[0], b[1]))
    runs: list[list[Any]] = []  # [file, aligned start, end, members]
    for f, off, name, attr, buf in located:
        start, end = off - off % ALIGN, off + int(buf.nbytes)
        if runs and runs[-1][0] == f and start <= -(-runs[-1][2] // ALIGN) * ALIGN:
            runs[-1][2] = max(runs[-1][2], end)
            runs[-1][3].append((off, name, attr, buf))
        else:
            runs.append([f, start, end, [(off, name, attr, buf)]])
    parts: dict[str, list[Part]] = {name: [] for name in MATRICES}
    ranges, at_slot = [], 0
    for f, start, end, members in runs:
        ranges.append(Range(f, start, end - start, at_slot))
        for off, name, attr, buf in members:
            parts[name].append(Part(attr, at_slot + off - start, int(buf.nbytes), buf.dtype, tuple(buf.shape)))
        at_slot += -(-(end - start) // ALIGN) * ALIGN
    return Template(expert, ranges, at_slot, parts)


def _rebased(w: Weight, parts: list[Part], slot: np.ndarray) -> Weight:
    out = Weight.__new__(Weight)
    for s in ("fmt", "rows", "cols", "data", "scales"):
        setattr(out, s, getattr(w, s))
    for p in parts:
        setattr(out, p.attr, slot[p.offset : p.offset + p.nbytes].view(p.dtype).reshape(p.shape))
    out._validate = out._check = w._check  # a fresh read is checked again (e.g. E8M0 scales) before first use
    return out


@dataclass
class CacheStats:
    requests: int = 0
    hits: int = 0  # resident (or already being read by a prefetch) when asked for
    misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0  # prefetched experts that the next layer asked for
    prefetch_checked: int = 0  # prefetched experts whose layer has run since
    wait_seconds: float = 0.0  # compute stalled on reads
    evictions: int = 0


@dataclass
class ExpertCache:
    reader: BlobReader
    templates: dict[Key, Template]
    n_slots: int
    slot_bytes: int
    policy: Policy
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.slot_bytes = -(-self.slot_bytes // ALIGN) * ALIGN
        self.arena = aligned_empty(self.n_slots * self.slot_bytes)
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.slot_of: dict[Key, int] = {}
        self.key_of: dict[int, Key] = {}
        self.built: dict[Key, Expert] = {}
        self.pending: dict[Key, list[Future[None]]] = {}
        self.pins: dict[Key, int] = {}
        self.prefetched: set[Key] = set()
        self.trace: list[tuple[int, list[int]]] | None = None

    # ---- slots ------------------------------------------------------------------------------------

    def _reap(self, wait: bool) -> None:
        """Reads nobody holds (prefetches not asked for yet, or never: a wrong guess) leave `pending` once
        done, so that their slots can be evicted; wait: waits for those still in flight. Without this a
        wrong prefetch would hold its slot until its expert was next asked for, and a small cache would
        run out of slots across generations."""
        for key in [k for k in self.pending if not self.pins.get(k)]:
            futs = self.pending[key]
            if not wait and not all(f.done() for f in futs):
                continue
            del self.pending[key]
            if any(f.exception() is not None for f in futs):  # (waits for a read in flight)
                self._forget(key)

    def _slot(self, key: Key, wait_ok: bool) -> int | None:
        if self.free:
            return self.free.pop()
        self._reap(wait=False)
        candidates = [k for k in self.slot_of if not self.pins.get(k) and k not in self.pending]
        if not candidates and wait_ok:
            self._reap(wait=True)
            if self.free:
                return self.free.pop()
            candidates = [k for k in self.slot_of if not self.pins.get(k) and k not in self.pending]
        if not candidates:
            return None
        victim: Key = self.policy.victim(candidates)  # type: ignore[assignment]
        slot = self.slot_of.pop(victim)
        del self.key_of[slot]
        self.built.pop(victim, None)
        self.prefetched.discard(victim)
        self.policy.remove(victim)
        self.stats.evictions += 1
        return slot

    def _forget(self, key: Key) -> None:
        """A key whose read failed: its slot goes back to the free list, so that a process that goes on after
        the error (the server) does not lose a slot to every failed read."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.key_of.pop(slot, None)
            self.free.append(slot)
        self.built.pop(key, None)
        self.prefetched.discard(key)
        self.policy.remove(key)

    def _read(self, key: Key, slot: int) -> None:
        t = self.templates[key]
        buf = self.arena[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.pending[key] = [
            self.reader.submit(r.offset, r.nbytes, buf[r.slot_offset :], r.crc, r.file) for r in t.ranges
        ]
        self.policy.insert(key)

    def _ready(self, key: Key) -> Expert:
        futs = self.pending.pop(key, None)
        if futs is not None:
            t0 = time.perf_counter()
            try:
                for fut in futs:
                    fut.result()
            except BaseException:
                for fut in futs:  # the slot goes back only once no read can still write into it
                    if not fut.cancel():
                        fut.exception()
                self._forget(key)
                raise
            self.stats.wait_seconds += time.perf_counter() - t0
        ex = self.built.get(key)
        if ex is None:
            t = self.templates[key]
            slot = self.arena[self.slot_of[key] * self.slot_bytes :][: self.slot_bytes]
            gate, up, down = (_rebased(getattr(t.expert, n), t.parts[n], slot) for n in ("gate", "up", "down"))
            ex = dataclasses.replace(t.expert, gate=gate, up=up, down=down)
            self.built[key] = ex
        return ex

    # ---- demand and prefetch ----------------------------------------------------------------------

    def request(self, layer: int, ids: list[int]) -> list[Expert]:
        """The experts `ids` of `layer`, resident and pinned until release(); all their reads are in
        flight together."""
        keys = [(layer, e) for e in ids]
        for key in keys:
            self.stats.requests += 1
            self.policy.access(key)
            if key in self.prefetched:
                self.stats.prefetch_used += 1
                self.prefetched.discard(key)
            if key in self.slot_of:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                slot = self._slot(key, wait_ok=True)
                if slot is None:
                    raise RuntimeError("expert cache: no free slot (the plan allows too few)")
                self._read(key, slot)
            self.pins[key] = self.pins.get(key, 0) + 1
        try:
            return [self._ready(k) for k in keys]
        except BaseException:  # the caller never gets the experts, so it cannot release them
            self.release(layer, ids)
            raise

    def release(self, layer: int, ids: list[int]) -> None:
        for e in ids:
            key = (layer, e)
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """Starts reading experts a later layer is expected to ask for (never evicts a pinned one)."""
        # earlier predictions for this layer that were never used count as misses of the predictor
        for key in [k for k in self.prefetched if k[0] == layer]:
            self.prefetched.discard(key)
        for e in ids:
            key = (layer, e)
            self.stats.prefetch_checked += 1
            if key in self.slot_of:
                continue
            slot = self._slot(key, wait_ok=False)
            if slot is None:
                return
            self._read(key, slot)
            self.prefetched.add(key)
            self.stats.prefetch_issued += 1

    def drain(self) -> None:
        for key in list(self.pending):
            failed = False
            for fut in self.pending.pop(key):
                try:
                    fut.result()
                except Exception:
                    failed = True
            if failed:
                self._forget(key)


class StreamedExperts:
    """The routed experts of one MoE layer, served by the cache; what mix_experts iterates over."""

    def __init__(self, cache: ExpertCache, layer: int, n: int, group: int):
        self.cache, self.layer, self.n, self.group = cache, layer, n, group
        self.next: Any = None  # (router, StreamedExperts) of the next MoE layer, for prefetch
        self._x: np.ndarray | None = None
        self._ctx: Ctx | None = None

    at_hand = False  # experts are served in groups by fetch, pinned while a group runs

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, e: int) -> Expert:
        raise TypeError("streamed experts are served by fetch(), not by index")

    def announce(self, x: np.ndarray, ctx: Ctx) -> None:
        """The current layer's router input: predicts the next layer's experts once demand reads are out."""
        self._x, self._ctx = x, ctx

    def fetch(self, ids: list[int]) -> Iterator[list[tuple[int, Expert]]]:
        if self.cache.trace is not None:
            self.cache.trace.append((self.layer, list(ids)))
        for i in range(0, len(ids), self.group):
            chunk = ids[i : i + self.group]
            experts = self.cache.request(self.layer, chunk)
            if i == 0:
                self._prefetch_next()
            try:
                yield list(zip(chunk, experts, strict=True))
            finally:
                self.cache.release(self.layer, chunk)

    def _prefetch_next(self) -> None:
        if self.next is None or self._x is None or self._ctx is None:
            return
        router, nxt = self.next
        idx, _ = router(self._x[-1:], self._ctx)  # the last token's prediction (decode: the only one)
        self.cache.prefetch(nxt.layer, [int(e) for e in idx[0]])
        self._x = None
