"""Structured output on the demo model: every answer parses (and validates against its schema with
`jsonschema`), generation stops exactly where the grammar ends, the end-of-text tokens are allowed exactly
when it may end, and bad response formats are one InputError."""

from __future__ import annotations

import json
import re
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

import moestream
from moestream.errors import InputError
from moestream.sampling import GREEDY, Sampler, SamplingParams
from moestream.structured import ConstraintError, OutputConstraint, from_response_format, ll_tokenizer
from moestream.tokenizer import load_tokenizer

SAMPLED = SamplingParams(temperature=1.0, seed=7)
PROMPT = "import json\n\nconfig = "

SCHEMAS = {
    "required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -99, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "maximum": 999}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tag": {"type": "string", "maxLength": 4},
        },
        "required": ["point", "tag"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def model() -> moestream.generate.Model:
    return moestream.load()


def decode(
    model: moestream.generate.Model, c: OutputConstraint, params: SamplingParams = GREEDY, max_tokens: int = 160
) -> str:
    """A decode loop as the engine runs it (mask, sample, accept, stop when finished or at end of text),
    checking at every step that the constraint is finished at the last token only and that, when it is,
    only the end-of-text tokens are allowed."""
    st = model.new_state()
    prompt = model.tokenize(PROMPT)
    seq, out = list(prompt), []
    sampler = Sampler(params)
    logits = model.decoder.forward(prompt, st, model.ctx)[0]
    for _ in range(max_tokens):
        assert not c.finished
        logits = np.array(logits, np.float32)
        c.mask(logits)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # -inf logits must not make NaN or warnings in the sampler
            token = sampler.sample(logits, seq)
        assert np.isfinite(logits[token])
        c.accept(token)
        if token in c.eos_ids:
            assert c.finished
            break
        out.append(token)
        seq.append(token)
        if c.finished:
            assert set(np.flatnonzero(c.allowed())) == set(c.eos_ids)
            break
        logits = model.decoder.forward([token], st, model.ctx)[0]
    else:
        pytest.fail(f"no end within {max_tokens} tokens: {model.detokenize(out)!r}")
    return model.detokenize(out)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_object_parses(model, params):
    c = OutputConstraint.json_object(model.tokenizer, model.vocab_size, eos_ids=model.eos_ids)
    assert isinstance(json.loads(decode(model, c, params, max_tokens=400)), dict)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_validates(model, name, params):
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    c = from_response_format(rf, model.tokenizer, model.vocab_size, eos_ids=model.eos_ids)
    assert c is not None
    text = decode(model, c, params)
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_in_the_batch_engine_as_alone(model):
    """Through batch.Sequence/step (the server's engine), three constrained sequences decoded together give
    the tokens each gives alone in the loop above, and stop where their constraints finish."""
    from moestream import batch

    cases = [("nested", GREEDY), ("int_array", SAMPLED), ("enum", SamplingParams(temperature=0.8, seed=11))]

    def constraint(name: str) -> OutputConstraint:
        return OutputConstraint.json_schema(SCHEMAS[name], model.tokenizer, model.vocab_size, eos_ids=model.eos_ids)

    alone = [decode(model, constraint(name), params) for name, params in cases]
    prompt = model.tokenize(PROMPT)
    seqs = [
        batch.Sequence(prompt, 160, params, model.new_state(), frozenset(model.eos_ids), constraint=constraint(name))
        for name, params in cases
    ]
    while not all(s.done for s in seqs):
        batch.step(model, seqs, 256, 256)
    together = [model.detokenize([t for t in s.generated if t not in model.eos_ids]) for s in seqs]
    assert together == alone
    for (name, _), text, s in zip(cases, together, seqs, strict=True):
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert s.constraint is not None and s.constraint.finished


def test_stops_where_the_object_closes(model):
    """An object is complete at its closing brace: finished then, and not one token earlier (no prefix of
    the answer parses as a whole)."""
    c = OutputConstraint.json_schema(SCHEMAS["nested"], model.tokenizer, model.vocab_size, eos_ids=model.eos_ids)
    text = decode(model, c, SAMPLED)
    assert text.endswith("}")
    ids = model.tokenize(text, add_bos=False)
    replay = OutputConstraint.json_schema(SCHEMAS["nested"], model.tokenizer, model.vocab_size)
    for n, token in enumerate(ids):
        assert not replay.finished and not replay.accepting
        with pytest.raises(json.JSONDecodeError):
            json.loads(model.detokenize(ids[:n]))
        replay.accept(token)
    assert replay.finished and replay.accepting


def test_end_of_text_exactly_when_the_grammar_may_end(model):
    """A number may go on or end: both end-of-text ids of the model are allowed after `12`, none before
    a digit, and accepting one of them finishes the constraint."""
    eos = model.eos_ids
    assert len(eos) == 2  # the demo model ends at [EOS] and at <|end_of_msg|>
    for end in eos:
        c = OutputConstraint.regex(r"[0-9]{1,3}", model.tokenizer, model.vocab_size, eos_ids=eos)
        ok = c.allowed()
        assert not ok[list(eos)].any()
        assert ok[model.tokenize("7", add_bos=False)].all()
        c.accept(model.tokenize("1", add_bos=False)[0])
        ok = c.allowed()
        assert ok[list(eos)].all() and c.accepting and not c.finished
        specials = set(model.tokenizer.special_tokens.values()) - set(eos)
        assert not ok[sorted(specials)].any()
        c.accept(end)
        assert c.finished


def test_regex_and_grammar(model):
    c = OutputConstraint.regex(r"[a-z]{2,5}-[0-9]{2}", model.tokenizer, model.vocab_size, eos_ids=model.eos_ids)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", decode(model, c, SAMPLED))
    for grammar in ('start: "yes" | "no" | "maybe"', 'root ::= "yes" | "no" | "maybe"'):  # Lark, GBNF
        c = OutputConstraint.grammar(grammar, model.tokenizer, model.vocab_size, eos_ids=model.eos_ids)
        assert decode(model, c) in ("yes", "no", "maybe")
    c = from_response_format({"type": "regex", "regex": "(true|false)"}, model.tokenizer, model.vocab_size)
    assert c is not None and decode(model, c, SAMPLED) in ("true", "false")


SAMPLERS = [
    GREEDY,
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2),
    SamplingParams(temperature=1.0, top_k=5, seed=3),
    SamplingParams(temperature=1.0, top_k=5000, seed=3),
    SamplingParams(temperature=1.0, min_p=0.05, seed=4),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=0.8, presence_penalty=1.0, frequency_penalty=-0.5),
    SamplingParams(temperature=1.5, presence_penalty=-2.0, frequency_penalty=2.0, top_p=0.5, min_p=0.1, seed=6),
]


