"""The memory planner: one number (--ram, or a preset) split, before anything is allocated, into the
KV/state caches for the context, activation scratch, the streaming room for unpinned trunk parts, the
pinned trunk parts and the expert cache slots. A budget that cannot hold the minimum is refused with
the minimum and its biggest consumers."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError

MB = 1 << 20
GB = 1 << 30
PRESETS: dict[str, int] = {
    "laptop": 8 * GB,
    "desktop": 16 * GB,
    "workstation": 64 * GB,
    "server": 256 * GB,
}
PRESET_HELP = {
    **{name: f"{size // GB} GiB" for name, size in PRESETS.items()},
    "max": "everything resident (no budget)",
    "auto": "80% of what this machine (or its memory cgroup) has available",
}
SCRATCH_BASE = 2 * MB
# What the process adds after planning besides the plan's buffers: library code paged in by the first
# forward pass and Python heap growth (measured 4-8 MB on the test models); stated in the overhead.
RUNTIME_GROWTH = 12 * MB


MAX_SIZE = 1 << 50  # 1 PiB: a budget beyond any machine, and within float's exact integers


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5GiB', '123456' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise InputError(f"--ram: cannot read {text!r} as a size (examples: 8G, 512M, 1.5GiB)")
    unit = {"": 1, "k": 1 << 10, "m": MB, "g": GB, "t": 1 << 40}[m.group(2)]
    value = float(m.group(1)) * unit  # inf for 400 digits: refused below, not an OverflowError
    if not value < MAX_SIZE:
        raise InputError(f"--ram: {text.strip()[:24]!r} is more than 1 PiB")
    return int(value)


def cgroup_limit() -> int:
    """The memory limit of this process's cgroup (v2 or v1), or 0 if none."""
    candidates = [Path("/sys/fs/cgroup/memory.max")]
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[1] == "" or "memory" in parts[1].split(",")):
                rel = parts[2].lstrip("/")
                candidates += [
                    Path("/sys/fs/cgroup") / rel / "memory.max",
                    Path("/sys/fs/cgroup/memory") / rel / "memory.limit_in_bytes",
                ]
    except OSError:
        pass
    candidates.append(Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
    for p in candidates:
        try:
            text = p.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return 0


def meminfo(key: str) -> int:
    """A /proc/meminfo field ("MemAvailable", "MemTotal") in bytes, or 0 where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def mem_available() -> int:
    return meminfo("MemAvailable")


def print_presets() -> None:
    """What --list-presets prints."""
    for name, what in PRESET_HELP.items():
        print(f"{name:12s} {what}")


def resolve_budget(ram: str | None, preset: str | None) -> int | None:
    """Bytes for --ram / --preset; None means no budget (everything resident)."""
    if ram is not None and preset is not None:
        raise InputError("give --ram or --preset, not both")
    if ram is not None:
        return parse_size(ram)
    if preset is None or preset == "max":
        return None
    if preset == "auto":
        avail = mem_available()
        limit = cgroup_limit()
        if limit:
            avail = min(avail, max(0, limit - rss_now())) if avail else limit - rss_now()
        return int(avail * 0.8)
    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r} (see --list-presets)")
    return PRESETS[preset]


def _status_kb(field_name: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_now() -> int:
    return _status_kb("VmRSS")


def peak_rss() -> int:
    """The peak RSS of this process image (VmHWM; getrusage's ru_maxrss would carry the parent's peak
    across fork + exec)."""
    return _status_kb("VmHWM")


def cache_bytes(cache: Any, n_tokens: int) -> int:
    """Worst-case bytes of one layer's cache after n_tokens: arrays with an empty axis grow with the
    context (to at most twice what is needed, the old copy alive while growing: 3x); others are fixed."""
    total = 0
    for v in vars(cache).values():
        if isinstance(v, np.ndarray):
            if 0 in v.shape:
                per = int(np.prod([d for d in v.shape if d])) * v.itemsize
                total += 3 * per * n_tokens
            else:
                total += int(v.nbytes)
    return total


@dataclass
class Plan:
    budget: int
    context: int
    kv_bytes: int
    scratch_bytes: int
    trunk_bytes: int
    pinned: list[str]
    pinned_bytes: int
    stream_bytes: int  # room for the unpinned trunk parts in flight (the running one and the next)
    expert_slots: int
    slot_bytes: int
    n_experts: int  # routed experts in the whole model
    derived_bytes: int = 0  # arrays made from weights at run time (MLA absorbed-decode f32 copies)
    overhead: int = 0  # RSS before the plan's buffers (interpreter, libraries, tokenizer) + RUNTIME_GROWTH
    notes: list[str] = field(default_factory=list)

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * self.slot_bytes

    @property
    def used(self) -> int:
        fixed = self.kv_bytes + self.scratch_bytes + self.derived_bytes
        return fixed + self.pinned_bytes + self.stream_bytes + self.expert_cache_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["expert_cache_bytes"] = self.expert_cache_bytes
        d["used"] = self.used
        return d

    def describe(self) -> str:
        def mb(n: int) -> str:
            return f"{n / MB:.1f} MB"

        return (
            f"plan for {mb(self.budget)}: expert cache {self.expert_slots} x {mb(self.slot_bytes)} = "
            f"{mb(self.expert_cache_bytes)} ({self.expert_slots}/{self.n_experts} experts), trunk pinned "
            f"{mb(self.pinned_bytes)} of {mb(self.trunk_bytes)} ({len(self.pinned)} parts) + streaming "
            f"{mb(self.stream_bytes)}, KV/state {mb(self.kv_bytes)} for {self.context} tokens, scratch "
            f"{mb(self.scratch_bytes)}, derived {mb(self.derived_bytes)}; overhead {mb(self.overhead)} on top"
        )


def make_plan(
    budget: int,
    groups: dict[str, int],
    slot_bytes: int,
    n_experts: int,
    top_k: int,
    kv_bytes: int,
    scratch_bytes: int,
    context: int,
    chunks: dict[str, int] | None = None,
    derived_bytes: int = 0,
) -> Plan:
    """groups: trunk parts ("embed", "layer.N", "head") -> bytes. The embedding is read by rows (a
    page per row) and never pinned; the others are pinned largest first while they fit beside the
    minimum expert cache (top_k + 1 slots); what is left goes to more expert slots. chunks: parts that
    stream in pieces (the lm_head) -> the size of a piece, which is all they need in flight."""
    stream_groups = {g: n for g, n in groups.items() if g != "embed"}
    chunks = chunks or {}

    def in_flight(g: str) -> int:
        return min(stream_groups[g], chunks.get(g, stream_groups[g]))

    biggest = sorted((in_flight(g) for g in stream_groups), reverse=True)
    stream_room = sum(biggest[:2])  # the part running and the one read ahead
    min_slots = top_k + 1
    fixed = kv_bytes + scratch_bytes + derived_bytes
    minimum = fixed + stream_room + min_slots * slot_bytes
    if budget < minimum:
        parts = sorted(
            [
                ("trunk streaming (two largest trunk parts)", stream_room),
                (f"expert slots ({min_slots} x {slot_bytes / MB:.1f} MB)", min_slots * slot_bytes),
                (f"KV/state for {context} tokens", kv_bytes),
                ("activation scratch", scratch_bytes),
                ("derived MLA decode matrices", derived_bytes),
            ],
            key=lambda p: -p[1],
        )
        detail = ", ".join(f"{name} {n / MB:.1f} MB" for name, n in parts[:3])
        raise InputError(
            f"--ram {budget / MB:.0f} MB cannot run this model: it needs at least {minimum / MB:.0f} MB ({detail})"
        )
    room = budget - fixed - min_slots * slot_bytes
    pinned: list[str] = []
    pinned_bytes = 0
    unpinned = dict(stream_groups)
    for g, n in sorted(stream_groups.items(), key=lambda kv: -kv[1]):
        rest = sorted((in_flight(k) for k in unpinned if k != g), reverse=True)
        need = pinned_bytes + n + sum(rest[:2])
        if need <= room:
            pinned.append(g)
            pinned_bytes += n
            del unpinned[g]
    rest = sorted((in_flight(k) for k in unpinned), reverse=True)
    stream_bytes = sum(rest[:2])
    left = budget - fixed - pinned_bytes - stream_bytes
    slots = max(min_slots, min(n_experts, left // slot_bytes))
    plan = Plan(
        budget=budget,
        context=context,
        kv_bytes=kv_bytes,
        scratch_bytes=scratch_bytes,
        trunk_bytes=sum(stream_groups.values()),
        pinned=sorted(pinned, key=_group_order),
        pinned_bytes=pinned_bytes,
        stream_bytes=stream_bytes,
        expert_slots=int(slots),
        slot_bytes=slot_bytes,
        n_experts=n_experts,
        derived_bytes=derived_bytes,
    )
    return plan


def _group_order(g: str) -> tuple[int, int]:
    if g == "embed":
        return (0, 0)
    if g.startswith("layer."):
        return (1, int(g.split(".")[1]))
    return (2, 0)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
