"""The OpenAI-compatible server, started on loopback inside the test and spoken to with the official
`openai` client: the same tokens as `moestream run` (completions and chat, streaming and not), usage
counts, 8 concurrent clients, malformed requests and 4xx errors in OpenAI's shape."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvicorn

import moestream
from moestream.server import Engine, create_app
from test_cli import ENV, cli

NAME = "demo"
CTX = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    model = moestream.load()
    engine = Engine(model, NAME, ctx=CTX, max_tokens=64)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield url, engine
    srv.should_exit = True
    th.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


class Response:
    def __init__(self, status: int, body: bytes):
        self.status_code, self.body = status, body

    def json(self) -> dict:
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 60) -> Response:
    """A raw request (urllib), for what the openai client would refuse to send."""
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read())


def post(url: str, obj: object) -> Response:
    return http("POST", url, json.dumps(obj).encode())


def run_json(*args: str) -> dict:
    p = cli("run", "--json", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert http("GET", server[0] + "/health").json()["status"] == "ok"


def test_completions_match_run_streaming_or_not(client):
    ref = run_json("--prompt", "def fibonacci(n):", "--gen", "20", "--ignore-eos")
    r = client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=20, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref["prompt_ids"]) and r.usage.completion_tokens == 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + 20
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="def fibonacci(n):",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == 20
    ids = client.completions.create(model=NAME, prompt=ref["prompt_ids"], max_tokens=20, temperature=0)
    assert ids.choices[0].text == ref["text"]


def test_chat_matches_run_on_the_rendered_conversation(server, client):
    engine = server[1]
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    ids = engine.model.tokenize(engine.template.render(messages, True), add_bos=False)
    ref = run_json("--ids", ",".join(map(str, ids)), "--gen", "16")
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref["generated_ids"])
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_sampling_options_reach_the_sampler(client):
    kw = {"model": NAME, "prompt": "import os\n", "max_tokens": 24, "temperature": 1.0, "seed": 3}
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    ref = run_json("--prompt", "import os\n", "--gen", "24", "--temperature", "1.0", "--seed", "3")
    assert a == ref["text"]
    greedy = client.completions.create(model=NAME, prompt="import os\n", max_tokens=24, temperature=0)
    stop = greedy.choices[0].text[6:9]
    cut = client.completions.create(model=NAME, prompt="import os\n", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(stop)]


def test_eight_concurrent_clients_get_their_own_answers(client):
    prompts = [f"def f{i}(x):" for i in range(8)]
    expected = {
        p: client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in prompts
    }

    def ask(i: int) -> tuple[str, str]:
        p = prompts[i]
        if i % 2:
            s = client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0, stream=True)
            return p, "".join(c.choices[0].text for c in s if c.choices)
        return p, client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert all(text == expected[p] for p, text in got)


def test_bad_requests_get_4xx_in_openais_shape(server, client):
    url = server[0]
    r = http("POST", url + "/v1/completions", b'{"model": "demo", "prompt": ')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"] and r.json()["error"]["param"] is None
    r = post(url + "/v1/chat/completions", {"model": NAME})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = post(url + "/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x " * CTX, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=65)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=NAME, prompt=[1, 2, 10**6], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, n=2)
    assert http("GET", url + "/v1/nothing").status_code == 404
    # and the server still answers
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens


def test_serve_command_starts_and_answers(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moestream", "serve", "--port", str(port), "--model-name", "m"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        for _ in range(300):
            try:
                if http("GET", f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except OSError:
                time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert c.models.list().data[0].id == "m"
        assert c.completions.create(model="m", prompt="def f():", max_tokens=4, temperature=0).choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
