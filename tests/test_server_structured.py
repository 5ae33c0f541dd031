"""Structured output through the server with the official `openai` client: json_schema answers validate
with `jsonschema` for several schemas (chat and completions, streaming or not, greedy and seeded, several
at once in one batch), json_object answers parse, and a bad response_format is a 400 naming it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from test_server_batching import NAME, served  # noqa: F401 (the module's server fixture)
from test_structured import SCHEMAS


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def answer(client: openai.OpenAI, i: int, name: str) -> tuple[str, str | None]:
    sampling = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
    if i % 3 == 0:
        r = client.completions.create(
            model=NAME,
            prompt="config = ",
            max_tokens=64,
            extra_body={"response_format": schema_format(name)},  # vLLM's extension of completions
            **sampling,
        )
        return r.choices[0].text, r.choices[0].finish_reason
    messages = [{"role": "user", "content": f"Give me {name} as JSON."}]
    if i % 3 == 1:
        chunks = list(
            client.chat.completions.create(
                model=NAME,
                messages=messages,
                max_tokens=64,
                stream=True,
                response_format=schema_format(name),  # type: ignore[arg-type]
                **sampling,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=64, response_format=schema_format(name), **sampling
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_json_schema_answers_validate_in_one_batch(served):  # noqa: F811
    _, client, _ = served
    jobs = [(i, name) for i, name in enumerate(sorted(SCHEMAS) * 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: answer(client, *job), jobs))
    for (_, name), (text, finish) in zip(jobs, got, strict=True):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    alone = [answer(client, i, name) for i, name in jobs[:3]]
    assert alone == got[:3]  # batched or alone, the same constrained answers


def test_json_object_answers_parse(served):  # noqa: F811
    _, client, _ = served
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "a JSON object please"}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    text = (
        client.completions.create(
            model=NAME,
            prompt="x = ",
            max_tokens=40,
            temperature=0,
            extra_body={"response_format": {"type": "regex", "regex": "[0-9]{3}"}},
        )
        .choices[0]
        .text
    )
    assert len(text) == 3 and text.isdigit()


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
        {"type": "json_schema"},
        {"type": "regex", "regex": "("},
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(served, bad):  # noqa: F811
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body={"response_format": bad}
        )
    assert e.value.param == "response_format"
