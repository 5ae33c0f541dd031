"""The incremental detokenizer (tokenizer.StreamDecoder): what it returns, piece by piece, adds up to
decoding the whole sequence at once, byte for byte, on multi-byte UTF-8, characters split over tokens,
byte-fallback tokens and SentencePiece-style leading spaces, for tiktoken and `tokenizers` vocabularies;
and it decodes only a few tokens a step, however long the reply."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from moestream.tokenizer import Tokenizer as OurTokenizer
from moestream.tokenizer import load_tokenizer
from test_tokenizer import CORPUS, _hf_tokenizer_dir, _tiktoken_dir

TEXTS = [
    "Hello world",
    "def f(x):\n    return x*2\n",
    "中文测试 mixed with English 汉字",
    "emoji 🙂 and naïve café — “quotes” 👩‍👩‍👧 🇫🇷",
    "  leading spaces and trailing  ",
    "ÿ€𝄞 \u00a0\u2028 𐍈",
]


def _byte_fallback_dir(tmp: Path) -> Path:
    """A Llama-style vocabulary: SentencePiece spaces (▁), the 256 byte tokens <0x00>..<0xFF> for what
    the pieces do not cover (no CJK or emoji pieces here), and Llama's decoder (spaces back, bytes
    fused, one leading space stripped)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bytes_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>", *bytes_tokens],
        initial_alphabet=[*"abcdefghijklmnopqrstuvwxyz", "▁"],
        limit_alphabet=40,
    )
    tok.train_from_iterator([t for t in CORPUS if t.isascii()], trainer)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    d = tmp / "byte_fallback"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module", params=["byte_level", "tiktoken", "byte_fallback"])
def tok(request, tmp_path_factory) -> OurTokenizer:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "byte_level":
        d = _hf_tokenizer_dir(tmp, False)
    elif request.param == "tiktoken":
        d = _tiktoken_dir(tmp)[0]
    else:
        d = _byte_fallback_dir(tmp)
    t = load_tokenizer(d)
    assert t is not None
    t.kind = request.param  # type: ignore[attr-defined]
    return t


def stream(tok: OurTokenizer, ids: list[int]) -> list[str]:
    s = tok.stream()
    return [s.feed(i) for i in ids] + [s.flush()]


def ids_of(tok: OurTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_bos=False, special=False)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decode(tok, text):
    ids = ids_of(tok, text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    if tok.kind != "byte_fallback":  # type: ignore[attr-defined]
        assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ["a🙂中", "𝄞", "🙂🙂", "x€y"])
def test_characters_split_over_tokens_come_out_whole(tok, text):
    """After each token, what was returned is the decode so far without its unfinished character. (With
    byte-fallback tokens a decode so far can be all replacement characters where a later token makes it
    valid, as `tokenizers` decodes a run of byte tokens at once: there, what was returned is a prefix of
    the whole decode.)"""
    ids = ids_of(tok, text)
    assert len(ids) > len(text)  # a character is split over several tokens
    whole = tok.decode(ids)
    s = tok.stream()
    out = ""
    for n, i in enumerate(ids, 1):
        out += s.feed(i)
        assert "\ufffd" not in out and whole.startswith(out)
        if tok.kind != "byte_fallback":  # type: ignore[attr-defined]
            assert out == tok.decode(ids[:n]).rstrip("\ufffd")
    assert out + s.flush() == whole


def test_random_ids_decode_the_same(tok):
    """Random tokens make invalid UTF-8 (stray continuation bytes, cut sequences): for byte-level and
    tiktoken vocabularies the pieces still add up to the whole decode, replacement characters included.
    For byte-fallback tokens, valid text from random characters."""
    rng = np.random.default_rng(0)
    if tok.kind == "byte_fallback":  # type: ignore[attr-defined]
        pool = list("ab ciao 中文 🙂 é\n\t€𝄞")
        for _ in range(20):
            text = "".join(rng.choice(pool, size=40))
            ids = ids_of(tok, text)
            assert "".join(stream(tok, ids)) == tok.decode(ids)
        return
    vocab = max(ids_of(tok, "".join(TEXTS))) + 1
    for n in (1, 2, 7, 60):
        for _ in range(20):
            ids = [int(i) for i in rng.integers(0, vocab, size=n)]
            assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_only_a_window_is_decoded(tok, monkeypatch):
    """A 2,000-token reply: every decode call sees a handful of tokens, not the reply so far."""
    ids = ids_of(tok, " ".join(TEXTS) * 40)
    assert len(ids) >= 2000
    seen: list[int] = []
    decode = type(tok).decode

    def counting(self, some):
        seen.append(len(some))
        return decode(self, some)

    monkeypatch.setattr(type(tok), "decode", counting)
    pieces = stream(tok, ids)
    monkeypatch.undo()
    assert "".join(pieces) == tok.decode(ids)
    assert max(seen) <= 8 and sum(seen) <= 6 * len(ids), (max(seen), sum(seen))


def test_flush_returns_an_unfinished_character(tok):
    ids = ids_of(tok, "x🙂")
    s = tok.stream()
    fed = "".join(s.feed(i) for i in ids[:-1])
    assert "🙂" not in fed
    tail = s.flush()
    assert fed + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert s.flush() == ""
