"""Structured output: generation held to a JSON schema, a regular expression or a grammar while it decodes.

Each step the constraint turns the logits of every token that cannot continue the text into -inf (`mask`),
and learns the token that was chosen (`accept`). The work is done by llguidance (Rust, no runtime
dependencies; the library vLLM, SGLang and llama.cpp use), which keeps a trie of the vocabulary's bytes and
a lexer/parser over the grammar: a mask costs tens of microseconds even for a 160k-token vocabulary (the
comparison with xgrammar and outlines-core is in docs/measurements.md).

The vocabulary view (one per tokenizer, vocabulary size and end-of-text id; built once and cached, as it is
not free for a large vocabulary) comes from the model's own tokenizer files: tiktoken ranks and pattern, or
the tokenizer.json of `tokenizers` (GGUF tokenizers are rebuilt as one). Special tokens are never allowed by
a grammar, except the end-of-text tokens, which are allowed exactly when the grammar may end.

Requests come in OpenAI's `response_format` shapes (`from_response_format`); anything malformed or not
supported is one InputError naming it."""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InputError
from .tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer

# Whitespace the JSON grammar allows where JSON allows it: none, one space, or a line break and an
# indentation (pretty-printed JSON up to ~10 levels deep), at most once per place. Unbounded whitespace
# (the JSON grammar's own default) lets a weak model fill its whole budget with blank lines.
JSON_WHITESPACE = r"(?: |\r?\n[ \t]{0,20})"
MESSAGE_CHARS = 240  # an error from the library is cut to this: one line for the user


class ConstraintError(InputError):
    """A token that breaks the constraint, or a grammar the library cannot follow."""


# ---- the vocabulary as llguidance sees it ---------------------------------------------------------

_vocabularies: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, int], Any]] = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: int) -> Any:
    """llguidance's LLTokenizer for this tokenizer, at least vocab_size ids (the model's, which may exceed the
    tokenizer's own: ids it has no bytes for are never allowed; or fall short of it: then the view has the
    tokenizer's size) and end-of-text id; made once per (tokenizer, size, eos) and shared by every
    constraint (it is immutable and thread-safe)."""
    key = (max(int(vocab_size), _tokenizer_size(tokenizer)), int(eos))
    with _vocabularies_lock:  # held while building: a second request for the same vocabulary waits for it
        per = _vocabularies.setdefault(tokenizer, {})
        if key not in per:
            per[key] = _build_ll_tokenizer(tokenizer, *key)
        return per[key]


def _tokenizer_size(tokenizer: Tokenizer) -> int:
    """One past the tokenizer's largest id (0 when it cannot tell)."""
    if isinstance(tokenizer, TiktokenTokenizer):
        return max([*tokenizer.ranks.values(), *tokenizer.special_tokens.values()]) + 1
    if isinstance(tokenizer, HFTokenizer):
        return int(tokenizer.tok.get_vocab_size(with_added_tokens=True))
    return 0


def _build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: int) -> Any:
    import llguidance

    try:
        if isinstance(tokenizer, TiktokenTokenizer):
            return llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
                encoder=tokenizer.ranks,
                special_tokens=tokenizer.special_tokens,
                pattern=tokenizer.pat_str,
                eos_token=eos,
                n_vocab=vocab_size,
            )
        if isinstance(tokenizer, HFTokenizer):  # tokenizer.json, or a GGUF vocabulary rebuilt as one
            return llguidance.LLTokenizer(tokenizer._json, n_vocab=vocab_size, eos_token=eos)
    except ValueError as e:
        raise InputError(f"{tokenizer.source}: structured output cannot use this vocabulary ({_line(e)})") from None
    raise InputError(f"structured output needs a tiktoken or tokenizers vocabulary, not {type(tokenizer).__name__}")


def _line(e: object) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


# ---- the constraint -------------------------------------------------------------------------------


