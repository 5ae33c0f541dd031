"""Tokenizers built inside the tests: tokenizer.json against transformers' own fast tokenizer (BOS as
tokenizer_config.json says), and tiktoken.model against tiktoken used directly, with the pattern parsed
from tokenization_kimi.py and the special tokens of tokenizer_config.json."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moestream.errors import CheckpointError
from moestream.tokenizer import load_tokenizer

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade naïve café — “quotes”.\n",
    "汉字和中文文本也需要测试。日本語のテキスト。\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
] * 20
SAMPLES = [
    "Hello world",
    "def f(x):\n    return x*2\n",
    "中文测试 mixed with English",
    "emoji 🙂 and naïve",
    "",
]


def _hf_tokenizer_dir(tmp: Path, add_bos: bool) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    d = tmp / f"hf_{add_bos}"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": add_bos,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return d


@pytest.mark.parametrize("add_bos", [True, False])
def test_tokenizer_json_matches_transformers(tmp_path, add_bos):
    from transformers import PreTrainedTokenizerFast

    d = _hf_tokenizer_dir(tmp_path, add_bos)
    ours = load_tokenizer(d)
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>", eos_token="</s>", add_bos_token=add_bos
    )
    assert ours is not None
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert (ids[:1] == [ours.bos_id]) == add_bos
        body = ids[1:] if add_bos else ids
        assert ours.decode(body) == text
    assert ours.eos_ids == (theirs.eos_token_id,)


def test_stream_decoding_holds_partial_characters(tmp_path):
    d = _hf_tokenizer_dir(tmp_path, False)
    tok = load_tokenizer(d)
    assert tok is not None
    text = "中文 🙂 naïve"
    ids = tok.encode(text)
    s = tok.stream()
    pieces = [s.feed(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# ---- tiktoken ------------------------------------------------------------------------------------

KIMI_PATTERN_PY = '''
class TikTokenTokenizer:
    special_tokens = {}
    pat_str = "|".join(
        [
            r"""[\\p{Han}]+""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\\p{N}{1,3}""",
            r""" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*""",
            r"""\\s*[\\r\\n]+""",
            r"""\\s+(?!\\S)""",
            r"""\\s+""",
        ]
    )
    raise SystemExit("this file must never be executed")
'''


def _tiktoken_dir(tmp: Path) -> tuple[Path, dict[bytes, int], dict[str, int], str]:
    """A small byte-level BPE vocabulary trained with `tokenizers`, written as tiktoken.model."""
    ns: dict = {}
    body = KIMI_PATTERN_PY.replace('    raise SystemExit("this file must never be executed")\n', "")
    exec(body, ns)  # the test (not the engine) evaluates its own file to know the expected pattern
    pat_str = ns["TikTokenTokenizer"].pat_str
    # ranks: the 256 bytes, then frequent pairs from the corpus
    ranks = {bytes([i]): i for i in range(256)}
    for word in ["  ", "    ", "de", "def", "re", "ret", "return", "中文", "汉字", "th", "the", "in", "__"]:
        b = word.encode()
        if b not in ranks:
            # tiktoken needs every prefix merge path to exist: add left-to-right prefixes
            for j in range(2, len(b) + 1):
                ranks.setdefault(b[:j], len(ranks))
    specials = {"[BOS]": len(ranks), "[EOS]": len(ranks) + 1, "<|end_of_msg|>": len(ranks) + 2}
    d = tmp / "tk"
    d.mkdir()
    with open(d / "tiktoken.model", "w") as f:
        for tok, rank in ranks.items():
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    (d / "tokenization_kimi.py").write_text(KIMI_PATTERN_PY)
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "added_tokens_decoder": {str(v): {"content": k, "special": True} for k, v in specials.items()},
            }
        )
    )
    return d, ranks, specials, pat_str


def test_tiktoken_model_matches_tiktoken(tmp_path):
    d, ranks, specials, pat_str = _tiktoken_dir(tmp_path)
    ours = load_tokenizer(d)
    assert ours is not None
    theirs = tiktoken.Encoding("t", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    for text in [*SAMPLES, "汉字和中文 def return the", "a[EOS]b<|end_of_msg|>"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, allowed_special="all"), text
        assert ours.decode(ids) == text
        assert ours.decode_bytes(ids) == text.encode()
    assert ours.encode("x", add_bos=True)[0] == specials["[BOS]"]
    assert ours.eos_ids == (specials["[EOS]"],)
    han = ours.encode("汉字")
    assert han == [ranks["汉字".encode()]]


def test_tiktoken_without_pattern_is_refused(tmp_path):
    d, *_ = _tiktoken_dir(tmp_path)
    (d / "tokenization_kimi.py").write_text("x = 1\n")
    with pytest.raises(CheckpointError, match="pat_str"):
        load_tokenizer(d)
