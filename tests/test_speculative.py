"""Speculative decoding (speculative.py): drafts verified in one pass give, bit for bit, plain decoding's
logits and greedy tokens on every architecture, resident and within a budget, batched, through early
stops, state files and the server; rejected drafts leave the state as if never fed; sampled tokens keep
exactly the target distribution (the rejection rule, checked statistically with a fixed seed)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import numpy as np
import openai
import pytest

import moestream
from moestream.batch import Sequence, step
from moestream.errors import InputError
from moestream.generate import PREFILL_CHUNK
from moestream.sampling import GREEDY, Sampler, SamplingParams
from moestream.server import Engine, make_server
from moestream.speculative import AUTO, OFF, DraftLength, PromptLookup, Speculation, choose
from test_cli import cli
from test_server import free_port


def repeating_prompt(vocab: int, seed: int = 3) -> list[int]:
    """A random stretch said three times: the lookup finds matches from the second one on."""
    part = np.random.default_rng(seed).integers(0, vocab, 9).tolist()
    return part * 3 + part[:4]


def run(model, prompt, n, speculate, sampling=GREEDY):
    logits: list[np.ndarray] = []
    model.speculation_stats = type(model.speculation_stats)()
    ids = list(model.generate(prompt, n, sampling=sampling, stop_at_eos=False, logits_out=logits, speculate=speculate))
    return ids, logits, model.speculation_stats


def assert_same(a, b):
    ids_a, logits_a, _ = a
    ids_b, logits_b, _ = b
    assert ids_a == ids_b
    assert [x.tobytes() for x in logits_a] == [x.tobytes() for x in logits_b]


# ---- the lookup and the draft length ----------------------------------------------------------------


def test_prompt_lookup_copies_what_followed_the_latest_longest_match():
    look = PromptLookup([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert look.propose(None, 3) == [9, 2, 6]  # "6 7" last came before 9 (not before 8)
    look.extend([9])
    assert look.propose(None, 2) == [2, 6]  # "6 7 9" is the longest suffix seen before
    assert look.propose(None, 0) == []
    assert PromptLookup([1, 2, 3]).propose(None, 4) == []  # 3 never came before
    assert PromptLookup([4, 1, 4], ngram_min=2).propose(None, 2) == []  # a single matching token is not enough
    assert PromptLookup([4, 1, 4], ngram_min=1).propose(None, 2) == [1, 4]  # ...unless allowed: up to the end


def test_speculation_settings_parse_and_refuse_bad_values():
    assert Speculation.parse(None) == AUTO and Speculation.parse("auto") == AUTO
    assert Speculation.parse("off") == OFF and Speculation.parse(0) == Speculation(0, False)
    assert Speculation.parse("5") == Speculation(5, False) and str(Speculation.parse(5)) == "5"
    for bad in ("fast", "-1", "65", 1.5, True):
        with pytest.raises(InputError, match="speculate"):
            Speculation.parse(bad)


def test_auto_draft_length_follows_acceptance_and_comes_back():
    d = DraftLength(AUTO)
    start = d.next()
    assert 0 < start <= AUTO.max_draft
    for _ in range(20):
        d.update(6, 6)
    assert d.next() == AUTO.max_draft  # everything accepted: the longest drafts
    for _ in range(30):
        d.update(max(d.next(), 1), 0)
    assert d.next() == 0  # nothing accepted: no drafting
    quiet = 0
    while d.next() == 0:  # tokens decoded without drafts let the estimate drift back to the prior
        d.update(0, 0)
        quiet += 1
    assert 0 < quiet < 200 and d.next() > 0
    fixed = DraftLength(Speculation(3, False))
    fixed.update(3, 0)
    assert fixed.next() == 3


# ---- exactness -----------------------------------------------------------------------------------


def test_every_architecture_speculative_equals_plain(case):
    model = moestream.load(case.path, threads=2)
    prompt = repeating_prompt(model.vocab_size)
    plain = run(model, prompt, 24, "off")
    for spec in ("4", "auto", "1"):
        got = run(model, prompt, 24, spec)
        assert_same(got, plain)
        if spec != "auto":
            assert got[2].proposed > 0  # drafts were verified, not skipped
    assert plain[2].proposed == 0


def test_demo_drafts_are_accepted_and_a_pass_gives_several_tokens():
    model = moestream.load()
    text = "    the same as the same as the same as the same"
    plain = run(model, text, 48, "off")
    got = run(model, text, 48, "8")
    assert_same(got, plain)
    st = got[2]
    assert st.accepted > 0 and st.tokens > st.passes  # some passes gave more than one token
    assert st.passes + 1 < len(got[0])


def test_speculative_within_a_budget_equals_resident_plain():
    resident = moestream.load()
    prompt = repeating_prompt(resident.vocab_size)
    want = run(resident, prompt, 20, "off")
    with moestream.load("demo", ram="40M", context=256) as budgeted:
        assert budgeted.streaming is not None
        got = run(budgeted, prompt, 20, "6")
    assert_same(got, want)
    assert got[2].proposed > 0


def test_batched_sequences_speculate_each_as_alone():
    model = moestream.load()
    prompts = [repeating_prompt(model.vocab_size, s) for s in range(4)]
    samplings = [GREEDY, SamplingParams(temperature=0.8, seed=4), GREEDY, SamplingParams(temperature=1.1, seed=9)]
    spec = Speculation(4, False)
    seqs = [
        Sequence(p, 12, s, model.new_state(), frozenset(), logits_out=[], speculation=spec)
        for p, s in zip(prompts, samplings, strict=True)
    ]
    while not all(s.done for s in seqs):
        step(model, seqs, PREFILL_CHUNK, PREFILL_CHUNK)
    for p, s, seq in zip(prompts, samplings, seqs, strict=True):
        want = run(model, p, 12, spec, s)
        assert seq.generated == want[0]
        assert [x.tobytes() for x in seq.logits_out or []] == [x.tobytes() for x in want[1]]
        if s.greedy:
            assert seq.generated == run(model, p, 12, "off", s)[0]
    assert sum(s.spec_stats.proposed for s in seqs) > 0


def cache_arrays(state) -> list[bytes]:
    """Every cache's contents up to its length (the rest is scratch that the next append overwrites)."""
    out = []
    for c in state.caches:
        n = c.length
        if hasattr(c, "k"):
            out += [c.k[:, :n].tobytes(), c.v[:, :n].tobytes()]
        elif hasattr(c, "kr"):
            out += [c.c[:n].tobytes(), c.kr[:n].tobytes()]
        else:
            out += [c.conv.tobytes(), c.S.tobytes()]
        out.append(n)
    return out


