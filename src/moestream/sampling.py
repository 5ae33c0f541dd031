"""Choosing the next token from logits: greedy, or sampled after penalties, temperature, top-k, top-p and
min-p (applied in that order, as llama.cpp and Hugging Face do), from a seeded generator. The same seed
and the same logits give the same tokens on every machine: probabilities are computed in float64 and
ties are broken by token id. Stop strings are matched on the text as it is produced."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import InputError

# Ranges as llama.cpp and OpenAI take them, with finite upper bounds where they have none.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0
MAX_TOP_K = 10_000_000  # the largest vocabulary a config may have
MAX_LAST_N = 1 << 24
SEED_MAX = 2**64 - 1


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (the default); the other options only matter when sampling, except the
    penalties, which also shape the greedy choice."""

    temperature: float = 0.0
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already seen (logit / p if > 0, else * p)
    presence_penalty: float = 0.0  # subtracted once from every token already seen (OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence (OpenAI)
    penalty_last_n: int = 64  # how many of the latest tokens (prompt included) the penalties look at; -1: all
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self._check_types()
        checks = [
            (
                0 <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}",
            ),
            (0 <= self.top_k <= MAX_TOP_K, f"top_k must be in [0, {MAX_TOP_K}] (0: all tokens), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                0 < self.repetition_penalty <= MAX_PENALTY,
                f"repetition_penalty must be in (0, {MAX_PENALTY}], got {self.repetition_penalty}",
            ),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (
                -1 <= self.penalty_last_n <= MAX_LAST_N,
                f"penalty_last_n must be in [-1, {MAX_LAST_N}] (-1: all), got {self.penalty_last_n}",
            ),
            (self.seed is None or 0 <= self.seed <= SEED_MAX, f"seed must be in [0, {SEED_MAX}], got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)

    def _check_types(self) -> None:
        """Numbers are numbers (not bools, not strings) and finite; integers are integers; stop strings are
        non-empty strings. The server hands over JSON values as they came."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise InputError(f"{name} must be a finite number, got {_short(v)}")
        for name in ("top_k", "penalty_last_n", "seed"):
            v = getattr(self, name)
            if (v is not None or name != "seed") and (isinstance(v, bool) or not isinstance(v, int)):
                raise InputError(f"{name} must be an integer, got {_short(v)}")
        if not isinstance(self.stop, tuple | list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InputError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, seed: int | None) -> SamplingParams:
        return replace(self, seed=seed)


GREEDY = SamplingParams()


class Sampler:
    """Holds the random generator of one generation; sample() is called once per token."""

    def __init__(self, params: SamplingParams = GREEDY):
        self.params = params
        self._rng: np.random.Generator | None = None  # made on the first draw: greedy never needs one

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            seed = self.params.seed
            if seed is None:  # unseeded: fresh entropy
                seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1)
            self._rng = np.random.Generator(np.random.PCG64(seed))
        return self._rng

    @property
    def penalizes(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0

    def penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """logits [vocab] after the repetition, presence and frequency penalties, as float64."""
        p = self.params
        out = np.asarray(logits, np.float64).copy()
        if not self.penalizes:
            return out
        window = history if p.penalty_last_n == -1 else history[-p.penalty_last_n :] if p.penalty_last_n else ()
        if not window:
            return out
        counts = Counter(window)
        ids = np.fromiter(counts, np.int64, len(counts))
        n = np.fromiter(counts.values(), np.float64, len(counts))
        ids_ok = (ids >= 0) & (ids < out.shape[0])
        ids, n = ids[ids_ok], n[ids_ok]
        seen = out[ids]
        if p.repetition_penalty != 1:
            seen = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        seen = seen - p.presence_penalty - p.frequency_penalty * n
        out[ids] = seen
        return out

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The probabilities [vocab] the next token is drawn from (one-hot at the argmax when greedy)."""
        p = self.params
        z = self.penalized(logits, history)
        probs = np.zeros_like(z)
        if p.greedy:
            probs[int(np.argmax(z))] = 1.0
            return probs
        z = z / p.temperature
        order = np.argsort(-z, kind="stable")  # descending logit, ties by token id
        zs = z[order]
        if p.top_k:
            zs = zs[: p.top_k]
        e = np.exp(zs - zs[0])
        ps = e / e.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(ps), p.top_p, side="left")) + 1  # smallest set reaching top_p
            ps = ps[:keep]
        if p.min_p > 0:
            ps = ps[ps >= p.min_p * ps[0]]
        ps = ps / ps.sum()
        probs[order[: ps.shape[0]]] = ps
        return probs

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        if p.greedy:  # no copy of the logits unless a penalty changes them
            return int(np.argmax(self.penalized(logits, history) if self.penalizes else logits))
        probs = self.distribution(logits, history)
        order = np.flatnonzero(probs)  # token ids in increasing order: a fixed walk
        cum = np.cumsum(probs[order])
        u = self.rng.random() * cum[-1]
        return int(order[min(int(np.searchsorted(cum, u, side="right")), order.shape[0] - 1)])


class StopMatcher:
    """Text filter for stop strings: feed() returns the text that can be shown now (holding back a tail
    that could still grow into a stop string) and sets `stopped` when one appears; the text shown never
    includes the stop string or anything after it."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stop:
            return text
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return buf[:cut]
        hold = 0  # the longest tail of buf that is a proper prefix of a stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