class OutputConstraint:
    """One generation's constraint. Made in any thread (the grammar is compiled here), then used by one
    thread at a time: per step `mask(logits)` before sampling, `accept(token)` after, and stop when
    `finished`. Calls are serialized by a lock, so a hand-over between threads needs nothing more."""

    def __init__(
        self,
        grammar: str,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_ids: Sequence[int] | None,
        what: str,
    ):
        import llguidance

        eos = tuple(dict.fromkeys(int(i) for i in (tokenizer.eos_ids if eos_ids is None else eos_ids)))
        if not eos:
            raise InputError(f"{what}: the model has no end-of-text token, which structured output needs")
        if not all(0 <= i < vocab_size for i in eos):
            raise InputError(f"{what}: end-of-text ids {eos} do not all fit the vocabulary of {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eos_ids = eos
        self._eos = np.asarray(eos, np.int64)
        self._lltok = ll_tokenizer(tokenizer, self.vocab_size, eos[0])
        limits = llguidance.LLParserLimits(verbose_errors=False)
        self._matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0, limits=limits)
        if self._matcher.is_error():
            raise InputError(f"{what}: {_line(self._matcher.get_error())}")
        self._lock = threading.Lock()
        self.tokens = 0  # accepted so far

    # -- constructors (OpenAI's response_format types, and two extensions) --

    @classmethod
    def json_object(
        cls, tokenizer: Tokenizer, vocab_size: int, *, eos_ids: Sequence[int] | None = None
    ) -> OutputConstraint:
        """Any JSON object (OpenAI's `json_object`)."""
        return cls.json_schema({"type": "object"}, tokenizer, vocab_size, eos_ids=eos_ids, what="json_object")

    @classmethod
    def json_schema(
        cls,
        schema: dict[str, Any],
        tokenizer: Tokenizer,
        vocab_size: int,
        strict: bool = True,
        *,
        eos_ids: Sequence[int] | None = None,
        what: str = "json_schema",
    ) -> OutputConstraint:
        """JSON that validates against schema (draft 2020-12; properties come in the schema's order). strict:
        a keyword or string format the library does not enforce is an error; not strict, it is ignored (the
        output is still JSON and follows every keyword that is enforced)."""
        import llguidance

        if not isinstance(schema, dict):
            raise InputError(f"{what}: the schema must be a JSON object, got {type(schema).__name__}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema, allow_nan=False),
                defaults={"whitespace_pattern": JSON_WHITESPACE},
                overrides={"lenient": not strict},
            )
        except (ValueError, TypeError, RecursionError) as e:
            raise InputError(f"{what}: the schema is not valid JSON ({_line(e)})") from None
        return cls(grammar, tokenizer, vocab_size, eos_ids, what)

    @classmethod
    def regex(
        cls, pattern: str, tokenizer: Tokenizer, vocab_size: int, *, eos_ids: Sequence[int] | None = None
    ) -> OutputConstraint:
        """Text that matches pattern as a whole (Rust `regex` syntax: no lookaround, no backreferences)."""
        import llguidance

        if not isinstance(pattern, str) or not pattern:
            raise InputError("regex: the pattern must be a non-empty string")
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), tokenizer, vocab_size, eos_ids, "regex")

    @classmethod
    def grammar(
        cls, lark: str, tokenizer: Tokenizer, vocab_size: int, *, eos_ids: Sequence[int] | None = None
    ) -> OutputConstraint:
        """Text of a context-free grammar: llguidance's Lark dialect (`start: ...`), or llama.cpp's GBNF
        (`root ::= ...`), which is converted."""
        import llguidance

        if not isinstance(lark, str) or not lark.strip():
            raise InputError("grammar: the grammar must be a non-empty string")
        try:
            grammar = llguidance.grammar_from("grammar", lark)
        except ValueError as e:
            raise InputError(f"grammar: {_line(e)}") from None
        return cls(grammar, tokenizer, vocab_size, eos_ids, "grammar")

    # -- per step --

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens that may come next (end-of-text ones exactly when the grammar may
        end here)."""
        with self._lock:
            self._check()
            bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
            if self._matcher.is_error():  # a step limit of the library was hit
                raise ConstraintError(f"structured output: {_line(self._matcher.get_error())}")
        # the mask is u32 words, token 32*w + b at bit b of word w: in little-endian bytes, bit order little;
        # ids the tokenizer has beyond the model's vocabulary are cut off (the model cannot give them)
        ok = np.unpackbits(bits, bitorder="little", count=self.vocab_size).view(np.bool_)
        ok[self._eos] = ok[self.eos_ids[0]]  # the library knows one end-of-text id; the model may have more
        return ok

    def mask(self, logits: np.ndarray) -> None:
        """logits [vocab_size] float32, in place: every token that cannot come next becomes -inf. Check the
        logits for NaN/Inf before this, not after (the -inf are meant)."""
        if logits.ndim != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(f"mask: logits of shape {logits.shape}, want ({self.vocab_size},)")
        np.copyto(logits, -np.inf, where=~self.allowed())

    def accept(self, token: int) -> None:
        """The token chosen; ConstraintError (an InputError) if the constraint did not allow it, after which
        the constraint refuses everything."""
        token = int(token)
        with self._lock:
            self._check()
            if token in self.eos_ids:
                if not self._matcher.is_accepting():
                    self._matcher.consume_token(self.eos_ids[0])  # puts the matcher in its error state
                    raise ConstraintError(
                        f"structured output: end of text (token {token}) before the response is complete"
                    )
                token = self.eos_ids[0]
            if not 0 <= token < self.vocab_size or not self._matcher.consume_token(token):
                raise ConstraintError(f"structured output: token {token} does not continue the response here")
            self.tokens += 1

    @property
    def finished(self) -> bool:
        """The response is complete and nothing may follow it (an end-of-text token was accepted, or the
        grammar allows no more text): generation must stop now, without another token."""
        with self._lock:
            return bool(self._matcher.is_stopped()) and not self._matcher.is_error()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete response (it may go on, or end here): whether stopping now, at a
        token limit, leaves valid output."""
        with self._lock:
            return bool(self._matcher.is_accepting())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"structured output: {_line(self._matcher.get_error())}")