def test_rewind_leaves_the_state_as_if_the_drafts_were_never_fed(case):
    assert_rewind_exact(moestream.load(case.path))


def test_rewind_of_kimi_k3_latent_and_kda_caches_is_exact():
    assert_rewind_exact(moestream.load())


def assert_rewind_exact(model):
    prompt = repeating_prompt(model.vocab_size)
    fed = [3, 1, 4, 1, 5]
    for keep in (1, 3, 5):
        want = model.new_state()
        model.decoder.forward(prompt, want, model.ctx)
        for t in fed[:keep]:
            model.decoder.forward([t], want, model.ctx)
        got = model.new_state()
        model.decoder.forward(prompt, got, model.ctx)
        model.decoder.forward_batch([fed], [got], model.ctx, [True], [True])
        got.rewind(len(prompt) + keep, model.ctx)
        assert got.ids == want.ids and cache_arrays(got) == cache_arrays(want)
        # and decoding goes on from it with the same bits
        a = model.decoder.forward([7], got, model.ctx)
        b = model.decoder.forward([7], want, model.ctx)
        assert a.tobytes() == b.tobytes()


def test_stopping_early_keeps_every_token_but_the_last_in_the_state():
    model = moestream.load()
    text = "    the same as the same as the same as the same"
    whole = list(model.generate(text, 30, speculate="8", stop_at_eos=False))
    for cut in (3, 11):
        st = model.new_state()
        gen = model.generate(text, 30, speculate="8", stop_at_eos=False, state=st)
        first = list(itertools.islice(gen, cut))
        gen.close()
        assert first == whole[:cut]
        assert st.ids == model.tokenize(text) + first[:-1]
        rest = list(model.generate([first[-1]], 30 - cut, speculate="8", stop_at_eos=False, state=st))
        assert first + rest == whole


# ---- sampling: the rejection rule keeps the target distribution ------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_k=4, seed=12),
        SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.3, seed=13),
    ],
)
def test_rejection_rule_draws_from_the_target_distribution(params):
    logits = np.array([2.0, 1.5, 1.4, 0.2, -0.5, 0.9, -3.0], np.float32)
    history = [1, 5]
    p = Sampler(params).distribution(logits, history)
    n = 30_000
    for draft in (0, 3, 6):  # likely, unlikely and (with top_k/top_p) impossible drafts
        sampler = Sampler(params)
        counts = np.bincount([choose(sampler, logits, history, draft) for _ in range(n)], minlength=p.shape[0])
        assert counts[p == 0].sum() == 0  # never a token the target cannot give
        live = p > 0
        expected = p[live] * n
        chi2 = float((((counts[live] - expected) ** 2) / expected).sum())
        # 6 degrees of freedom at most: chi2 > 40 has probability below 1e-6 under the target distribution
        assert chi2 < 40, (draft, counts, expected)


def test_seeded_speculative_sampling_is_reproducible():
    model = moestream.load()
    s = SamplingParams(temperature=0.9, seed=21)
    text = "    the same as the same as the same"
    a = run(model, text, 24, "6", s)
    b = run(model, text, 24, "6", s)
    assert_same(a, b)


