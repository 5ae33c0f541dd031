"""The sampler: each option shapes the distribution as its definition says (checked against a numpy
reference written here), seeded draws are reproducible and follow the distribution, stop strings cut
the text exactly; and through the engine: seeded runs repeat, --stop ends the text before the string."""

from __future__ import annotations

import json

import numpy as np
import pytest

import moestream
from moestream.errors import InputError
from moestream.sampling import Sampler, SamplingParams, StopMatcher
from test_cli import assert_user_error, cli

V = 50
LOGITS = np.random.default_rng(1).standard_normal(V).astype(np.float32) * 3


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def dist(logits=LOGITS, history=(), **kw) -> np.ndarray:
    return Sampler(SamplingParams(**kw)).distribution(logits, history)


def test_greedy_is_the_argmax_and_default():
    assert SamplingParams().greedy
    d = dist()
    assert d[int(np.argmax(LOGITS))] == 1.0 and d.sum() == 1.0
    assert Sampler().sample(LOGITS) == int(np.argmax(LOGITS))


def test_temperature_is_softmax_of_scaled_logits():
    for t in (0.3, 1.0, 2.5):
        np.testing.assert_allclose(dist(temperature=t), softmax(LOGITS.astype(np.float64) / t), rtol=1e-12)

    def entropy(p):
        return -(p[p > 0] * np.log(p[p > 0])).sum()

    assert entropy(dist(temperature=0.3)) < entropy(dist(temperature=1.0)) < entropy(dist(temperature=2.5))


def test_top_k_keeps_the_k_largest():
    d = dist(temperature=1.0, top_k=5)
    kept = np.flatnonzero(d)
    assert set(kept) == set(np.argsort(-LOGITS)[:5])
    np.testing.assert_allclose(d[kept], softmax(LOGITS[kept].astype(np.float64)), rtol=1e-12)


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = softmax(LOGITS.astype(np.float64))
    order = np.argsort(-full)
    for p in (0.3, 0.75, 0.95):
        d = dist(temperature=1.0, top_p=p)
        kept = np.flatnonzero(d)
        n = len(kept)
        assert set(kept) == set(order[:n])
        assert full[order[:n]].sum() >= p - 1e-12 and full[order[: n - 1]].sum() < p
        np.testing.assert_allclose(d[kept], full[kept] / full[kept].sum(), rtol=1e-12)


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    full = softmax(LOGITS.astype(np.float64))
    d = dist(temperature=1.0, min_p=0.2)
    kept = np.flatnonzero(d)
    assert set(kept) == set(np.flatnonzero(full >= 0.2 * full.max()))


def test_penalties_follow_their_definitions():
    history = [3, 3, 7, 11, 3]
    z = LOGITS.astype(np.float64).copy()
    z[3], z[7] = 2.0, -1.5
    s = Sampler(SamplingParams(repetition_penalty=1.5))
    out = s.penalized(z, history)
    assert out[3] == 2.0 / 1.5 and out[7] == -1.5 * 1.5 and out[11] == (z[11] / 1.5 if z[11] > 0 else z[11] * 1.5)
    untouched = [i for i in range(V) if i not in history]
    assert (out[untouched] == z[untouched]).all()
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    out = s.penalized(z, history)
    assert out[3] == pytest.approx(z[3] - 0.5 - 0.75) and out[7] == pytest.approx(z[7] - 0.5 - 0.25)
    assert (out[untouched] == z[untouched]).all()
    last2 = Sampler(SamplingParams(presence_penalty=1.0, penalty_last_n=2)).penalized(z, history)
    assert last2[3] == z[3] - 1 and last2[11] == z[11] - 1 and last2[7] == z[7]
    # a penalty can change the greedy choice
    top = int(np.argmax(z))
    assert Sampler(SamplingParams(presence_penalty=2.0)).sample(z, [top]) != top or z.max() - np.sort(z)[-2] > 2


def test_seeded_draws_repeat_and_follow_the_distribution():
    p = SamplingParams(temperature=0.9, top_k=20, seed=7)
    a = [Sampler(p).sample(LOGITS) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1.sample(LOGITS) for _ in range(200)]
    seq2 = [s2.sample(LOGITS) for _ in range(200)]
    assert seq1 == seq2 and len(set(a)) == 1
    s3 = Sampler(p.with_seed(8))
    assert [s3.sample(LOGITS) for _ in range(200)] != seq1
    n = 40000
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([s.sample(LOGITS) for _ in range(n)], minlength=V) / n
    np.testing.assert_allclose(counts, dist(temperature=1.0), atol=0.01)


def test_bad_parameters_are_refused():
    for kw in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"min_p": 2},
        {"top_k": -1},
        {"repetition_penalty": 0},
        {"presence_penalty": 3},
        {"stop": ("",)},
    ):
        with pytest.raises(InputError):
            SamplingParams(**kw)


def test_stop_matcher_cuts_across_pieces_and_holds_back_prefixes():
    m = StopMatcher(["\n\n", "END"])
    out = [m.feed(x) for x in ["abc", "\n", "x", "E", "N", "D", "more"]]
    assert "".join(out) == "abc\nx" and m.stopped
    assert out[1] == "" and out[2] == "\nx"  # "\n" held until it could no longer start "\n\n"
    m = StopMatcher(["END"])
    assert m.feed("the EN") == "the " and m.flush() == "EN" and not m.stopped
    assert StopMatcher([]).feed("x") == "x"


@pytest.fixture(scope="module")
def demo():
    return moestream.load()


def test_seeded_generation_repeats_and_seeds_differ(demo):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    prompt = demo.tokenize("def parse(text):")
    a = list(demo.generate(prompt, 24, sampling=p))
    b = list(demo.generate(prompt, 24, sampling=p))
    c = list(demo.generate(prompt, 24, sampling=p.with_seed(12)))
    assert a == b and a != c
    assert a != list(demo.generate(prompt, 24))  # not greedy


def test_run_sampling_flags_and_stop_strings():
    base = ["run", "--prompt", "import os\n", "--gen", "40", "--json", "--temperature", "0.9", "--seed", "5"]
    a, b = cli(*base), cli(*base)
    assert a.returncode == 0, a.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["generated_ids"] == jb["generated_ids"] and ja["text"]
    greedy = json.loads(cli("run", "--prompt", "import os\n", "--gen", "40", "--json").stdout)
    stop = greedy["text"][8:12]
    assert stop.strip(), greedy["text"]
    cut = json.loads(cli("run", "--prompt", "import os\n", "--gen", "40", "--json", "--stop", stop).stdout)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == greedy["text"][: greedy["text"].index(stop)]
    assert len(cut["generated_ids"]) < len(greedy["generated_ids"])
    assert_user_error(cli("run", "--prompt", "x", "--top-p", "0"), "--top-p")
