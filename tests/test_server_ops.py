"""What `serve` offers whoever runs it (server_ops.py): the API key (with the official `openai` client),
/metrics parsed with prometheus_client's own parser and moved by exactly the known requests, CORS headers
for the listed origins only, the access log, /tokenize and /detokenize against the model's tokenizer, and
the flags of a real `serve` process. Two servers live in this process at once, each with its own
registry: one streams its experts under a budget and wants a key, the other is resident and open."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import moestream
from moestream.errors import InputError
from moestream.server import Engine, make_server
from moestream.server_ops import API_KEY_ENV, OpsOptions, options_from_args
from test_cli import cli
from test_server import free_port, start_serve

NAME = "demo"
CTX = 256
KEY = "sk-test-0123456789"
ORIGIN = "https://app.example"


class Reply:
    def __init__(self, status: int, headers: Message, body: bytes):
        self.status_code, self.headers, self.text = status, headers, body.decode()

    def json(self) -> Any:
        return json.loads(self.text)


def request(method: str, url: str, headers: dict[str, str] | None = None, body: object = None) -> Reply:
    """A raw request (urllib): headers the openai client would not send, OPTIONS, and every status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Reply(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.headers, e.read())


def get(url: str, headers: dict[str, str] | None = None) -> Reply:
    return request("GET", url, headers)


def post(url: str, body: object, headers: dict[str, str] | None = None) -> Reply:
    return request("POST", url, headers, body)


@contextlib.contextmanager
def serving(ram: str | None, ops: OpsOptions) -> Iterator[tuple[str, Engine]]:
    """The demo model served in this process on a free port until the block ends."""
    model = moestream.load("demo", ram=ram, context=CTX, threads=1)
    engine = Engine(model, NAME, ctx=CTX, max_tokens=64)
    port = free_port()
    srv = make_server(engine, "127.0.0.1", port, ops=ops)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        if engine.join(10):
            model.close()


@pytest.fixture(scope="module")
def guarded():
    """Streams its experts (a budget below the model's size), wants KEY, allows ORIGIN."""
    with serving("44M", OpsOptions(api_key=KEY, cors_origins=(ORIGIN,))) as s:
        assert s[1].model.streaming is not None
        yield s


