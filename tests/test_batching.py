"""Continuous batching: several sequences in one forward pass get, bit for bit, the logits and tokens each
gets alone (models.base.Rows, batch.step), for every architecture, resident and within a budget, greedy
and seeded; prompts arriving while others decode are prefilled in the same chunks as alone."""

from __future__ import annotations

import numpy as np
import pytest

import moestream
from moestream.batch import Sequence, log_softmax, logprobs_of, step
from moestream.generate import PREFILL_CHUNK
from moestream.sampling import GREEDY, SamplingParams


def alone(model, prompt: list[int], n: int, sampling: SamplingParams = GREEDY) -> tuple[list[int], list[np.ndarray]]:
    logits: list[np.ndarray] = []
    ids = list(model.generate(prompt, n, sampling=sampling, stop_at_eos=False, logits_out=logits))
    return ids, logits


def together(model, prompts, n: int, samplings, arrive_every: int = 1, prefill_tokens: int = PREFILL_CHUNK):
    """The prompts' generations in one batch, prompt i joining at step i * arrive_every: each sequence's
    tokens and the logits each was chosen from, and the sequences."""
    seqs = [
        Sequence(p, n, s, model.new_state(), frozenset(), logprobs=0, logits_out=[])
        for p, s in zip(prompts, samplings, strict=True)
    ]
    t = 0
    while not all(s.done for s in seqs):
        step(model, [s for i, s in enumerate(seqs) if i * arrive_every <= t], prefill_tokens, PREFILL_CHUNK)
        t += 1
    return [s.generated for s in seqs], [s.logits_out for s in seqs], seqs


def prompts_for(vocab: int, lengths=(7, 30, 3, 12)) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def assert_same_as_alone(model, prompts, n, samplings, **kw):
    ids, seen, _ = together(model, prompts, n, samplings, **kw)
    for p, s, got_ids, got_logits in zip(prompts, samplings, ids, seen, strict=True):
        want_ids, want_logits = alone(model, p, n, s)
        assert got_ids == want_ids
        assert len(got_logits) == len(want_logits)
        for a, b in zip(got_logits, want_logits, strict=True):
            assert a.tobytes() == b.tobytes()


def test_every_architecture_batched_equals_alone(case):
    model = moestream.load(case.path, threads=2)
    prompts = prompts_for(model.vocab_size)
    assert_same_as_alone(model, prompts, 6, [GREEDY] * len(prompts))


def test_demo_seeded_sampling_and_long_prompts_batched_equal_alone():
    model = moestream.load()
    prompts = prompts_for(model.vocab_size, lengths=(5, PREFILL_CHUNK + 40, 2, 9))  # one prompt of two chunks
    samplings = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=7), SamplingParams(temperature=1.2, seed=1)]
    samplings.append(SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.1, seed=3))
    assert_same_as_alone(model, prompts, 8, samplings, arrive_every=2, prefill_tokens=64)


def test_batched_within_a_budget_equals_resident(tmp_path):
    resident = moestream.load()
    prompts = prompts_for(resident.vocab_size)
    want = [alone(resident, p, 6)[0] for p in prompts]
    with moestream.load("demo", ram="40M", context=256, sequences=len(prompts)) as budgeted:
        assert budgeted.streaming is not None
        ids, _, _ = together(budgeted, prompts, 6, [GREEDY] * len(prompts))
    assert ids == want


def test_a_long_prompt_does_not_stall_the_others():
    """A sequence decoding when a two-chunk prompt arrives gets a token at each of the prompt's steps."""
    model = moestream.load()
    short = Sequence([1, 2, 3], 10, GREEDY, model.new_state(), frozenset())
    step(model, [short], PREFILL_CHUNK, PREFILL_CHUNK)
    prompt = prompts_for(model.vocab_size, (2 * PREFILL_CHUNK + 1,))[0]
    long = Sequence(prompt, 4, GREEDY, model.new_state(), frozenset())
    for expect_fed in (PREFILL_CHUNK, 2 * PREFILL_CHUNK, 2 * PREFILL_CHUNK + 1):
        before = len(short.generated)
        step(model, [short, long], PREFILL_CHUNK, PREFILL_CHUNK)
        assert long.fed == expect_fed and len(short.generated) == before + 1


def test_logprobs_are_log_softmax_of_the_logits():
    model = moestream.load()
    prompt = model.tokenize("def f(x):")
    ids, logits = alone(model, prompt, 5)
    _, _, seqs = together(model, [prompt], 5, [GREEDY])
    rows = np.stack(logits)
    want = log_softmax(rows)
    scores = logprobs_of(rows, ids, 3)
    for row, token, got in zip(want, ids, scores, strict=True):
        assert got.token == token and got.logprob == pytest.approx(row[token], abs=1e-9)
        assert [i for i, _ in got.top] == np.argsort(-row, kind="stable")[:3].tolist()
    assert np.allclose(np.exp(want).sum(axis=1), 1.0)
    assert seqs[0].token_logprobs is not None and seqs[0].token_logprobs.token == ids[-1]


def test_prompt_logprobs_score_each_next_token_and_zero_new_tokens_stops_after_the_prompt():
    model = moestream.load()
    prompt = model.tokenize("def fibonacci(n):\n    return")
    seq = Sequence(prompt, 0, GREEDY, model.new_state(), frozenset(), prompt_logprobs=2)
    while not seq.done:
        step(model, [seq], PREFILL_CHUNK, PREFILL_CHUNK)
    assert seq.generated == []
    every = log_softmax(model.logits(prompt))  # [T, V]: row t predicts token t + 1
    assert [s.token for s in seq.prompt_scores] == prompt
    assert seq.prompt_scores[0].logprob is None
    got = np.array([s.logprob for s in seq.prompt_scores[1:]])
    want = every[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.allclose(got, want, atol=1e-4)  # one pass over the prompt vs the same pass: the same within float


def test_planner_holds_state_for_every_sequence():
    one = moestream.load("demo", ram="200M", context=1024)
    eight = moestream.load("demo", ram="200M", context=1024, sequences=8)
    try:
        assert one.streaming is not None and eight.streaming is not None
        assert eight.streaming.plan.kv_bytes == 8 * one.streaming.plan.kv_bytes
        assert eight.streaming.plan.scratch_bytes > one.streaming.plan.scratch_bytes
    finally:
        one.close()
        eight.close()
    with pytest.raises(moestream.errors.InputError, match="sequences"):
        moestream.load("demo", ram="200M", sequences=0)


def test_generate_batch_equals_generate_one_by_one():
    model = moestream.load()
    prompts = ["def f(x):", "import os", "class A:", "# a comment", "x = [1, 2,"]
    samplings = [GREEDY, SamplingParams(temperature=0.8, seed=4)] * 2 + [GREEDY]
    got = model.generate_batch(prompts, 9, sampling=samplings, max_batch=3)
    want = [list(model.generate(p, 9, sampling=s)) for p, s in zip(prompts, samplings, strict=True)]
    assert got == want
    assert model.generate_batch(prompts[:2], 0) == [[], []]
    with pytest.raises(moestream.errors.InputError, match="sampling settings"):
        model.generate_batch(prompts, 4, sampling=samplings[:2])