# ---- OpenAI's response_format ---------------------------------------------------------------------

_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_KEYS = {
    "text": {"type"},
    "json_object": {"type", "schema"},  # "schema": llama.cpp's server takes a schema here too
    "json_schema": {"type", "json_schema"},
    "regex": {"type", "regex"},
    "grammar": {"type", "grammar"},
}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def from_response_format(
    rf: Any, tokenizer: Tokenizer, vocab_size: int, *, eos_ids: Sequence[int] | None = None
) -> OutputConstraint | None:
    """The constraint a request's `response_format` asks for, or None for plain text:
    {"type": "text"}; {"type": "json_object"} (optionally with "schema", as llama.cpp takes it);
    {"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}} (strict defaults to
    true: a keyword that is not enforced is refused rather than ignored); and the extensions
    {"type": "regex", "regex": PATTERN} and {"type": "grammar", "grammar": LARK_OR_GBNF}. Pass the model's
    eos_ids (all of its end-of-text ids); without them the tokenizer's are used."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InputError(f"response_format must be an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind is None:
        raise InputError(f"response_format needs a type ({', '.join(_TYPES)})")
    if kind not in _TYPES:
        shown = repr(kind)[:60] if isinstance(kind, str) else type(kind).__name__
        raise InputError(f"response_format type {shown} is not supported ({', '.join(_TYPES)} are)")
    extra = sorted(set(rf) - _KEYS[kind])
    if extra:
        raise InputError(f"response_format field {extra[0][:60]!r} is not supported with type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        if rf.get("schema") is None:
            return OutputConstraint.json_object(tokenizer, vocab_size, eos_ids=eos_ids)
        return OutputConstraint.json_schema(
            rf["schema"], tokenizer, vocab_size, eos_ids=eos_ids, what="response_format.schema"
        )
    if kind == "regex":
        return OutputConstraint.regex(_string(rf, "regex"), tokenizer, vocab_size, eos_ids=eos_ids)
    if kind == "grammar":
        return OutputConstraint.grammar(_string(rf, "grammar"), tokenizer, vocab_size, eos_ids=eos_ids)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise InputError("response_format.json_schema must be an object with a 'schema'")
    extra = sorted(set(js) - _JSON_SCHEMA_KEYS)
    if extra:
        raise InputError(f"response_format.json_schema field {extra[0][:60]!r} is not supported")
    for key in ("name", "description"):
        if js.get(key) is not None and not isinstance(js[key], str):
            raise InputError(f"response_format.json_schema.{key} must be a string")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InputError("response_format.json_schema.strict must be true or false")
    if "schema" not in js:
        raise InputError("response_format.json_schema.schema is missing")
    return OutputConstraint.json_schema(
        js["schema"],
        tokenizer,
        vocab_size,
        strict=True if strict is None else strict,
        eos_ids=eos_ids,
        what="response_format.json_schema.schema",
    )


def _string(rf: dict[str, Any], key: str) -> str:
    v = rf.get(key)
    if not isinstance(v, str) or not v:
        raise InputError(f"response_format.{key} must be a non-empty string")
    return v