@pytest.fixture(scope="module")
def open_server():
    """Resident, no key, no CORS: the defaults."""
    with serving(None, OpsOptions()) as s:
        yield s


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, by name and sorted labels, parsed with prometheus_client's parser."""
    r = get(url + "/metrics", headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


# ---- the API key -----------------------------------------------------------------------------------


def test_the_api_key_is_needed_on_every_route_but_health(guarded):
    url = guarded[0]
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [NAME]
    assert good.completions.create(model=NAME, prompt="def f(x):", max_tokens=3, temperature=0).usage
    bad = openai.OpenAI(base_url=url + "/v1", api_key=KEY + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"

    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/nothing")]:  # fmt: skip
        for headers in ({}, auth("wrong"), {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
            r = request(method, url + path, headers, {} if method == "POST" else None)
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json() == {
                "error": {
                    "message": "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
    assert get(url + "/health").json()["status"] == "ok"  # probes need no key
    assert get(url + "/metrics", {"Authorization": f"bearer {KEY}"}).status_code == 200


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert options_from_args(None, None, "warning") == OpsOptions()
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert options_from_args(None, None, "warning").api_key == "from-env"
    assert options_from_args("from-flag", None, "warning").api_key == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")  # set but empty: no key, as if unset
    assert options_from_args(None, None, "info").api_key is None
    with pytest.raises(InputError, match="--api-key is empty"):
        options_from_args(" ", None, "warning")
    assert options_from_args(None, [ORIGIN, "http://localhost:3000", "*"], "debug").cors_origins == (
        ORIGIN,
        "http://localhost:3000",
        "*",
    )
    for origin in ("app.example", "https://app.example/", "https://app.example/path", "ftp://x"):
        with pytest.raises(InputError, match="is not an origin"):
            options_from_args(None, [origin], "warning")


# ---- /metrics --------------------------------------------------------------------------------------


def test_metrics_move_by_exactly_the_requests_served(guarded):
    url, engine = guarded
    before = scrape(url, auth())
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    one = c.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "def f(x):"}],
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    two = chunks[-1].usage
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=NAME, prompt="x", max_tokens=10_000)
    assert get(url + "/v1/nothing/here", headers=auth()).status_code == 404
    assert post(url + "/v1/completions", {"model": NAME, "prompt": "x"}).status_code == 401  # no key
    after = scrape(url, auth())

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("moestream_requests_total", endpoint="/v1/completions", status="200") == 1
    assert moved("moestream_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert moved("moestream_requests_total", endpoint="/v1/completions", status="400") == 1
    assert moved("moestream_requests_total", endpoint="unmatched", status="404") == 1  # no label per raw path
    assert moved("moestream_requests_total", endpoint="/v1/completions", status="401") == 1
    assert moved("moestream_requests_total", endpoint="/metrics", status="200") == 1  # the first scrape
    assert moved("moestream_request_duration_seconds_count", endpoint="/v1/completions") == 3
    assert moved("moestream_jobs_total") == 2  # the refused request never became a job
    assert moved("moestream_prompt_tokens_total") == one.usage.prompt_tokens + two.prompt_tokens
    assert moved("moestream_generated_tokens_total") == one.usage.completion_tokens + two.completion_tokens
    assert moved("moestream_prefill_seconds_total") > 0 and moved("moestream_decode_seconds_total") > 0
    # every token after a job's first came from a decoding pass: one each, plus the drafts it accepted
    passes, accepted = moved("moestream_decode_passes_total"), moved("moestream_draft_tokens_accepted_total")
    assert passes > 0 and 0 <= accepted <= moved("moestream_draft_tokens_total")
    assert passes + accepted == moved("moestream_generated_tokens_total") - 2
    assert after[("moestream_decode_tokens_per_second", ())] > 0
    assert after[("moestream_queue_depth", ())] == 0 and after[("moestream_batch_size", ())] == 0
    assert after[("moestream_requests_in_flight", ())] == 1  # the scrape itself
    # the expert cache, as the model's own streaming stats count it
    st = engine.model.streaming.stats()
    requests = after[("moestream_expert_cache_requests_total", ())]
    hits = after[("moestream_expert_cache_hits_total", ())]
    assert moved("moestream_expert_cache_requests_total") > 0 and 0 <= hits <= requests <= st["expert_requests"]
    assert after[("moestream_expert_cache_hit_rate", ())] == pytest.approx(hits / requests)
    assert moved("moestream_read_bytes_total") > 0 and after[("moestream_read_bytes_total", ())] <= st["bytes_read"]
    assert after[("process_resident_memory_bytes", ())] > 10e6


def test_each_server_has_its_own_registry(guarded, open_server):
    url = open_server[0]
    before = scrape(url)
    get(guarded[0] + "/v1/models", headers=auth())  # the other server
    after = scrape(url)
    key = ("moestream_requests_total", (("endpoint", "/v1/models"), ("status", "200")))
    assert after.get(key, 0) == before.get(key, 0)
    assert not any(name.startswith("moestream_expert_cache") for name, _ in after)  # resident: no cache
    assert after[("moestream_batch_size", ())] == 0


# ---- CORS ------------------------------------------------------------------------------------------


def test_cors_headers_only_for_the_listed_origins(guarded, open_server):
    url = guarded[0]
    r = get(url + "/v1/models", {**auth(), "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = get(url + "/v1/models", {**auth(), "Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # a refusal carries the header too, so the page can read why
    r = get(url + "/v1/models", {"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    # a preflight carries no key, and is answered for the listed origin only
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = request("OPTIONS", url + "/v1/chat/completions", {**ask, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = request("OPTIONS", url + "/v1/chat/completions", {**ask, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # none by default
    r = get(open_server[0] + "/v1/models", {"Origin": ORIGIN})
    assert r.status_code == 200 and not any(h.lower().startswith("access-control-") for h in r.headers)
    r = request("OPTIONS", open_server[0] + "/v1/chat/completions", {**ask, "Origin": ORIGIN})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


# ---- the access log --------------------------------------------------------------------------------


def test_one_access_log_line_per_request_at_info(open_server, caplog):
    url = open_server[0]
    with caplog.at_level(logging.INFO, logger="moestream.access"):
        get(url + "/v1/models?x=1")
        post(url + "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 0})
    lines = [r.getMessage() for r in caplog.records if r.name == "moestream.access"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("127.0.0.1:") and ' "GET /v1/models?x=1 HTTP/1.1" 200 ' in lines[0]
    assert ' "POST /v1/completions HTTP/1.1" 400 ' in lines[1] and lines[1].endswith("s")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moestream.access"):
        get(url + "/v1/models")
    assert not [r for r in caplog.records if r.name == "moestream.access"]


# ---- /tokenize, /detokenize ------------------------------------------------------------------------


def test_tokenize_and_detokenize_are_the_models_own(open_server):
    url, engine = open_server
    model = engine.model
    for text in ("def add(a, b):\n    return a + b\n", "héllo ✓ 世界 🙂", ""):
        r = post(url + "/tokenize", {"prompt": text})
        assert r.status_code == 200
        want = model.tokenize(text)
        assert r.json() == {"tokens": want, "count": len(want), "max_model_len": CTX}
        bare = post(url + "/tokenize", {"prompt": text, "add_special_tokens": False, "model": NAME})
        assert bare.json()["tokens"] == model.tokenize(text, add_bos=False)
        back = post(url + "/detokenize", {"tokens": bare.json()["tokens"], "model": NAME})
        assert back.status_code == 200 and back.json() == {"prompt": text}
    assert model.tokenize("x")[0] != model.tokenize("x", add_bos=False)[0]  # the flag made a difference above


def test_bad_tokenize_and_detokenize_requests_are_4xx(open_server):
    url, engine = open_server
    vocab = engine.model.vocab_size
    for tokens in ([1, vocab], [-1]):
        r = post(url + "/detokenize", {"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        assert "outside the vocabulary" in r.json()["error"]["message"]
    for body in ({"tokens": ["a"]}, {"tokens": [1.5]}, {"tokens": [True]}, {}, {"tokens": "1 2"}):
        r = post(url + "/detokenize", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    for body in ({}, {"prompt": 3}, {"prompt": "\ud800"}):
        r = post(url + "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    r = post(url + "/tokenize", {"prompt": "x", "messages": []})  # vLLM's chat form: not served, so a 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(url + "/tokenize", {"prompt": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post(url + "/detokenize", {"tokens": []}).json() == {"prompt": ""}


# ---- the serve command's flags -----------------------------------------------------------------------


def test_serve_flags_reach_a_real_server():
    """--api-key, --cors-origin and --log-level on a `serve` process; the port it prints and the one-line
    refusal of a taken port are test_server.py's test_serve_command_starts_on_a_free_port_and_answers."""
    proc, url = start_serve("--api-key", KEY, "--cors-origin", ORIGIN, "--log-level", "info")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert c.completions.create(model="m", prompt="def f():", max_tokens=2, temperature=0).usage
        assert get(url + "/v1/models").status_code == 401
        r = get(url + "/v1/models", {**auth(), "Origin": ORIGIN})
        assert r.headers["access-control-allow-origin"] == ORIGIN
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    access = [line for line in err.splitlines() if " moestream.access: " in line]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in access), err
    assert any('"GET /v1/models HTTP/1.1" 401' in line for line in access), err


def test_bad_serve_flags_are_one_line_before_the_model_loads():
    for args, message in [
        (("--api-key", ""), "--api-key is empty"),
        (("--cors-origin", "app.example"), "--cors-origin 'app.example' is not an origin"),
    ]:
        p = cli("serve", "--port", "0", *args)
        assert p.returncode == 2 and p.stdout == "", p.stderr
        assert p.stderr.startswith(f"moestream: error: {message}") and p.stderr.count("\n") == 1, p.stderr
    p = cli("serve", "--log-level", "loud")
    assert p.returncode == 2 and "--log-level" in p.stderr
