"""The server's continuous batching and logprobs, with the official `openai` client: 16 concurrent clients
(streaming or not, chat and completions, greedy and seeded) each get exactly what they get alone while
the engine runs them in shared steps; logprobs are log_softmax of `run --dump-logits` at the chosen
tokens; echo scores the prompt as one pass over it does."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

import moestream
import moestream.server as server_module
from moestream.batch import log_softmax
from moestream.server import Engine, make_server
from test_cli import cli
from test_server import free_port, http, start_serve

NAME = "demo"


@pytest.fixture(scope="module")
def served():
    model = moestream.load()
    engine = Engine(model, NAME, ctx=512, max_tokens=64, max_batch=16)
    port = free_port()
    srv = make_server(engine, "127.0.0.1", port)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
    yield engine, client, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(timeout=10)


def ask(client: openai.OpenAI, i: int) -> tuple[str, str | None, int]:
    """Request i of a mixed load: chat or completions, streaming or not, greedy or seeded; its text, its
    finish reason and its completion tokens."""
    kind, streaming, seeded = i % 2, (i // 2) % 2, (i // 4) % 2
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if seeded else {"temperature": 0}
    n = 10 + i % 7
    if kind == 0:
        prompt = f"def f{i}(x):" + " # note" * (i % 5)
        if streaming:
            chunks = list(
                client.completions.create(
                    model=NAME,
                    prompt=prompt,
                    max_tokens=n,
                    stream=True,
                    stream_options={"include_usage": True},
                    **sampling,
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            return text, finish, chunks[-1].usage.completion_tokens
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, **sampling)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    messages = [{"role": "user", "content": f"Write function number {i}." + " Please." * (i % 3)}]
    if streaming:
        chunks = list(
            client.chat.completions.create(
                model=NAME,
                messages=messages,
                max_tokens=n,
                stream=True,
                stream_options={"include_usage": True},
                **sampling,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return text, finish, chunks[-1].usage.completion_tokens
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=n, **sampling)
    return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage.completion_tokens


def test_sixteen_concurrent_clients_get_what_they_get_alone(served, monkeypatch):
    _, client, _ = served
    alone = [ask(client, i) for i in range(16)]  # one after another: each request alone in the engine
    sizes: list[int] = []
    real = server_module.step

    def counting(model, seqs, *args):
        took = real(model, seqs, *args)
        sizes.append(len(took))
        return took

    monkeypatch.setattr(server_module, "step", counting)
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: ask(client, i), range(16)))
    assert together == alone
    assert max(sizes) >= 8  # the requests really shared steps
    assert len(sizes) < sum(n for _, _, n in alone)  # fewer passes than tokens


def test_more_clients_than_the_batch_wait_their_turn(served, monkeypatch):
    engine, client, url = served
    monkeypatch.setattr(engine, "max_batch", 2)
    alone = [ask(client, i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda i: ask(client, i), range(4))) == alone
    assert http("GET", url + "/health").json()["running"] == 0


def test_completion_logprobs_are_log_softmax_of_the_dumped_logits(served, tmp_path):
    _, client, _ = served
    dump = tmp_path / "logits.npy"
    p = cli("run", "--json", "--prompt", "def fibonacci(n):", "--gen", "12", "--ignore-eos", "--dump-logits", str(dump))
    assert p.returncode == 0, p.stderr
    want = log_softmax(np.load(dump))  # [12, V]: the logits each generated token was chosen from
    r = client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    chosen = want[:n].argmax(axis=1)  # greedy: the chosen token is the most likely
    assert np.allclose(lp.token_logprobs, want[np.arange(n), chosen][: len(lp.token_logprobs)], atol=1e-6)
    assert "".join(lp.tokens) == r.choices[0].text
    for row, top, chosen_lp in zip(want, lp.top_logprobs, lp.token_logprobs, strict=False):
        assert len(top) == 3
        assert np.allclose(sorted(top.values(), reverse=True), np.sort(row)[::-1][:3], atol=1e-6)
        assert max(top.values()) == pytest.approx(chosen_lp)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = client.completions.create(
        model=NAME, prompt="def fibonacci(n):", max_tokens=12, temperature=0, logprobs=3, stream=True
    )
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_echo_scores_the_prompt(served):
    engine, client, _ = served
    prompt = "def fibonacci(n):\n    if n < 2:"
    ids = engine.model.tokenize(prompt)
    every = log_softmax(engine.model.logits(ids))  # row t scores token t + 1
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and lp.tokens == [engine.token_text(i) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:], every[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    more = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0)
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert more.choices[0].text == prompt + plain.choices[0].text
    assert len(more.choices[0].logprobs.tokens) == len(ids) + 4
    long = "x = [" + ", ".join(str(i) for i in range(90)) + "]"  # a prompt of two prefill chunks
    n = len(engine.model.tokenize(long))
    assert n > 256
    both = client.completions.create(model=NAME, prompt=long, max_tokens=2, echo=True, logprobs=0, temperature=0)
    rest = client.completions.create(model=NAME, prompt=long, max_tokens=2, temperature=0).choices[0].text
    assert both.choices[0].text == long + rest and len(both.choices[0].logprobs.tokens) == n + 2
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=0, temperature=0)


def test_chat_logprobs_with_top_alternatives(served):
    engine, client, _ = served
    messages = [{"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=4
    )
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    ids = engine.template.encode(messages, engine.model.tokenizer, add_generation_prompt=True)
    logits: list[np.ndarray] = []
    gen = list(engine.model.generate(ids, 10, logits_out=logits))
    want = log_softmax(np.stack(logits))
    for c, row, token in zip(content, want, gen, strict=False):
        assert c.logprob == pytest.approx(row[token], abs=1e-6)
        assert bytes(c.bytes) == engine.token_bytes(token)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(np.sort(row)[::-1][:4].tolist(), abs=1e-6)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, top_logprobs=2)


def test_max_batch_flag_reaches_the_engine_and_a_budget_plans_for_it():
    proc, url = start_serve("--max-batch", "3")
    try:
        assert http("GET", url + "/health").json()["max_batch"] == 3
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    with socket.socket() as taken:  # a port in use: a budget that fits gets as far as binding it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one = cli("serve", "--ram", "80M", "--ctx", "2048", "--max-batch", "1", "--port", port)
        many = cli("serve", "--ram", "80M", "--ctx", "2048", "--max-batch", "256", "--port", port)
    assert many.returncode == 2 and many.stderr.count("\n") == 1 and "KV/state" in many.stderr
    assert one.returncode == 2 and "cannot listen" in one.stderr


def test_echo_offsets_point_into_the_text_and_alternatives_hold_the_chosen_token(served):
    engine, client, _ = served
    prompt = "def f(x):\n    return x"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, echo=True, logprobs=0, temperature=0)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert lp.tokens[0] == engine.token_text(engine.model.tokenize(prompt)[0])  # the BOS, not in the text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert 0 <= offset <= len(text)
        if token in text and token != lp.tokens[0]:
            assert text[offset : offset + len(token)] == token
    assert lp.text_offset == sorted(lp.text_offset)
    for token, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top == {token: chosen}  # logprobs=0: the chosen token alone, as the completions API defines it


def test_a_prompt_of_ids_in_a_list_as_harnesses_send_it(served):
    engine, client, _ = served
    ids = engine.model.tokenize("import os")
    one = client.completions.create(model=NAME, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert one.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="batch of prompts"):
        client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=1)


class Refuses:
    """A constraint whose third token is refused (as llguidance refuses a token it cannot continue with)."""

    finished = False

    def __init__(self):
        self.n = 0

    def mask(self, logits):
        pass

    def accept(self, token):
        self.n += 1
        if self.n == 3:
            raise moestream.errors.InputError("structured output: this token does not continue the grammar")


def test_a_job_that_fails_ends_alone(served):
    engine, client, _ = served
    from moestream.server import ChatRequest, CompletionRequest, Finished

    want = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0).choices[0].text
    plain = engine.completion_job(CompletionRequest(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0))
    bad = engine.chat_job(ChatRequest(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=12))
    bad.constraint = Refuses()
    events: dict[str, list] = {"plain": [], "bad": []}
    done = threading.Event()

    def sink(name):
        def put(event):
            events[name].append(event)
            if len(events["plain"]) and not isinstance(events["plain"][-1], server_module.Piece):
                if events["bad"] and not isinstance(events["bad"][-1], server_module.Piece):
                    done.set()

        return put

    engine.submit(bad, sink("bad"))
    engine.submit(plain, sink("plain"))
    assert done.wait(60)
    assert isinstance(events["bad"][-1], server_module.Failed) and events["bad"][-1].error.status == 400
    assert isinstance(events["plain"][-1], Finished)
    assert "".join(e.text for e in events["plain"][:-1]) == want