@pytest.mark.parametrize("params", SAMPLERS)
def test_sampler_takes_masked_logits(model, params):
    """Every sampling option draws only allowed tokens from -inf-masked logits, without NaN or warnings,
    also when the history holds forbidden tokens (the penalties then touch -inf logits)."""
    rng = np.random.default_rng(0)
    c = OutputConstraint.json_schema(SCHEMAS["required"], model.tokenizer, model.vocab_size)
    for token in model.tokenize('{"name":"', add_bos=False):
        c.accept(token)
    allowed = c.allowed()
    assert 10 < allowed.sum() < model.vocab_size
    history = list(rng.integers(0, model.vocab_size, 200))
    sampler = Sampler(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(40):
            logits = rng.normal(0, 3, model.vocab_size).astype(np.float32)
            logits[np.flatnonzero(~allowed)[:5]] = 50.0  # the best raw tokens are forbidden
            c.mask(logits)
            assert allowed[sampler.sample(logits, history)]
        one = np.full(model.vocab_size, -np.inf, np.float32)
        one[123] = 0.0  # a single allowed token
        assert sampler.sample(one, [*history, 123]) == 123


def test_illegal_token_is_refused(model):
    tok, n = model.tokenizer, model.vocab_size
    c = OutputConstraint.json_object(tok, n, eos_ids=model.eos_ids)
    with pytest.raises(ConstraintError, match="token"):
        c.accept(tok.encode("x", add_bos=False)[0])
    with pytest.raises(InputError):  # and refuses everything after
        c.allowed()
    c = OutputConstraint.json_object(tok, n, eos_ids=model.eos_ids)
    c.accept(tok.encode("{", add_bos=False)[0])
    with pytest.raises(InputError, match="before the response is complete"):
        c.accept(model.eos_ids[-1])
    c = OutputConstraint.json_object(tok, n)
    with pytest.raises(InputError):
        c.accept(n + 5)
    with pytest.raises(ValueError, match="shape"):
        OutputConstraint.json_object(tok, n).mask(np.zeros(n - 1, np.float32))


BAD_FORMATS = [
    ([], "must be an object"),
    ({}, "needs a type"),
    ({"type": "yaml"}, "type 'yaml' is not supported"),
    ({"type": 3}, "type int is not supported"),
    ({"type": "text", "schema": {}}, "field 'schema' is not supported with type 'text'"),
    ({"type": "json_object", "strict": True}, "field 'strict'"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "field 'extra' is not supported"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be true or false"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "name": 5}}, "name must be a string"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "must be a JSON object, got list"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}, "foo"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "weird"}}}, "weird"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/nowhere"}}}, "nowhere"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "number", "minimum": float("nan")}}}, "not valid JSON"),
    ({"type": "json_object", "schema": {"type": "array", "minItems": 3, "maxItems": 1}}, "response_format.schema"),
    ({"type": "regex", "regex": "("}, "regex"),
    ({"type": "regex", "regex": ""}, "non-empty string"),
    ({"type": "regex"}, "non-empty string"),
    ({"type": "grammar", "grammar": "start: nowhere"}, "nowhere"),
    ({"type": "grammar", "grammar": 7}, "non-empty string"),
]


