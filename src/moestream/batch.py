"""Several sequences decoded together, one forward pass a step (continuous batching).

A `Sequence` is one request's generation: its prompt, fed in PREFILL_CHUNK chunks, then one token a step,
each chosen by its own sampler from its own logits. `step` runs one pass for a set of sequences: each gives
its next input (the next prompt chunk, or the token it chose last) and those that have finished their
prompt get their next token. A sequence's logits do not depend on which others share the step
(models.base.Rows), and its prompt is cut into the same chunks as `Model.generate` cuts it, so every
sequence gets exactly the tokens it would get alone, greedy or seeded.

At most `prefill_tokens` prompt positions join a step, so a long prompt arriving does not stop the
sequences already decoding for its whole prefill: they get a token with each of its chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .runtime.integrity import check_logits
from .sampling import Sampler, SamplingParams
from .speculative import OFF, DraftLength, Speculation, SpeculationStats, choose, drafter

if TYPE_CHECKING:
    from .generate import GenerationStats, Model
    from .models.base import Ctx, State


class LogitsConstraint(Protocol):
    """Restricts the tokens a sequence may choose (structured output): masks the logits before sampling and
    is told each token chosen."""

    def mask(self, logits: np.ndarray) -> None: ...

    def accept(self, token: int) -> None: ...

    @property
    def finished(self) -> bool: ...


@dataclass
class TokenLogprobs:
    """A chosen (or prompt) token's log-probability under the model's distribution (log_softmax of the raw
    logits, before temperature, penalties or constraints), and the `top` most likely tokens' (id, logprob)
    in decreasing order."""

    token: int
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    top: list[tuple[int, float]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] float32 -> float64 log-probabilities (float64: a sum over 160k exponentials)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def logprobs_of(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """logits [N, V] and the token each row is scored against -> one TokenLogprobs per row."""
    out = []
    for i, token in enumerate(tokens):
        row = log_softmax(logits[i])  # a row at a time: float64 copies of a whole prompt chunk are large
        best: list[tuple[int, float]] = []
        if top > 0:
            ids = np.argpartition(-row, top - 1)[:top]
            ids = ids[np.lexsort((ids, -row[ids]))]  # most likely first, ties by id
            best = [(int(i), float(row[i])) for i in ids]
        out.append(TokenLogprobs(int(token), float(row[token]), best))
    return out


@dataclass
class Sequence:
    """One request's generation (see the module's text). After each step that gives it tokens, `new` holds
    them (one, or several when speculation's drafts were accepted: speculative.py) and `new_logprobs` their
    TokenLogprobs when asked for; `token` is the last of them. `done` once it chose an end-of-text id,
    reached max_new_tokens or its constraint finished. The state then holds every token but the last."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    state: State
    eos: frozenset[int]
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the completions API's echo)
    constraint: LogitsConstraint | None = None
    stats: GenerationStats | None = None
    logits_out: list[np.ndarray] | None = None  # receives the logits [V] each token was chosen from
    speculation: Speculation = OFF
    sampler: Sampler = field(init=False)
    history: list[int] = field(init=False)  # what the sampler's penalties look back on
    fed: int = 0  # prompt tokens fed so far
    generated: list[int] = field(default_factory=list)
    token: int | None = None
    new: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # the drafts the next (or running) step verifies
    spec_stats: SpeculationStats = field(default_factory=SpeculationStats)
    prompt_scores: list[TokenLogprobs] = field(default_factory=list)
    done: bool = False
    error: Exception | None = None  # why this sequence failed (the others in its steps go on)
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.sampling)
        self.history = list(self.state.ids) + list(self.prompt)
        self.drafter = drafter(self.speculation, self.history)
        self.draft_length = DraftLength(self.speculation)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def token_logprobs(self) -> TokenLogprobs | None:
        """The last new token's TokenLogprobs (when asked for)."""
        return self.new_logprobs[-1] if self.new_logprobs else None

    @property
    def stepwise(self) -> bool:
        """Whether the next input is a token and drafts to verify (one-token decoding's bits per position)."""
        return not self.prefilling and bool(self.drafts)

    def next_input(self, chunk: int) -> list[int]:
        if self.prefilling:
            return self.prompt[self.fed : self.fed + chunk]
        assert self.token is not None and not self.done
        self.drafts = []
        if self.drafter is not None:
            room = self.max_new_tokens - len(self.generated) - 1  # no draft past the last token wanted
            k = min(self.draft_length.next(), room)
            self.drafts = self.drafter.propose(self.history, k) if k > 0 else []
        return [self.token, *self.drafts]

    def _took(self, ids: list[int], logits: np.ndarray, seconds: float, ctx: Ctx) -> None:
        """The step fed ids and gave logits ([len(ids), V] when prompt logprobs are wanted or drafts were
        verified, else [1, V])."""
        from_prompt = self.prefilling
        if from_prompt:
            first = self.fed == 0 and len(self.state.ids) == len(ids)  # nothing before the prompt
            if self.prompt_logprobs is not None:
                # row i scores the prompt's next token; the prompt's first token is scored by nothing
                nxt = self.prompt[self.fed + 1 : self.fed + len(ids) + 1]
                if first:
                    self.prompt_scores.append(TokenLogprobs(ids[0], None, []))
                self.prompt_scores.extend(logprobs_of(logits[: len(nxt)], nxt, self.prompt_logprobs))
            self.fed += len(ids)
            if self.stats is not None:
                self.stats.prefill_seconds += seconds
            if self.prefilling or self.max_new_tokens == 0:  # 0: the prompt scored, nothing generated
                self.token = None
                self.new, self.new_logprobs = [], []
                self.done = not self.prefilling
                return
        elif self.stats is not None:
            self.stats.decode_seconds += seconds
        self.new, self.new_logprobs = [], []
        drafts = [] if from_prompt else self.drafts
        self.drafts = []
        accepted = 0
        for i, raw in enumerate(logits if drafts else logits[-1:]):  # [1 + drafts, V]
            draft = drafts[i] if i < len(drafts) else None
            self._choose(raw, draft)
            if self.done or draft is None or self.token != draft:
                break
            accepted += 1
        if drafts:  # the positions past the last kept token go back out of the state
            self.state.rewind(len(self.history) - 1, ctx)
        if not from_prompt:
            st = self.spec_stats
            st.passes += 1
            st.tokens += len(self.new)
            if drafts:
                st.drafted_passes += 1
                st.proposed += len(drafts)
                st.accepted += accepted
            self.draft_length.update(len(drafts), accepted)
        if self.drafter is not None:
            self.drafter.extend(self.new)

    def _choose(self, raw: np.ndarray, draft: int | None) -> None:
        """Chooses the token at one position from its logits raw [V] (draft: the token a draft puts there)."""
        check_logits(raw, len(self.history) - 1)
        allowed = raw
        if self.constraint is not None:
            allowed = raw.copy()
            self.constraint.mask(allowed)
        token = choose(self.sampler, allowed, self.history, draft)
        if self.logits_out is not None:
            self.logits_out.append(raw)
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.logprobs is not None:
            self.new_logprobs.append(logprobs_of(raw[None], [token], self.logprobs)[0])
        self.token = token
        self.new.append(token)
        self.generated.append(token)
        self.history.append(token)
        if self.stats is not None:
            self.stats.generated_tokens = len(self.generated)
        self.done = (
            token in self.eos
            or len(self.generated) >= self.max_new_tokens
            or (self.constraint is not None and self.constraint.finished)
        )


