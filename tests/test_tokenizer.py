"""Tokenizers built inside the tests: tokenizer.json against transformers' own fast tokenizer (BOS as
tokenizer_config.json says), and tiktoken.model against tiktoken used directly, with the pattern parsed
from tokenization_kimi.py and the special tokens of tokenizer_config.json."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moestream.default_model import default_model_path
from moestream.errors import CheckpointError, InputError
from moestream.tokenizer import load_tokenizer
from test_cli import assert_user_error, cli

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


# ---- malformed tokenizer files: one CheckpointError naming the file ------------------------------


def _rewrite_lines(path: Path, edit) -> None:
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(edit(lines)) + b"\n")


def _config_edit(d: Path, edit) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    edit(cfg)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


TIKTOKEN_DAMAGE = {
    "empty file": ("tiktoken.model", lambda d: (d / "tiktoken.model").write_bytes(b""), "no tokens"),
    "duplicate rank": (
        "tiktoken.model",
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: [*ls[:-1], ls[-1].split()[0] + b" 7"]),
        "rank 7 appears twice",
    ),
    "duplicate token": (
        "tiktoken.model",
        lambda d: _rewrite_lines(
            d / "tiktoken.model", lambda ls: [*ls, ls[3].split()[0] + b" " + str(len(ls)).encode()]
        ),
        "appears twice",
    ),
    "not base64": (
        "tiktoken.model",
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: [b"@@@ 3", *ls[1:]]),
        "line 1",
    ),
    "rank not an integer": (
        "tiktoken.model",
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: [ls[0].split()[0] + b" -1", *ls[1:]]),
        "not an integer",
    ),
    "three fields": (
        "tiktoken.model",
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: [ls[0] + b" 9", *ls[1:]]),
        "3 fields",
    ),
    "a byte without a token": (
        "tiktoken.model",
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: ls[1:]),
        "byte 0x00",
    ),
    "sparse ranks": (
        "tiktoken.model",
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: [*ls[:-1], ls[-1].split()[0] + b" 100000"]),
        "too sparse",
    ),
    "special id taken by a rank": (
        "tokenizer_config.json",
        lambda d: _config_edit(d, lambda c: c["added_tokens_decoder"].update({"5": {"content": "<x>"}})),
        "special token id 5",
    ),
    "pat_str does not compile": (
        "tokenization_kimi.py",
        lambda d: (d / "tokenization_kimi.py").write_text('pat_str = "(abc"\n'),
        "does not compile",
    ),
    "pat_str matches empty text": (
        "tokenization_kimi.py",
        lambda d: (d / "tokenization_kimi.py").write_text('pat_str = "a*"\n'),
        "matches empty text",
    ),
    "added token id not a number": (
        "tokenizer_config.json",
        lambda d: _config_edit(d, lambda c: c["added_tokens_decoder"].update({"abc": {"content": "<y>"}})),
        "'abc'",
    ),
    "added token without content": (
        "tokenizer_config.json",
        lambda d: _config_edit(d, lambda c: c["added_tokens_decoder"].update({"999": {"special": True}})),
        "'content'",
    ),
    "bos_token of the wrong type": (
        "tokenizer_config.json",
        lambda d: _config_edit(d, lambda c: c.update(bos_token=5)),
        "bos_token",
    ),
    "add_bos_token of the wrong type": (
        "tokenizer_config.json",
        lambda d: _config_edit(d, lambda c: c.update(add_bos_token="yes")),
        "add_bos_token",
    ),
    "added_tokens_decoder a list": (
        "tokenizer_config.json",
        lambda d: _config_edit(d, lambda c: c.update(added_tokens_decoder=[1])),
        "added_tokens_decoder",
    ),
    "config a FIFO": ("tokenizer_config.json", lambda d: _fifo(d / "tokenizer_config.json"), "not a regular file"),
    "tiktoken.model a FIFO": ("tiktoken.model", lambda d: _fifo(d / "tiktoken.model"), "not a regular file"),
    "tiktoken.model a directory": ("tiktoken.model", lambda d: _directory(d / "tiktoken.model"), "not a regular file"),
}


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("case", list(TIKTOKEN_DAMAGE))
def test_malformed_tiktoken_files_are_one_error_naming_the_file(tmp_path, case):
    d, *_ = _tiktoken_dir(tmp_path)
    name, damage, fragment = TIKTOKEN_DAMAGE[case]
    damage(d)
    with pytest.raises(CheckpointError, match=re.escape(fragment)) as e:
        load_tokenizer(d)
    assert name in str(e.value)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_text("{not json"),
        lambda p: p.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": "x"}}})),
        lambda p: p.write_bytes(b"\xff\xfe"),
        lambda p: _fifo(p),
    ],
)
def test_malformed_tokenizer_json_is_one_error_naming_the_file(tmp_path, damage):
    d = _hf_tokenizer_dir(tmp_path, True)
    damage(d / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        load_tokenizer(d)


# ---- text that is not valid Unicode --------------------------------------------------------------


def test_lone_surrogates_are_refused_with_their_position(tmp_path):
    hf = load_tokenizer(_hf_tokenizer_dir(tmp_path, True))
    tk = load_tokenizer(_tiktoken_dir(tmp_path)[0])
    for tok in (hf, tk):
        assert tok is not None
        for special in (True, False):
            with pytest.raises(InputError, match=r"lone surrogate U\+D800 at character 5"):
                tok.encode("hello\ud800world", special=special)
        with pytest.raises(InputError, match=r"U\+DCFF at character 0"):
            tok.encode_pieces([("\udcff", True)])


# ---- special tokens read as text -----------------------------------------------------------------


def test_special_false_reads_special_token_strings_as_text(tmp_path):
    d, ranks, specials, pat_str = _tiktoken_dir(tmp_path)
    tok = load_tokenizer(d)
    assert tok is not None
    plain = tiktoken.Encoding("t", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={})
    text = "a[EOS]b<|end_of_msg|>"
    eos, end = specials["[EOS]"], specials["<|end_of_msg|>"]
    assert tok.encode(text, add_bos=False) == [*plain.encode("a"), eos, *plain.encode("b"), end]
    as_text = tok.encode(text, add_bos=False, special=False)
    assert as_text == plain.encode_ordinary(text)
    assert not set(as_text) & set(specials.values())
    # content pieces are text; the template's own pieces keep their special tokens
    ids = tok.encode_pieces([("[BOS]user:", False), ("[EOS]hi", True), ("<|end_of_msg|>", False)])
    assert ids == [specials["[BOS]"], *plain.encode_ordinary("user:[EOS]hi"), specials["<|end_of_msg|>"]]


# ---- the same through the command line: one line, exit 2, no output ------------------------------


def _demo_copy(tmp: Path) -> Path:
    d = tmp / "demo"
    shutil.copytree(default_model_path(), d)
    return d


def _demo_with_tokenizer_json(tmp: Path) -> Path:
    d = _demo_copy(tmp)
    hf = _hf_tokenizer_dir(tmp, False)
    shutil.copy(hf / "tokenizer.json", d / "tokenizer.json")
    shutil.copy(hf / "tokenizer_config.json", d / "tokenizer_config.json")
    return d


CLI_DAMAGE = {
    "empty tiktoken.model": (lambda d: (d / "tiktoken.model").write_bytes(b""), ["tiktoken.model", "no tokens"]),
    "duplicate ranks": (
        lambda d: _rewrite_lines(d / "tiktoken.model", lambda ls: [*ls[:-1], ls[-1].split()[0] + b" 7"]),
        ["tiktoken.model", "rank 7 appears twice"],
    ),
    "bad pat_str": (
        lambda d: (d / "tokenization_kimi.py").write_text('pat_str = "[a-"\n'),
        ["tokenization_kimi.py", "does not compile"],
    ),
    "malformed tokenizer.json": (lambda d: (d / "tokenizer.json").write_text("{not json"), ["tokenizer.json"]),
    "tokenizer_config.json a FIFO": (
        lambda d: _fifo(d / "tokenizer_config.json"),
        ["tokenizer_config.json", "not a regular file"],
    ),
}


@pytest.mark.parametrize("case", list(CLI_DAMAGE))
def test_cli_malformed_tokenizer_files_are_one_line(tmp_path, case):
    damage, fragments = CLI_DAMAGE[case]
    d = _demo_copy(tmp_path)
    damage(d)
    assert_user_error(cli("run", str(d), "--prompt", "x", "--gen", "1"), *fragments)


def test_cli_prompt_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"ab\xffcd")
    assert_user_error(cli("run", "--prompt-file", str(bad), "--gen", "1"), "not valid UTF-8 (byte 0xff at offset 2)")
    surrogate = tmp_path / "s.txt"
    surrogate.write_bytes("x\ud800".encode("utf-8", "surrogatepass"))  # CESU-style bytes of a lone surrogate
    assert_user_error(cli("run", "--prompt-file", str(surrogate), "--gen", "1"), "byte 0xed at offset 1")
    d = _demo_with_tokenizer_json(tmp_path)
    # undecodable bytes on the command line reach Python as lone surrogates
    p = cli("run", str(d), "--prompt", os.fsdecode(b"ab\xff"), "--gen", "1")
    assert_user_error(p, "lone surrogate U+DCFF at character 2")
