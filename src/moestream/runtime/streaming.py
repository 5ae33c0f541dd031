"""Running a packed store within a RAM budget: the plan is made from the store's manifest, the routed
experts of every MoE layer are served by one ExpertCache (O_DIRECT reads, prefetch of the next layer's
predicted experts), and the trunk is pinned part by part as the plan allows, the rest read one part ahead
and dropped from memory after it has run. Nothing here changes a number the model computes."""

from __future__ import annotations

import contextlib
import itertools
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from ..formats.packed import PackedStore, _group_key
from ..models.base import Expert
from .expert_cache import ExpertCache, StreamedExperts, Template, template_of
from .integrity import TrunkVerifier, part_entries
from .planner import RUNTIME_GROWTH, SCRATCH_BASE, Plan, cache_bytes, make_plan, rss_now
from .policies import DEFAULT_POLICY, make_policy
from .reader import ALIGN, BlobReader

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def trunk_groups(store: PackedStore) -> dict[str, tuple[int, int]]:
    """Trunk part -> page-aligned byte range [start, end) of trunk.bin (the parts of part_entries)."""
    out = {}
    for g, entries in part_entries(store).items():
        a = min(e["offset"] for e in entries)
        b = max(e["offset"] + e["nbytes"] for e in entries)
        out[g] = (a - a % ALIGN, -(-b // ALIGN) * ALIGN)
    return out


def moe_layers(decoder: Any) -> list[tuple[int, Any]]:
    """(layer index, the layer's MoE object) for every layer with routed experts."""
    layers = getattr(decoder, "blocks", None) or getattr(decoder, "layers", [])
    return [(i, layer.ffn) for i, layer in enumerate(layers) if hasattr(layer.ffn, "experts")]


def _span(arr: Any, base: int) -> tuple[int, int]:
    """[start, end) of an array's bytes as offsets into the map at address base."""
    start = int(arr.ctypes.data) - base
    return start, start + int(arr.nbytes)


class ChunkedHead:
    """The lm_head streamed in row chunks: while chunk k is multiplied, chunk k+1 is read ahead
    (WILLNEED), and chunk k is dropped (DONTNEED) after. Each logit is computed exactly as by the whole
    matrix (the kernels compute every output row the same way whatever rows share the call)."""

    def __init__(self, weight: Any, rows_per_chunk: int, mm: Any, base: int):
        self.weight, self.mm = weight, mm
        self.rows, self.cols = weight.rows, weight.cols
        self.chunks = [(r, min(r + rows_per_chunk, weight.rows)) for r in range(0, weight.rows, rows_per_chunk)]
        self.slices = [weight.row_slice(r0, r1) for r0, r1 in self.chunks]
        # each chunk's page-aligned byte ranges in the map (its rows, and their scales when separate)
        self.spans: list[list[tuple[int, int]]] = []
        for w in self.slices:
            ranges = [_span(a, base) for a in (w.data, w.scales) if a is not None]
            size = len(mm) if mm is not None else 0
            self.spans.append([(a - a % ALIGN, min(-(-b // ALIGN) * ALIGN, size)) for a, b in ranges])

    def advise(self, k: int, opt: int) -> None:
        if self.mm is None:
            return
        for a, b in self.spans[k]:
            if b > a:
                with contextlib.suppress(OSError, ValueError):
                    self.mm.madvise(opt, a, b - a)

    def matmul(self, x: Any, threads: int = 1) -> Any:
        """x [T, cols] -> logits [T, rows], chunk by chunk."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x[None]
        out = np.empty((x.shape[0], self.rows), np.float32)
        for k, ((r0, r1), w) in enumerate(zip(self.chunks, self.slices, strict=True)):
            if k + 1 < len(self.chunks):
                self.advise(k + 1, mmap.MADV_WILLNEED)
            out[:, r0:r1] = w.matmul(x, threads)
            self.advise(k, mmap.MADV_DONTNEED)
        return out


def head_chunk_rows(weight: Any, chunk_bytes: int) -> int:
    per_row = max(1, weight.nbytes // max(1, weight.rows))
    align = weight.row_align
    return max(align, chunk_bytes // per_row // align * align)


def chunkable_head(decoder: Any, store: PackedStore) -> Any:
    """The decoder's lm_head Weight if it lies in the trunk map (so it can stream in chunks), else None."""
    w = getattr(decoder, "lm_head", None)
    trunk = store.maps.get("trunk")
    if w is None or trunk is None or not hasattr(w, "row_slice"):
        return None
    base, size = int(trunk.ctypes.data), int(trunk.size)
    for arr in (w.data, w.scales):
        if arr is not None and not 0 <= int(arr.ctypes.data) - base <= size - int(arr.nbytes):
            return None
    return w


class TrunkStreamer:
    """TrunkHooks: pinned parts are read once at start; an unpinned part is read ahead (WILLNEED) when
    the part before it starts and dropped from this process's memory (DONTNEED) once it has run. Each part
    is checked against its CRCs before it runs (TrunkVerifier: unpinned parts on every pass, one part
    ahead; pinned ones and the embedding once)."""

    def __init__(
        self,
        store: PackedStore,
        groups: dict[str, tuple[int, int]],
        pinned: list[str],
        chunked: dict[str, ChunkedHead] | None = None,
    ):
        self.mm = getattr(store.maps["trunk"], "_mmap", None)
        self.groups, self.pinned = groups, set(pinned)
        self.chunked = chunked or {}
        self.order = sorted(groups, key=lambda g: _group_key(g.replace("layer.", "layers.") + "."))
        self.next = {g: self.order[i + 1] for i, g in enumerate(self.order[:-1])}
        self.next[self.order[-1]] = self.order[0]
        self.verifier = TrunkVerifier(store, once=self.pinned | {"embed"})
        for g in self.pinned:
            self._advise(g, MADV_POPULATE_READ, mmap.MADV_WILLNEED)

    def _advise(self, g: str, opt: int, fallback: int | None = None) -> None:
        if self.mm is None or g not in self.groups:
            return
        a, b = self.groups[g]
        b = min(b, len(self.mm))
        if b <= a:
            return
        try:
            self.mm.madvise(opt, a, b - a)
        except (OSError, ValueError):
            if fallback is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.mm.madvise(fallback, a, b - a)

    def enter(self, group: str) -> None:
        self.verifier.finish(group)
        nxt = self.next.get(group)
        if nxt is not None:
            self.verifier.start(nxt)
        if nxt is not None and nxt not in self.pinned:
            if nxt in self.chunked:  # a part read in chunks: only its first chunk ahead
                self.chunked[nxt].advise(0, mmap.MADV_WILLNEED)
            else:
                self._advise(nxt, mmap.MADV_WILLNEED)

    def leave(self, group: str) -> None:
        if group not in self.pinned:
            self._advise(group, mmap.MADV_DONTNEED)


@dataclass
class Streaming:
    plan: Plan
    cache: ExpertCache
    reader: BlobReader
    trunk: TrunkStreamer
    prefill_bytes_read: int = 0

    def mark_prefill_done(self) -> None:
        self.prefill_bytes_read = self.reader.bytes_read

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats
        return {
            "prefill_bytes_read": self.prefill_bytes_read,
            "expert_requests": s.requests,
            "expert_hits": s.hits,
            "hit_rate": s.hits / s.requests if s.requests else 0.0,
            "expert_reads": self.reader.reads,
            "bytes_read": self.reader.bytes_read,
            "read_seconds": self.reader.seconds,
            "wait_seconds": s.wait_seconds,
            # reads overlap each other and compute: the time spent reading that compute did not wait for
            "read_seconds_hidden": max(0.0, self.reader.seconds - s.wait_seconds),
            "prefetch_issued": s.prefetch_issued,
            "prefetch_used": s.prefetch_used,
            "prefetch_accuracy": s.prefetch_used / s.prefetch_issued if s.prefetch_issued else 0.0,
            "o_direct": self.reader.direct,
        }

    def close(self) -> None:
        self.cache.drain()
        self.reader.close()
        self.trunk.verifier.close()


@dataclass
class Layout:
    """What planning needs to know of a model in a packed store: a template per (layer, expert), the
    slot size, the trunk parts and the top-k."""

    layers: list[tuple[int, Any]]
    templates: dict[tuple[int, int], Template]
    slot_bytes: int
    groups: dict[str, tuple[int, int]]
    top_k: int
    head: Any = None  # the lm_head Weight when it can stream in row chunks
    head_chunk_rows: int = 0
    head_chunk_bytes: int = 0  # what one chunk needs in flight (planned as the head's streaming room)


def layout(model: Any, store: PackedStore) -> Layout:
    decoder = model.decoder
    layers = moe_layers(decoder)
    blobs = store.manifest.get("expert_blobs", {})
    if not layers or not blobs:
        raise InputError(f"{store.path}: --ram needs a model with routed experts in a packed store")
    exp_map = store.maps["experts"]
    map_addr, map_size = exp_map.ctypes.data, int(exp_map.size)
    templates: dict[tuple[int, int], Template] = {}
    top_k = 1
    for i, moe in layers:
        top_k = max(top_k, int(getattr(moe.router, "top_k", 1)))
        for e, ex in enumerate(moe.experts):
            b = blobs.get(f"{i}.{e}")
            if b is None:
                raise InputError(f"{store.path}: the manifest has no blob for layer {i} expert {e}")
            templates[(i, e)] = template_of(ex, b["offset"], b["nbytes"], map_addr, map_size, b["crc32c"])
    slot_bytes = max(t.nbytes for t in templates.values())
    slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
    groups = trunk_groups(store)
    head = chunkable_head(decoder, store) if "head" in groups else None
    if head is None:
        return Layout(layers, templates, slot_bytes, groups, top_k)
    # a chunk as large as the largest layer part: the head then never sets the streaming room
    layer_max = max((b - a for g, (a, b) in groups.items() if g.startswith("layer.")), default=0)
    rows = head_chunk_rows(head, max(layer_max, ALIGN))
    chunk = -(-rows * max(1, head.nbytes // max(1, head.rows)) // ALIGN) * ALIGN + 2 * ALIGN
    return Layout(layers, templates, slot_bytes, groups, top_k, head, rows, chunk)


def derived_bytes(decoder: Any) -> int:
    """What MLA layers build at run time for absorbed decode: W_uk^T and W_uv as f32 for each layer that
    cannot multiply by kv_b_proj's bytes directly (MLAttention.direct), plus the f32 dequantized kv_b_proj
    alive while one is being made."""
    layers = getattr(decoder, "blocks", None) or getattr(decoder, "layers", [])
    sizes = [
        int(a.heads * (a.nope + a.v_dim) * a.rank * 4)
        for a in (getattr(layer, "attn", None) for layer in layers)
        if a is not None and hasattr(a, "absorbed") and hasattr(a, "kv_b_proj") and not a.direct
    ]
    return sum(sizes) + max(sizes, default=0)


def plan_budget(model: Any, lay: Layout, budget: int, context: int, prompt_tokens: int) -> Plan:
    """The plan of `budget` for a context of `context` tokens (the longest prompt chunk: prompt_tokens);
    InputError when it cannot fit."""
    decoder = model.decoder
    sizes = {g: b - a for g, (a, b) in lay.groups.items()}
    state = model.new_state()
    kv = sum(cache_bytes(c, context) for c in state.caches)
    E = int(decoder.embed.cols)
    V = int(model.vocab_size)
    inter = max((t.expert.gate.rows for t in lay.templates.values()), default=E)
    from ..generate import PREFILL_CHUNK

    T = max(1, min(prompt_tokens, PREFILL_CHUNK))  # the largest batch a forward pass sees
    heads = int(getattr(model.spec, "num_attention_heads", 0) or 32)
    S = max(T, context)
    scratch = SCRATCH_BASE + T * (64 * E + 8 * inter + 2 * V) * 4 + 2 * heads * T * S * 4  # + scores [H, T, S]
    chunks = {"head": lay.head_chunk_bytes} if lay.head_chunk_bytes else None
    derived = derived_bytes(decoder)
    plan = make_plan(
        budget, sizes, lay.slot_bytes, len(lay.templates), lay.top_k, kv, scratch, context, chunks, derived
    )
    plan.overhead = rss_now() + RUNTIME_GROWTH
    return plan


def attach(
    model: Any,
    store: PackedStore,
    budget: int,
    context: int,
    prompt_tokens: int,
    policy: str = DEFAULT_POLICY,
    prefetch: bool = True,
) -> Streaming:
    """Plans the budget for a context of `context` tokens (the longest prompt chunk: prompt_tokens) and
    switches the model's experts and trunk to streaming. Refuses (InputError) a budget that cannot fit."""
    lay = layout(model, store)
    plan = plan_budget(model, lay, budget, context, prompt_tokens)
    reader = BlobReader(store.path / store.manifest["files"]["experts"])
    if not reader.direct:
        plan.notes.append("O_DIRECT refused by the file system: buffered reads (the page cache is used)")
    cache = ExpertCache(reader, lay.templates, plan.expert_slots, lay.slot_bytes, make_policy(policy))
    group = max(lay.top_k, plan.expert_slots - 1)
    streamed = []
    for i, moe in lay.layers:
        se = StreamedExperts(cache, i, len(moe.experts), group)
        moe.experts = se
        streamed.append((moe, se))
    if prefetch:
        for (_, se), (nxt_moe, nxt_se) in itertools.pairwise(streamed):
            se.next = (nxt_moe.router, nxt_se)
    chunked: dict[str, ChunkedHead] = {}
    if lay.head is not None and "head" not in plan.pinned:
        trunk_map = store.maps["trunk"]
        mm = getattr(trunk_map, "_mmap", None)
        chunked["head"] = ChunkedHead(lay.head, lay.head_chunk_rows, mm, int(trunk_map.ctypes.data))
        model.decoder.lm_head = chunked["head"]
        plan.notes.append(f"lm_head streamed in {len(chunked['head'].chunks)} chunks of {lay.head_chunk_rows} rows")
    trunk = TrunkStreamer(store, lay.groups, plan.pinned, chunked)
    model.decoder.hooks = trunk
    return Streaming(plan, cache, reader, trunk)


class TracingExperts(list[Expert]):
    """A resident expert list that records which experts each MoE call asks for (run --trace)."""

    def __init__(self, experts: list[Expert], layer: int, trace: list[tuple[int, list[int]]]):
        super().__init__(experts)
        self.layer, self.trace = layer, trace
        self.source = experts  # taken from, so that a CheckedExperts still checks each blob on first use

    def fetch(self, ids: list[int]) -> list[list[tuple[int, Expert]]]:
        self.trace.append((self.layer, list(ids)))
        return [[(e, self.source[e]) for e in ids]]


def record_trace(model: Any, streaming: Streaming | None) -> list[tuple[int, list[int]]]:
    """Starts recording the experts every MoE call asks for; returns the (growing) list."""
    trace: list[tuple[int, list[int]]] = []
    if streaming is not None:
        streaming.cache.trace = trace
        return trace
    for i, moe in moe_layers(model.decoder):
        moe.experts = TracingExperts(moe.experts, i, trace)
    return trace