@pytest.mark.parametrize("rf, message", BAD_FORMATS)
def test_bad_response_format(model, rf, message):
    with pytest.raises(InputError, match=re.escape(message)) as e:
        from_response_format(rf, model.tokenizer, model.vocab_size)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_formats_that_are_fine(model):
    tok, n = model.tokenizer, model.vocab_size
    assert from_response_format(None, tok, n) is None
    assert from_response_format({"type": "text"}, tok, n) is None
    loose = {"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "weird"}, "strict": False}}
    assert from_response_format(loose, tok, n) is not None  # not strict: the unknown format is ignored
    pydantic_style = {  # what pydantic's model_json_schema() writes: titles, $defs and $ref
        "$defs": {"Item": {"properties": {"n": {"title": "N", "type": "integer"}}, "required": ["n"], "title": "Item"}},
        "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "title": "Items", "type": "array"}},
        "required": ["items"],
        "title": "Order",
        "type": "object",
    }
    rf = {"type": "json_schema", "json_schema": {"name": "Order", "schema": pydantic_style, "strict": True}}
    c = from_response_format(rf, tok, n)
    assert c is not None
    for token in tok.encode('{"items": [{"n": 1}, {"n": 22}]}', add_bos=False):
        c.accept(token)
    assert c.finished
    value = {"a": [1, {"b": None, "c": "x y"}], "d": {"e": {"f": [True, 2.5e-3]}}}
    for text in (json.dumps(value, separators=(",", ":")), json.dumps(value), json.dumps(value, indent=2)):
        c = OutputConstraint.json_object(tok, n)  # compact, spaced and pretty-printed JSON are all allowed
        for token in tok.encode(text, add_bos=False):
            c.accept(token)
        assert c.finished, text
    c = OutputConstraint.json_object(tok, n)
    with pytest.raises(ConstraintError):  # but not unbounded whitespace
        for token in tok.encode("{" + " " * 40 + "}", add_bos=False):
            c.accept(token)
    short = OutputConstraint.json_object(tok, 1900, eos_ids=model.eos_ids)  # a model with fewer ids than its tokenizer
    assert short.allowed().shape == (1900,)


def test_one_vocabulary_per_tokenizer_shared_by_threads(model):
    """The vocabulary view is built once per tokenizer; constraints built and stepped in several threads
    at once agree with one built alone."""
    tok, n = model.tokenizer, model.vocab_size
    assert ll_tokenizer(tok, n, model.eos_ids[0]) is ll_tokenizer(tok, n, model.eos_ids[0])
    answer = tok.encode('{"color": "green"}', add_bos=False)

    def walk() -> list[int]:
        c = OutputConstraint.json_schema(SCHEMAS["enum"], tok, n, eos_ids=model.eos_ids)
        sizes = []
        for token in answer:
            sizes.append(int(c.allowed().sum()))
            c.accept(token)
        assert c.finished
        return sizes

    alone = walk()
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(walk())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [alone] * 6


def test_vocabulary_bytes_match_the_tokenizer(model):
    """llguidance's view of every id is the tokenizer's bytes (byte 0xff, which it keeps as its marker of
    special tokens, is never valid UTF-8 anyway); special tokens are special."""
    tok = model.tokenizer
    lt = ll_tokenizer(tok, model.vocab_size, model.eos_ids[0])
    specials = set(tok.special_tokens.values())
    for i in range(model.vocab_size):
        if i in specials:
            assert lt.is_special_token(i)
        elif i != 255:
            assert lt.decode_bytes([i]) == tok.decode_bytes([i]), i


@pytest.mark.parametrize("source", ["tokenizer.json", "gguf"])
def test_tokenizers_json_vocabulary(tmp_path: Path, source: str):
    """A vocabulary of `tokenizers` (byte-level BPE from tokenizer.json, or a GGUF's metadata rebuilt as
    one, here with Kimi K2's pre-tokenizer): the view matches the tokenizer, ids past the tokenizer's own are
    never allowed, and a schema's answer, in its canonical tokens, is allowed token by token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moestream.gguf_tokenizer import CONTROL, NORMAL, GGUFTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', "def f(x):\n    return x * 2\n", "héllo wörld 🙂"] * 50
    bpe.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    if source == "gguf":
        spec = json.loads(bpe.to_str())["model"]
        tokens = sorted(spec["vocab"], key=spec["vocab"].get)

        metadata = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "kimi-k2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [CONTROL if t == "<eos>" else NORMAL for t in tokens],
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]],
            "tokenizer.ggml.eos_token_id": 0,
        }
        store = SimpleNamespace(path=tmp_path / "model.gguf", metadata=metadata)  # what GGUFTokenizer reads
        tok = GGUFTokenizer(store)
    else:
        bpe.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
        tok = load_tokenizer(tmp_path)
    assert tok is not None and tok.eos_ids == (0,)
    n = bpe.get_vocab_size() + 3  # a model's vocabulary may be padded past the tokenizer's
    lt = ll_tokenizer(tok, n, 0)
    for i in range(1, bpe.get_vocab_size()):
        piece = tok.decode([i])
        if "\ufffd" not in piece:
            assert lt.decode_bytes([i]) == piece.encode(), i
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    c = OutputConstraint.json_schema(schema, tok, n)
    for token in tok.encode('{"name": "Ada", "age": 36}', add_bos=False):
        ok = c.allowed()
        assert ok[token] and not ok[-3:].any()
        c.accept(token)
    assert c.finished and c.allowed()[0] and c.allowed().sum() == 1