def step(model: Model, seqs: list[Sequence], prefill_tokens: int, chunk: int) -> list[Sequence]:
    """One forward pass for the sequences that are not done: every decoding one, and prefilling ones in
    order while their chunks add up to at most prefill_tokens (always at least one). Returns the sequences
    that took part; those among them with a new `token` have `token` set (else None: still prefilling).
    A failure is the failing sequence's alone (its `error`, and it is done): sampling, a constraint or a
    check of its logits; a failed pass fails every sequence in it (their states have moved)."""
    taking: list[Sequence] = []
    ids: list[list[int]] = []
    budget, prefills = prefill_tokens, 0
    for s in seqs:
        if s.done:
            continue
        x = s.next_input(chunk)
        if s.prefilling:
            if prefills and len(x) > budget:
                continue
            budget -= len(x)
            prefills += 1
        taking.append(s)
        ids.append(x)
    if not taking:
        return []
    t0 = time.perf_counter()
    every = [(s.prefilling and s.prompt_logprobs is not None) or s.stepwise for s in taking]
    stepwise = [s.stepwise for s in taking]
    try:
        outs = model.decoder.forward_batch(ids, [s.state for s in taking], model.ctx, every, stepwise)
    except Exception as e:
        for s in taking:
            s.error, s.done, s.token = e, True, None
        return taking
    seconds = time.perf_counter() - t0
    for s, x, logits in zip(taking, ids, outs, strict=True):
        try:
            s._took(x, logits, seconds, model.ctx)
        except Exception as e:
            s.error, s.done, s.token = e, True, None
    return taking
