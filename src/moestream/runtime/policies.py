"""Replacement policies of the expert cache. A policy sees every demand access (hit or miss) and is
asked for a victim among the evictable resident keys; it never decides what the model computes, only
how fast. `benchmarks/cache_policies.py` replays recorded routing traces through each one beside
Belady's optimum."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Protocol

Key = Hashable


class Policy(Protocol):
    name: str

    def access(self, key: Key) -> None:
        """A demand request for key (before it is made resident on a miss)."""

    def insert(self, key: Key) -> None:
        """key became resident."""

    def remove(self, key: Key) -> None:
        """key was evicted."""

    def victim(self, candidates: Iterable[Key]) -> Key:
        """The resident key to evict, among candidates (resident and not in use)."""


class LRU:
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def insert(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key:
        allowed = set(candidates)
        for key in self.order:
            if key in allowed:
                return key
        raise LookupError("no evictable key")


class LFUAging:
    """Least frequently used, with ageing: every key's request count (kept for evicted keys too, so a
    popular expert that was pushed out comes back with its history) is halved every `period` requests,
    so that old popularity fades. Ties go to the least recently used. MoE routing is skewed (some
    experts are chosen far more often) and cyclic over layers, which LRU handles badly."""

    name = "lfu"

    def __init__(self, period: int = 4096) -> None:
        self.count: dict[Key, float] = {}
        self.last: dict[Key, int] = {}
        self.clock = 0
        self.period = period

    def access(self, key: Key) -> None:
        self.clock += 1
        self.count[key] = self.count.get(key, 0.0) + 1.0
        self.last[key] = self.clock
        if self.clock % self.period == 0:
            for k in self.count:
                self.count[k] *= 0.5

    def insert(self, key: Key) -> None:
        self.last.setdefault(key, self.clock)

    def remove(self, key: Key) -> None:
        pass

    def victim(self, candidates: Iterable[Key]) -> Key:
        best = min(candidates, key=lambda k: (self.count.get(k, 0.0), self.last.get(k, 0)), default=None)
        if best is None:
            raise LookupError("no evictable key")
        return best


POLICIES = {"lru": LRU, "lfu": LFUAging}
DEFAULT_POLICY = "lfu"


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        from ..errors import InputError

        raise InputError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})") from None


def belady_hits(trace: list[Key], slots: int) -> int:
    """Hits of the optimal offline policy (evict the key whose next use is furthest away)."""
    import heapq

    nxt = [0] * len(trace)
    seen: dict[Key, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = seen.get(trace[i], len(trace) + i)
        seen[trace[i]] = i
    resident: dict[Key, int] = {}  # key -> its next use
    heap: list[tuple[int, int, Key]] = []  # (-next use, tiebreak, key), lazily invalidated
    hits = 0
    for i, key in enumerate(trace):
        if key in resident:
            hits += 1
        elif len(resident) >= slots:
            while True:
                neg, _, k = heapq.heappop(heap)
                if resident.get(k) == -neg:
                    del resident[k]
                    break
        resident[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], i, key))
    return hits


def replay(policy: Policy, trace: list[Key], slots: int) -> int:
    """Hits of policy on trace with `slots` resident keys (demand fetches only)."""
    resident: set[Key] = set()
    hits = 0
    for key in trace:
        policy.access(key)
        if key in resident:
            hits += 1
            continue
        if len(resident) >= slots:
            v = policy.victim(resident)
            resident.discard(v)
            policy.remove(v)
        resident.add(key)
        policy.insert(key)
    return hits