# ---- the command line, state files and the server ----------------------------------------------------


def test_cli_speculate_gives_the_same_ids_and_reports_it(tmp_path):
    args = ["run", "--prompt", "    the same as the same as the same", "--gen", "24", "--json", "--ignore-eos"]
    off = cli(*args, "--speculate", "off")
    on = cli(*args, "--speculate", "6", "--report", str(tmp_path / "r.json"))
    assert off.returncode == 0 and on.returncode == 0, on.stderr
    assert json.loads(on.stdout)["generated_ids"] == json.loads(off.stdout)["generated_ids"]
    rep = json.loads((tmp_path / "r.json").read_text())["speculation"]
    assert rep["mode"] == "6" and rep["drafts_proposed"] > 0 and rep["tokens_per_pass"] >= 1
    bad = cli(*args, "--speculate", "many")
    assert bad.returncode == 2 and "speculate" in bad.stderr and "Traceback" not in bad.stderr


def test_state_file_continues_a_speculative_run_exactly(tmp_path):
    base = ["run", "--gen", "12", "--json", "--ignore-eos", "--speculate", "6"]
    whole = cli(*base[:2], "24", *base[3:], "--prompt", "    the same as the same as the same")
    first = cli(*base, "--prompt", "    the same as the same as the same", "--save-state", str(tmp_path / "s"))
    second = cli(*base, "--load-state", str(tmp_path / "s"))
    assert whole.returncode == first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    ids = json.loads(first.stdout)["generated_ids"] + json.loads(second.stdout)["generated_ids"]
    assert ids == json.loads(whole.stdout)["generated_ids"]


@pytest.mark.parametrize("speculate", ["off", "6"])
def test_server_streams_the_same_text_with_speculation(speculate):
    model = moestream.load(speculate=speculate)
    engine = Engine(model, "demo", ctx=512, max_tokens=64, max_batch=4)
    port = free_port()
    srv = make_server(engine, "127.0.0.1", port)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        prompt = "    the same as the same as the same"
        want = "".join(model.complete(prompt, 30, speculate="off").run().text)
        chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=30, stream=True, temperature=0))
        assert "".join(c.choices[0].text for c in chunks) == want
        cut = client.completions.create(model="demo", prompt=prompt, max_tokens=30, stop=[" as the"], temperature=0)
        stop_at = want.find(" as the")
        assert cut.choices[0].text == (want[:stop_at] if stop_at >= 0 else want)
        tokens_to_stop = model.complete(prompt, 30, speculate="off", sampling=SamplingParams(stop=(" as the",))).run()
        assert cut.usage.completion_tokens == len(tokens_to_stop.tokens)
    finally:
        srv.should_exit = True
        th.join(timeout=10)


# ---- a draft model ------------------------------------------------------------------------------------


def test_a_draft_model_proposes_and_the_output_stays_exact():
    model = moestream.load()
    text = "def dedent(text):\n    "
    plain = run(model, text, 40, "off")
    model.use_draft(moestream.load())  # the model as its own draft: its drafts are (nearly) always right
    got = run(model, text, 40, "4")
    assert_same(got, plain)
    assert got[2].accepted >= 0.9 * got[2].proposed > 0 and got[2].tokens >= 3 * got[2].passes
    # sampled: the same seed gives the same tokens, batched or alone
    s = SamplingParams(temperature=0.8, seed=5)
    a = run(model, text, 20, "4", s)
    spec = Speculation(4, False, model.speculation.draft)
    seq = Sequence(model.tokenize(text), 20, s, model.new_state(), frozenset(), speculation=spec)
    other = Sequence([5, 6, 7], 20, GREEDY, model.new_state(), frozenset(), speculation=spec)
    while not seq.done:
        step(model, [seq, other], PREFILL_CHUNK, PREFILL_CHUNK)
    assert seq.generated == a[0]


def test_a_draft_model_with_another_tokenizer_is_refused(small_case):
    model = moestream.load()
    with pytest.raises(InputError, match="draft"):
        model.use_draft(small_case.path)
    r = cli("run", "--prompt", "x", "--gen", "2", "--draft", str(small_case.path))
    assert r.returncode == 2 and "--draft" in r.stderr and "Traceback" not in r.stderr


def test_chat_on_kept_state_speculates_to_the_same_replies():
    from moestream.chat import ChatSession

    replies = {}
    for spec in ("off", "8"):
        model = moestream.load(speculate=spec)
        chat = ChatSession(model, system="You write Python.", max_new_tokens=24)
        replies[spec] = []
        for user in ("def add(a, b):", "The same as the same as the same", "Again."):
            stream, _ = chat.send(user)
            replies[spec].append(("".join(stream), stream.tokens))
            chat.finish()
        replies[spec].append(list(chat.state.ids))
        if spec == "8":
            assert model.speculation_stats.proposed > 0
    assert replies["8"] == replies["off"]
