"""Running a model within a RAM budget, from a packed store or straight from the files it came in (a
checkpoint's safetensors shards, a GGUF): the plan is made from where the model's bytes lie, the routed
experts of every MoE layer are served by one ExpertCache (O_DIRECT reads of their own byte ranges,
prefetch of the next layer's predicted experts), and the trunk is pinned part by part as the plan allows,
the rest read one part ahead and dropped from memory after it has run. Nothing here changes a number the
model computes."""

from __future__ import annotations

import contextlib
import itertools
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..formats.packed import PackedStore, _group_key
from ..models.base import Expert, ResidentExperts
from .expert_cache import ExpertCache, FileMaps, StreamedExperts, Template, mapped_template, template_of
from .integrity import TrunkVerifier, part_entries
from .planner import RUNTIME_GROWTH, SCRATCH_BASE, Plan, cache_bytes, make_plan, rss_now
from .policies import DEFAULT_POLICY, make_policy
from .reader import ALIGN, BlobReader

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

Span = tuple[int, int, int]  # (file number, start, end): a page-aligned byte range of one of the trunk's files


def _aligned(start: int, end: int) -> tuple[int, int]:
    return start - start % ALIGN, -(-end // ALIGN) * ALIGN


def merged(spans: list[Span]) -> list[Span]:
    """The spans sorted, with those that overlap or touch joined."""
    out: list[Span] = []
    for f, a, b in sorted(spans):
        if out and out[-1][0] == f and a <= out[-1][2]:
            out[-1] = (f, out[-1][1], max(out[-1][2], b))
        else:
            out.append((f, a, b))
    return out


def without(spans: list[Span], holes: list[Span]) -> list[Span]:
    """What of spans lies outside every hole (both merged)."""
    out: list[Span] = []
    for f, a, b in spans:
        for hf, ha, hb in holes:
            if hf != f or hb <= a or ha >= b:
                continue
            if ha > a:
                out.append((f, a, ha))
            a = max(a, hb)
            if a >= b:
                break
        if a < b:
            out.append((f, a, b))
    return out


def trunk_groups(store: PackedStore) -> dict[str, list[Span]]:
    """Trunk part -> the page-aligned byte range of trunk.bin it lies in (the parts of part_entries)."""
    out = {}
    for g, entries in part_entries(store).items():
        a = min(e["offset"] for e in entries)
        b = max(e["offset"] + e["nbytes"] for e in entries)
        out[g] = [(0, *_aligned(a, b))]
    return out


def decoder_layers(decoder: Any) -> list[Any]:
    return list(getattr(decoder, "blocks", None) or getattr(decoder, "layers", []))


def moe_layers(decoder: Any) -> list[tuple[int, Any]]:
    """(layer index, the layer's MoE object) for every layer with routed experts."""
    return [(i, layer.ffn) for i, layer in enumerate(decoder_layers(decoder)) if hasattr(layer.ffn, "experts")]


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


def chunkable_head(decoder: Any, maps: FileMaps) -> tuple[Any, int] | None:
    """(the decoder's lm_head Weight, its file number) if it lies in one of the maps (so it can stream in
    row chunks), else None."""
    w = getattr(decoder, "lm_head", None)
    if w is None or not hasattr(w, "row_slice"):
        return None
    files = set()
    for arr in (w.data, w.scales):
        at = maps.locate(arr) if arr is not None else None
        if arr is not None and at is None:
            return None
        if at is not None:
            files.add(at[0])
    return (w, files.pop()) if len(files) == 1 else None


class TrunkStreamer:
    """TrunkHooks: pinned parts are read once at start; an unpinned part is read ahead (WILLNEED) when
    the part before it starts and dropped from this process's memory (DONTNEED) once it has run (except
    pages a pinned part shares). In a packed store each part is checked against its CRCs before it runs
    (TrunkVerifier: unpinned parts on every pass, one part ahead; pinned ones and the embedding once)."""

    def __init__(
        self,
        maps: list[Any],
        groups: dict[str, list[Span]],
        pinned: list[str],
        chunked: dict[str, ChunkedHead] | None = None,
        verifier: TrunkVerifier | None = None,
    ):
        self.mms = [getattr(m, "_mmap", None) for m in maps]
        self.groups, self.pinned = groups, set(pinned)
        kept = merged([sp for g in self.pinned for sp in groups.get(g, [])])
        self.droppable = {g: without(merged(spans), kept) for g, spans in groups.items() if g not in self.pinned}
        self.chunked = chunked or {}
        self.order = sorted(groups, key=lambda g: _group_key(g.replace("layer.", "layers.") + "."))
        self.next = {g: self.order[i + 1] for i, g in enumerate(self.order[:-1])}
        self.next[self.order[-1]] = self.order[0]
        self.verifier = verifier
        for g in self.pinned:
            self._advise(groups.get(g, []), MADV_POPULATE_READ, mmap.MADV_WILLNEED)

    def _advise(self, spans: list[Span], opt: int, fallback: int | None = None) -> None:
        for f, a, b in spans:
            mm = self.mms[f]
            if mm is None:
                continue
            b = min(b, len(mm))
            if b <= a:
                continue
            try:
                mm.madvise(opt, a, b - a)
            except (OSError, ValueError):
                if fallback is not None:
                    with contextlib.suppress(OSError, ValueError):
                        mm.madvise(fallback, a, b - a)

    def enter(self, group: str) -> None:
        if self.verifier is not None:
            self.verifier.finish(group)
        nxt = self.next.get(group)
        if nxt is not None and self.verifier is not None:
            self.verifier.start(nxt)
        if nxt is not None and nxt not in self.pinned:
            if nxt in self.chunked:  # a part read in chunks: only its first chunk ahead
                self.chunked[nxt].advise(0, mmap.MADV_WILLNEED)
            else:
                self._advise(self.groups[nxt], mmap.MADV_WILLNEED)

    def leave(self, group: str) -> None:
        if group not in self.pinned:
            self._advise(self.droppable.get(group, []), mmap.MADV_DONTNEED)

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()


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
        self.trunk.close()


@dataclass
class Layout:
    """What planning and streaming need to know of a model's files: a template per (layer, expert) and
    the files they are read from, the slot size, the trunk parts and the maps they lie in, the top-k."""

    layers: list[tuple[int, Any]]
    templates: dict[tuple[int, int], Template]
    slot_bytes: int
    expert_files: list[Path]  # Range.file numbers index this
    groups: dict[str, list[Span]]  # trunk part -> its spans; Span file numbers index trunk_maps
    trunk_maps: list[Any]
    top_k: int
    verifier: Any = None  # () -> TrunkVerifier, given the pinned parts (packed stores)
    head: Any = None  # the lm_head Weight when it can stream in row chunks
    head_file: int = 0
    head_chunk_rows: int = 0
    head_chunk_bytes: int = 0  # what one chunk needs in flight (planned as the head's streaming room)
    notes: list[str] = field(default_factory=list)


def _top_k(layers: list[tuple[int, Any]]) -> int:
    return max([1, *(int(getattr(moe.router, "top_k", 1)) for _, moe in layers)])


def _with_head(lay: Layout, decoder: Any, maps: FileMaps) -> Layout:
    found = chunkable_head(decoder, maps) if "head" in lay.groups else None
    if found is None:
        return lay
    head, f = found
    # a chunk as large as the largest layer part: the head then never sets the streaming room
    layer_max = max((sum(b - a for _, a, b in sp) for g, sp in lay.groups.items() if g.startswith("layer.")), default=0)
    rows = head_chunk_rows(head, max(layer_max, ALIGN))
    chunk = -(-rows * max(1, head.nbytes // max(1, head.rows)) // ALIGN) * ALIGN + 2 * ALIGN
    lay.head, lay.head_file, lay.head_chunk_rows, lay.head_chunk_bytes = head, f, rows, chunk
    return lay


def packed_layout(model: Any, store: PackedStore) -> Layout:
    """A packed store: each expert one blob of experts.bin (checked by its CRC on every read), each trunk
    part one range of trunk.bin."""
    layers = moe_layers(model.decoder)
    blobs = store.manifest.get("expert_blobs", {})
    if not layers or not blobs:
        raise InputError(f"{store.path}: --ram needs a model with routed experts")
    exp_map = store.maps["experts"]
    map_addr, map_size = exp_map.ctypes.data, int(exp_map.size)
    templates: dict[tuple[int, int], Template] = {}
    for i, moe in layers:
        for e, ex in enumerate(moe.experts):
            b = blobs.get(f"{i}.{e}")
            if b is None:
                raise InputError(f"{store.path}: the manifest has no blob for layer {i} expert {e}")
            templates[(i, e)] = template_of(ex, b["offset"], b["nbytes"], map_addr, map_size, b["crc32c"])
    slot_bytes = -(-max(t.nbytes for t in templates.values()) // ALIGN) * ALIGN
    trunk = store.maps["trunk"]
    lay = Layout(
        layers,
        templates,
        slot_bytes,
        [store.path / store.manifest["files"]["experts"]],
        trunk_groups(store),
        [trunk],
        _top_k(layers),
        verifier=lambda pinned: TrunkVerifier(store, once=set(pinned) | {"embed"}),
    )
    return _with_head(lay, model.decoder, FileMaps([(store.path / store.manifest["files"]["trunk"], trunk)]))


def _reachable_arrays(obj: Any, seen: set[int], out: list[np.ndarray]) -> None:
    """Every numpy array reachable from obj through moestream's own objects, lists, tuples and dicts; a
    layer's routed experts are not followed (they are served by the expert cache)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (ResidentExperts, StreamedExperts)):
        return
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _reachable_arrays(v, seen, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _reachable_arrays(v, seen, out)
    elif type(obj).__module__.startswith("moestream."):
        fields = dict(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name):
                    fields[name] = getattr(obj, name)
        for v in fields.values():
            if not callable(v) or isinstance(v, np.ndarray) or hasattr(v, "__dict__") or hasattr(v, "__slots__"):
                _reachable_arrays(v, seen, out)


def trunk_spans(decoder: Any, maps: FileMaps) -> dict[str, list[Span]]:
    """Trunk part -> the page-aligned spans of the model's files its tensors lie in, found from the
    tensors themselves (views of the maps): the layers first, then the head (the final norm, lm_head:
    with tied embeddings the embedding is the head's matrix, as in a packed store), the embedding last."""
    seen: set[int] = set()
    objects: dict[str, Any] = {f"layer.{i}": layer for i, layer in enumerate(decoder_layers(decoder))}
    rest = {k: v for k, v in vars(decoder).items() if k not in ("embed", "blocks", "layers", "hooks")}
    objects["head"] = rest
    objects["embed"] = decoder.embed
    seen.add(id(decoder))
    groups: dict[str, list[Span]] = {}
    for g, obj in objects.items():
        arrays: list[np.ndarray] = []
        _reachable_arrays(obj, seen, arrays)
        spans = []
        for arr in arrays:
            at = maps.locate(arr)
            if at is not None and arr.nbytes:
                spans.append((at[0], *_aligned(at[1], at[1] + int(arr.nbytes))))
        if spans:
            groups[g] = merged(spans)
    return groups


def mapped_layout(model: Any, store: Any) -> Layout:
    """A checkpoint directory or a GGUF file as it is: each expert read from the ranges of the files its
    matrices lie in (a checkpoint's per-expert tensors, a GGUF's slices of stacked tensors), each trunk part
    the spans its tensors lie in."""
    layers = moe_layers(model.decoder)
    if not layers:
        raise InputError(f"{store.path}: --ram needs a model with routed experts")
    files = store.mapped_files()
    maps = FileMaps(files)
    templates = {
        (i, e): mapped_template(ex, maps, str(store.path)) for i, moe in layers for e, ex in enumerate(moe.experts)
    }
    slot_bytes = -(-max(t.nbytes for t in templates.values()) // ALIGN) * ALIGN
    groups = trunk_spans(model.decoder, maps)
    lay = Layout(layers, templates, slot_bytes, maps.paths, groups, maps.maps, _top_k(layers))
    return _with_head(lay, model.decoder, maps)


def layout(model: Any, store: Any) -> Layout:
    return packed_layout(model, store) if isinstance(store, PackedStore) else mapped_layout(model, store)


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


def plan_budget(model: Any, lay: Layout, budget: int, context: int, prompt_tokens: int, sequences: int = 1) -> Plan:
    """The plan of `budget` for `sequences` concurrent sequences (the server's batch) of up to `context`
    tokens each (the longest prompt chunk: prompt_tokens); InputError when it cannot fit."""
    decoder = model.decoder
    sizes = {g: sum(b - a for _, a, b in spans) for g, spans in lay.groups.items()}
    state = model.new_state()
    kv = sequences * sum(cache_bytes(c, context) for c in state.caches)
    E = int(decoder.embed.cols)
    V = int(model.vocab_size)
    inter = max((t.expert.gate.rows for t in lay.templates.values()), default=E)
    from ..generate import PREFILL_CHUNK

    P = max(1, min(prompt_tokens, PREFILL_CHUNK))  # the longest prompt chunk
    T = P + sequences - 1  # the most rows a forward pass sees: a chunk beside the others' decoding tokens
    heads = int(getattr(model.spec, "num_attention_heads", 0) or 32)
    S = max(P, context)
    # + the scores [H, P, S] of one sequence's attention at a time
    scratch = SCRATCH_BASE + T * (64 * E + 8 * inter + 2 * V) * 4 + 2 * heads * P * S * 4
    chunks = {"head": lay.head_chunk_bytes} if lay.head_chunk_bytes else None
    derived = derived_bytes(decoder)
    plan = make_plan(
        budget, sizes, lay.slot_bytes, len(lay.templates), lay.top_k, kv, scratch, context, chunks, derived
    )
    plan.overhead = rss_now() + RUNTIME_GROWTH
    return plan


def attach(
    model: Any,
    store: Any,
    budget: int,
    context: int,
    prompt_tokens: int,
    policy: str = DEFAULT_POLICY,
    prefetch: bool = True,
    sequences: int = 1,
) -> Streaming:
    """Plans the budget for a context of `context` tokens (the longest prompt chunk: prompt_tokens) and
    switches the model's experts and trunk to streaming. Refuses (InputError) a budget that cannot fit."""
    lay = layout(model, store)
    plan = plan_budget(model, lay, budget, context, prompt_tokens, sequences)
    reader = BlobReader(lay.expert_files)
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
        head_map = lay.trunk_maps[lay.head_file]
        mm = getattr(head_map, "_mmap", None)
        chunked["head"] = ChunkedHead(lay.head, lay.head_chunk_rows, mm, int(head_map.ctypes.data))
        model.decoder.lm_head = chunked["head"]
        plan.notes.append(f"lm_head streamed in {len(chunked['head'].chunks)} chunks of {lay.head_chunk_rows} rows")
    verifier = lay.verifier(plan.pinned) if lay.verifier is not None else None
    trunk = TrunkStreamer(lay.trunk_maps, lay.groups, plan.pinned, chunked, verifier)
    model.decoder.hooks = trunk
    return Streaming(plan, cache, reader, trunk)


class TracingExperts(ResidentExperts):
    """A resident expert set that records which experts each MoE call asks for (run --trace)."""

    at_hand = False  # every call goes through fetch, so that decode is recorded too

    def __init__(self, experts: ResidentExperts, layer: int, trace: list[tuple[int, list[int]]]):
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
