"""Exact speculative decoding with drafts from prompt lookup.

A decoding sequence proposes up to k next tokens by finding the latest earlier occurrence of its last few
tokens (an n-gram) in everything it holds so far, prompt and output, and copying what followed it; or,
given a smaller draft model with the same tokenizer, by letting that model decode k tokens greedily. The
model then runs the chosen token and the k drafts in one pass (base.Rows.stepwise: each position attended
as one-token decoding attends it, so every row's logits have exactly decoding's bits), and the sequence
walks the rows in order: a draft is kept while it is the token the sampler takes at that position, the
first that is not is replaced by the sampler's own choice, and the rest are taken back out of the state
(State.rewind). One pass thus reads the trunk and each chosen expert once for several tokens.

Greedy output is byte-identical to plain decoding. Sampled output follows the standard rejection rule for
a draft that is certain (the draft distribution is one token): keep the draft d with probability p(d),
else draw from p without d, renormalised, so every token has exactly the target's distribution p. A seed
still fixes the output, for given speculation settings: the draft length depends only on the sequence's
own acceptance history, never on time or on the other sequences of a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .errors import InputError
from .sampling import Sampler

if TYPE_CHECKING:
    from .generate import Model

MAX_DRAFT = 64  # the longest draft --speculate K takes
AUTO_DRAFT = 8  # the longest draft auto proposes
NGRAM_MAX = 4  # the longest suffix looked up
AUTO_NGRAM_MIN = 2  # auto does not draft from a single matching token: too often wrong in plain prose

# What auto assumes one more verified position costs, as a fraction of a one-token pass: a position adds its
# routed experts' products (and reads, under a budget) and its attention, while the trunk's weights are read
# once per pass whatever its length. Routed experts are most of an MoE token's bytes (about half of
# Qwen3-30B-A3B's, a third of Kimi K3's). A constant, not a timing: the draft length must not depend on the
# machine's load, or a seed would not fix the output.
ROW_COST = 0.5


@dataclass(frozen=True)
class Speculation:
    """max_draft: the longest draft (0: off); adaptive: choose each draft's length from the acceptance so
    far (auto), else always propose max_draft tokens when the lookup finds them; draft: a draft model
    (generate.Model) that proposes instead of the lookup."""

    max_draft: int = AUTO_DRAFT
    adaptive: bool = True
    draft: Any = None

    def with_draft(self, draft: Model | None) -> Speculation:
        return Speculation(self.max_draft, self.adaptive, draft)

    @classmethod
    def parse(cls, value: str | int | Speculation | None) -> Speculation:
        """'auto' (default for None), 'off' (or 0) or a draft length K."""
        if isinstance(value, Speculation):
            return value
        if value is None or value == "auto":
            return AUTO
        if value == "off":
            return OFF
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise InputError(f"--speculate must be auto, off or a draft length, got {str(value)[:40]!r}")
        try:
            k = int(value)
        except ValueError:
            raise InputError(f"--speculate must be auto, off or a draft length, got {str(value)[:40]!r}") from None
        if not 0 <= k <= MAX_DRAFT:
            raise InputError(f"--speculate: a draft length must be between 0 and {MAX_DRAFT}, got {value!r}")
        return cls(k, False)

    @property
    def on(self) -> bool:
        return self.max_draft > 0

    @property
    def ngram_min(self) -> int:
        return AUTO_NGRAM_MIN if self.adaptive else 1

    def __str__(self) -> str:
        mode = "off" if not self.on else "auto" if self.adaptive else str(self.max_draft)
        return mode if self.draft is None or not self.on else f"{mode}, draft model {self.draft.name}"


AUTO = Speculation()
OFF = Speculation(0, False)


class Drafter(Protocol):
    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow history."""
        ...

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens accepted after the last proposal (history grew by them)."""
        ...


class PromptLookup:
    """An index of every n-gram (n = 1..NGRAM_MAX) of a token sequence to the position after its latest
    occurrence; propose() copies what followed the latest earlier occurrence of the sequence's longest
    matching suffix. Extended as tokens are accepted: O(NGRAM_MAX) per token."""

    def __init__(self, ids: Sequence[int], ngram_min: int = 1):
        self.ids: list[int] = []
        self.ngram_min = ngram_min
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM_MAX + 1)]
        self.extend(ids)

    def extend(self, tokens: Sequence[int]) -> None:
        ids = self.ids
        for t in tokens:
            j = len(ids)  # t's position: the n-grams ending just before it are followed by it
            for n in range(1, min(NGRAM_MAX, j) + 1):
                self.index[n][tuple(ids[j - n : j])] = j
            ids.append(int(t))

    def propose(self, history: list[int] | None, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found (of the
        ids extended so far: history is not needed)."""
        ids = self.ids
        if k <= 0:
            return []
        for n in range(min(NGRAM_MAX, len(ids) - 1), self.ngram_min - 1, -1):
            p = self.index[n].get(tuple(ids[len(ids) - n :]))
            if p is not None:
                return ids[p : p + k]
        return []


