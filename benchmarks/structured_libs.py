"""Constrained-decoding libraries side by side on one vocabulary: llguidance (what moestream uses), xgrammar
and outlines-core, each where it is installed. Per library: the seconds to take in the vocabulary (once per
tokenizer), and per schema the seconds to compile it and the time per token to compute the mask of allowed
tokens, walking the canonical tokens of a fixed valid answer (mask, then consume the token). One thread.

    python3 benchmarks/structured_libs.py [MODEL_OR_TOKENIZER_DIR] [--rounds 5]

The directory needs moestream's tokenizer files (tiktoken.model + tokenization_*.py + tokenizer_config.json,
or tokenizer.json); default: the demo model (2,048 tokens). xgrammar needs torch at import (it is not a
candidate for moestream, whose runtime never needs torch); it and outlines-core are measured only for the
comparison, in an environment of their own if need be.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, machine, table
from moestream.tokenizer import Tokenizer, load_tokenizer

SCHEMAS: list[tuple[str, dict[str, Any] | None, Any]] = [
    ("any object", None, {"a": [1, 2, {"b": None}], "c": "text"}),
    (
        "required props",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    (
        "enum",
        {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"]},
        {"c": "green"},
    ),
    (
        "int array",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 8},
        [3, 14, 159, 2653, 58979],
    ),
    (
        "nested",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["id", "tags"],
                },
                "ok": {"type": "boolean"},
            },
            "required": ["user", "ok"],
        },
        {"user": {"id": 7, "tags": ["x", "yz"]}, "ok": True},
    ),
    (
        "string pattern",
        {
            "type": "object",
            "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
            "required": ["date"],
        },
        {"date": "2026-12-05"},
    ),
]


def vocabulary(tok: Tokenizer, n: int) -> tuple[list[bytes], set[int]]:
    """Every id's bytes (b"" for special tokens) and the special ids."""
    special = set(tok.special_tokens.values())
    out = []
    for i in range(n):
        out.append(b"" if i in special else tok.decode_bytes([i]) if hasattr(tok, "decode_bytes") else b"")
    return out, special


def per_token(step: Any, ids: list[int]) -> list[float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        step(t)
        times.append(time.perf_counter() - t0)
    return times


class LLG:
    name = "llguidance"
    module = "llguidance"

    def __init__(self, tok: Tokenizer, n: int, eos: int):
        from moestream.structured import ll_tokenizer

        self.lltok = ll_tokenizer(tok, n, eos)
        self.n = n

    def compile(self, schema: dict[str, Any] | None) -> Any:
        import llguidance

        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema or {"type": "object"}))
        m = llguidance.LLMatcher(self.lltok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def walk(self, m: Any, ids: list[int]) -> list[float]:
        words = np.zeros((self.n + 31) // 32, np.int32)

        def step(t: int) -> None:
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            assert (words[t // 32] >> (t % 32)) & 1, t
            assert m.consume_token(t)

        return per_token(step, ids)


class XGR:
    name = "xgrammar"
    module = "xgrammar"

    def __init__(self, tok: Tokenizer, n: int, eos: int):
        import xgrammar as xgr

        vocab, _ = vocabulary(tok, n)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.n = n

    def compile(self, schema: dict[str, Any] | None) -> Any:
        import xgrammar as xgr

        if schema is None:
            return xgr.GrammarMatcher(self.compiler.compile_builtin_json_grammar())
        return xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True))

    def walk(self, m: Any, ids: list[int]) -> list[float]:
        words = np.zeros((1, (self.n + 31) // 32), np.int32)

        def step(t: int) -> None:
            m.fill_next_token_bitmask(words)
            assert (words[0, t // 32] >> (t % 32)) & 1, t
            assert m.accept_token(t)

        return per_token(step, ids)


class OUT:
    name = "outlines-core"
    module = "outlines_core"

    def __init__(self, tok: Tokenizer, n: int, eos: int):
        from outlines_core import Vocabulary

        vocab, special = vocabulary(tok, n)
        ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b and i not in special and i != eos:
                ids.setdefault(b, []).append(i)
        self.vocab = Vocabulary(eos, ids)
        self.n = n

    def compile(self, schema: dict[str, Any] | None) -> Any:
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        if schema is None:
            return None  # a regex engine: no recursive "any JSON object"
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), self.vocab))

    def walk(self, m: Any, ids: list[int]) -> list[float]:
        words = np.zeros((self.n + 31) // 32, np.int32)

        def step(t: int) -> None:
            m.write_mask_into(words.ctypes.data, words.size, 4)
            assert (words[t // 32] >> (t % 32)) & 1, t
            m.advance(t, return_tokens=False)

        return per_token(step, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a directory with tokenizer files (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=5, help="compiles and walks per schema; the best is shown")
    args = ap.parse_args()
    if args.model:
        tok = load_tokenizer(Path(args.model))
        assert tok is not None, "no tokenizer files there"
        n = max([*tok.special_tokens.values(), len(getattr(tok, "ranks", {})) - 1]) + 1
    else:
        import moestream

        m = moestream.load()
        tok, n = m.tokenizer, m.vocab_size
    eos = tok.eos_ids[0]
    print(f"{machine()}  commit {commit()}  vocabulary {n} tokens")
    rows = []
    for lib in (LLG, XGR, OUT):
        try:
            t0 = time.perf_counter()
            importlib.import_module(lib.module)
            imported = time.perf_counter() - t0
        except ImportError as e:
            print(f"{lib.name}: not installed ({e})")
            continue
        t0 = time.perf_counter()
        engine = lib(tok, n, eos)
        setup = time.perf_counter() - t0
        print(f"{lib.name}: import {imported:.2f} s, vocabulary {setup:.2f} s", flush=True)
        for label, schema, answer in SCHEMAS:
            ids = tok.encode(json.dumps(answer, separators=(",", ":")), add_bos=False)
            compiles, masks = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                matcher = engine.compile(schema)
                compiles.append(time.perf_counter() - t0)
                if matcher is None:
                    break
                masks.append(engine.walk(matcher, ids))
            if not masks:
                rows.append([lib.name, f"{setup:.3f}", label, "n/a", "n/a", "n/a", str(len(ids))])
                continue
            best = min(masks, key=sum)
            rows.append(
                [
                    lib.name,
                    f"{setup:.3f}",
                    label,
                    f"{min(compiles) * 1e3:.1f}",
                    f"{statistics.mean(best) * 1e6:.0f}",
                    f"{max(best) * 1e6:.0f}",
                    str(len(ids)),
                ]
            )
    print(
        table(
            ["library", "vocab s", "schema", "compile ms", "mask+consume us/token", "max us", "tokens"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
