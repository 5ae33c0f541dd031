"""Seeded fuzzing of the tokenizer files and chat templates: mutated tiktoken.model, tokenization_*.py,
tokenizer_config.json (bytes and JSON values) and tokenizer.json, each loaded and then used to encode
and decode; and random templates built from snippets with loops, ranges and large values, rendered
under a short time limit. Every input must end in a value or in one of the project's own errors.
MOESTREAM_FUZZ_SCALE multiplies the budgets for longer runs."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

import fuzzing
from fuzzing import byte_mutations, dump_json, expect_only_own_errors, json_mutations
from moestream.chat import ChatTemplate
from moestream.default_model import default_model_path
from moestream.tokenizer import load_tokenizer
from test_tokenizer import _hf_tokenizer_dir

SCALE = fuzzing.SCALE
SAMPLE = "def f(x):\n    return x  # 中文 🙂 <|open|>user<|sep|>[EOS]<s></s>"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi <|open|>system<|sep|>"},
    {"role": "assistant", "content": "  hello  "},
]


@pytest.fixture(scope="module")
def demo_tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tk")
    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, d / name)
    return d


def _use(d: Path) -> None:
    """Loads the tokenizer of d and runs it over the sample, as the engine would."""
    tok = load_tokenizer(d)
    if tok is None:
        return
    for special in (True, False):
        ids = tok.encode(SAMPLE, special=special)
        tok.decode(ids)
    tok.encode_pieces([("<|open|>user<|sep|>", False), (SAMPLE, True)])
    s = tok.stream()
    for i in tok.encode(SAMPLE)[:8]:
        s.feed(i)


def _writer(d: Path, name: str):
    def load(data: bytes) -> None:
        (d / name).write_bytes(data)
        _use(d)

    return load


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"])
def test_mutated_tiktoken_files_give_only_own_errors(tmp_path, demo_tokenizer_dir, name):
    d = tmp_path / "tk"
    shutil.copytree(demo_tokenizer_dir, d)
    seed = (d / name).read_bytes()
    # each load builds a tiktoken encoder (tens of ms): budgets of a few seconds
    n = {"tiktoken.model": 300, "tokenization_kimi.py": 300, "tokenizer_config.json": 300}[name] * SCALE
    expect_only_own_errors(_writer(d, name), byte_mutations(seed, n, seed=len(name)))
    (d / name).write_bytes(seed)
    _use(d)  # the seed itself still loads


def test_json_mutated_tokenizer_config_gives_only_own_errors(tmp_path, demo_tokenizer_dir):
    d = tmp_path / "tk"
    shutil.copytree(demo_tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    # a handful of added tokens keep the mutations on the fields that matter
    cfg["added_tokens_decoder"] = dict(list(cfg["added_tokens_decoder"].items())[:8])
    load = _writer(d, "tokenizer_config.json")
    accepted = expect_only_own_errors(lambda doc: load(dump_json(doc)), json_mutations(cfg, 300 * SCALE, seed=7))
    assert accepted > 0


def test_mutated_tokenizer_json_gives_only_own_errors(tmp_path):
    d = _hf_tokenizer_dir(tmp_path, True)
    seed = (d / "tokenizer.json").read_bytes()
    expect_only_own_errors(_writer(d, "tokenizer.json"), byte_mutations(seed, 800 * SCALE, seed=3))
    doc = json.loads(seed)
    load = _writer(d, "tokenizer.json")
    expect_only_own_errors(lambda x: load(dump_json(x)), json_mutations(doc, 500 * SCALE, seed=4))


# ---- templates -----------------------------------------------------------------------------------

SNIPPETS = [
    "{{ bos_token }}",
    "<|open|>",
    "{% for m in messages %}",
    "{% endfor %}",
    "{% for i in range(N) %}",
    "{% for c in messages[0]['content'] %}",
    "{% if add_generation_prompt %}",
    "{% endif %}",
    "{% else %}",
    "{{ m['content'] }}",
    "{{ m.content | trim }}",
    "{{ m['role'] | capitalize }}",
    "{{ i }}",
    "{{ 'x' * N }}",
    "{{ N ** N }}",
    "{{ 'ab' ~ m }}",
    "{{ messages | tojson }}",
    "{{ messages | tojson(indent=N) }}",
    "{{ 'x' | center(N) }}",
    "{{ 'a\nb' | indent(N) }}",
    "{{ ('x' * 1000) | replace('x', 'yy') }}",
    "{{ ','.join(['a'] * N) }}",
    "{{ '%0Nd' % 1 }}",
    "{{ '{:>N}'.format(1) }}",
    "{% set ns = namespace(s='ab') %}",
    "{% set ns.s = ns.s ~ ns.s %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}",
    "{{ f(1) }}",
    "{{ raise_exception('no') }}",
    "{% break %}",
    "{{ messages[N] }}",
    "{{ undefined_name.attr }}",
    "{{ m.__class__ }}",
    "{{ range(N) | list | length }}",
    "{{ strftime_now('%Y') }}",
    "{{ lipsum(N) }}",
    "}}",
    "{%",
]
NUMBERS = ["0", "1", "7", "64", "1000", "100000", "10**9", "-1", "2**63"]


def random_templates(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        parts = [rng.choice(SNIPPETS) for _ in range(rng.randint(1, 8))]
        yield "".join(p.replace("N", rng.choice(NUMBERS)) for p in parts)


def test_random_templates_give_only_own_errors():
    from moestream.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    assert tok is not None

    def render(source: str) -> None:
        tpl = ChatTemplate(source, bos_token="[BOS]", time_limit=0.05)
        tpl.encode(MESSAGES, tok)

    accepted = expect_only_own_errors(render, random_templates(600 * SCALE, seed=11))
    assert accepted > 0