class ModelDrafts:
    """Drafts from a smaller model with the same tokenizer: it decodes k tokens greedily after the history.
    Its state holds the history but its last token; a snapshot taken before each draft brings it back when
    drafts are rejected, and the accepted tokens are fed again (in one pass: a draft needs no exact bits,
    only the same ones each time, which it gets)."""

    def __init__(self, model: Model):
        self.model = model
        self.state = model.new_state()
        self.snap: tuple[int, list[Any]] | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        pass

    def propose(self, history: list[int] | None, k: int) -> list[int]:
        from .generate import PREFILL_CHUNK

        assert history is not None
        if k <= 0:
            return []
        m, st = self.model, self.state
        want = history[:-1]
        if self.snap is not None and st.ids[self.snap[0] :] != want[self.snap[0] : len(st.ids)]:
            st.restore(self.snap)  # a draft was rejected: back to before it
        todo = want[len(st.ids) :]
        for c in range(0, len(todo), PREFILL_CHUNK):
            m.decoder.forward(todo[c : c + PREFILL_CHUNK], st, m.ctx)
        self.snap = st.snapshot()
        out: list[int] = []
        last = history[-1]
        for _ in range(k):
            last = int(np.argmax(m.decoder.forward([last], st, m.ctx)[0]))
            out.append(last)
        return out


def drafter(spec: Speculation, history: list[int]) -> Drafter | None:
    """The drafter a sequence with `history` uses under spec (None: off)."""
    if not spec.on:
        return None
    if spec.draft is not None:
        return ModelDrafts(spec.draft)
    return PromptLookup(history, spec.ngram_min)


PROBES = ("def main(argv):\n    return 0\n", "The quick brown fox, 1234 times: écoute!", " \t\n<|x|>")


def check_draft(target: Model, draft: Model) -> None:
    """Refuses (InputError) a draft model whose ids do not mean the target's tokens: a larger vocabulary, or
    a tokenizer that encodes text otherwise."""
    if draft.vocab_size > target.vocab_size:
        raise InputError(
            f"--draft {draft.name}: its vocabulary ({draft.vocab_size}) is larger than {target.name}'s "
            f"({target.vocab_size}); a draft model must share the model's tokenizer"
        )
    a, b = target.tokenizer, draft.tokenizer
    if a is None and b is None:
        return  # ids only: the user vouches for them
    if a is None or b is None:
        raise InputError(f"--draft {draft.name}: one model has a tokenizer and the other none; they must share one")
    if any(a.encode(p, add_bos=False) != b.encode(p, add_bos=False) for p in PROBES) or a.eos_ids != b.eos_ids:
        raise InputError(f"--draft {draft.name}: its tokenizer is not {target.name}'s")


class DraftLength:
    """How many drafts to propose next: with a per-draft acceptance rate a (drafts are accepted in a run until
    the first miss, so a pass of k drafts yields (1 - a^(k+1)) / (1 - a) tokens on average), the k that gives
    the most tokens per unit of pass cost 1 + ROW_COST*k. a is estimated from decayed counts with a prior,
    and the counts decay on every token, drafted or not: after a run of misses auto stops drafting, and
    tries again some tokens later."""

    PRIOR, PRIOR_WEIGHT, DECAY = 0.6, 2.0, 0.8

    def __init__(self, spec: Speculation):
        self.spec = spec
        self.hits = 0.0  # decayed count of accepted drafts
        self.trials = 0.0  # decayed count of drafts judged (accepted ones and the first miss of each pass)

    @property
    def rate(self) -> float:
        return (self.hits + self.PRIOR * self.PRIOR_WEIGHT) / (self.trials + self.PRIOR_WEIGHT)

    def next(self) -> int:
        spec = self.spec
        if not spec.adaptive:
            return spec.max_draft
        a = min(self.rate, 0.999)
        best, best_k = 1.0, 0
        for k in range(1, spec.max_draft + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + ROW_COST * k)
            if gain > best + 1e-9:
                best, best_k = gain, k
        return best_k

    def update(self, proposed: int, accepted: int) -> None:
        """After a pass (proposed 0: a token decoded without drafts)."""
        self.hits *= self.DECAY
        self.trials *= self.DECAY
        if proposed:
            self.hits += accepted
            self.trials += accepted + (accepted < proposed)


@dataclass
class SpeculationStats:
    """What a generation's speculation did: passes that verified drafts, drafts proposed and accepted."""

    passes: int = 0  # decoding passes (with drafts or not)
    drafted_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the decoding passes gave

    def add(self, other: SpeculationStats) -> None:
        self.passes += other.passes
        self.drafted_passes += other.drafted_passes
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.tokens += other.tokens

    def as_dict(self) -> dict[str, float | int]:
        return {
            "passes": self.passes,
            "drafts_proposed": self.proposed,
            "drafts_accepted": self.accepted,
            "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else 0.0,
            "tokens_per_pass": round(self.tokens / self.passes, 4) if self.passes else 0.0,
        }


def choose(sampler: Sampler, logits: np.ndarray, history: Sequence[int], draft: int | None) -> int:
    """The token at a position whose logits are `logits`: the sampler's choice, by the rejection rule when a
    draft is offered (greedy: the draft is kept iff it is the argmax, which is the same rule)."""
    if draft is None or sampler.params.greedy:
        return sampler.sample(logits, history)
    probs = sampler.distribution(logits, history)
    if sampler.rng.random() < probs[draft]:
        return draft
    probs[draft] = 0.0
    order = np.flatnonzero(probs)  # token ids in increasing order: a fixed walk, as Sampler.sample
    if order.shape[0] == 0:  # p was one-hot at the draft; unreachable (the draft was then kept)
        return draft
    cum = np.cumsum(probs[order])
    u = sampler.rng.random() * cum[-1]
    return int(order[min(int(np.searchsorted(cum, u, side="right")), order.shape[0] - 1)])
