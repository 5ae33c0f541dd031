"""Tokenizers of real checkpoints: tokenizer.json through `tokenizers`, or tiktoken.model through
`tiktoken` with the pre-tokenizer pattern read (never executed) from the model's tokenization_*.py and
special tokens from tokenizer_config.json. BOS is added as tokenizer_config.json says.

Every file is validated where it is read (a non-regular file, a malformed line, duplicate or sparse
ranks, special ids that collide with ranks, a pattern that does not compile or matches empty text,
fields of the wrong type): each is one CheckpointError naming the file. Text handed to a tokenizer must
be valid Unicode: a lone surrogate (from a JSON escape or from undecodable command-line bytes) is
refused with its position, never replaced.

Special tokens: `encode(text)` reads special-token strings in the text as the special tokens (a raw
prompt, as llama.cpp does by default); `encode(text, special=False)` reads them as ordinary text; and
`encode_pieces` mixes the two, so a chat template's own markers are special while message content,
whatever it holds, is text."""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import os
import re
import stat
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InputError
from .formats.checkpoint import read_json
from .formats.safetensors import open_regular

PATTERN_SECONDS = 30.0  # matching a pattern on one text: far beyond what a real pattern needs
MAX_RANK = 2**31 - 1  # tiktoken keeps ranks as u32; ids beyond i32 fit no embedding table anyway
# Probe texts for a pre-tokenizer pattern: one that matches empty text on any of them is refused at load
# (tiktoken cannot encode an empty piece); encode() checks every text it is handed as well.
PATTERN_PROBES = (
    "",
    "Hello, world! It's 42 o'clock.\n\n  def f(x):\n\treturn x*2  \r\n",
    "汉字和中文 日本語のテキスト Ünïcödé façade — “quotes” 🙂 ١٢٣ \u00a0\u2028",
    "a",
    " ",
    "\n",
    "0123456789",
    "!?.,;:'\"()[]{}<>|/\\@#$%^&*_+=~`-",
)


def regular_file(path: Path, what: str) -> Path:
    """path, when it is a regular file (a symlink to one is fine); a FIFO or device would block a read
    or never end, and a directory is a mistake."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: {what} is not a regular file")
    return path


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        with open_regular(path, what) as f:  # checked on the open file: no window for a swap to a FIFO
            return f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None


def check_text(text: str, what: str = "the text") -> str:
    """text, when it is valid Unicode. The policy everywhere: a lone surrogate is refused with its
    character offset (it has no UTF-8 form, and replacing it would change what the user sent)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"{what} is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None
    return text


def decode_utf8(data: bytes, what: str, error: type[InputError] = InputError) -> str:
    """data as UTF-8 text, or one error (a CheckpointError for a model's file) with the offset of the
    first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _is_rust_panic(e: BaseException) -> bool:
    # pyo3 raises panics of the Rust libraries as PanicException, a BaseException with no import path
    return type(e).__name__ == "PanicException"


class Tokenizer:
    """encode(text) -> ids; decode(ids) -> text; a StreamDecoder yields text as whole characters."""

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    source: Path = Path("tokenizer")  # the file named in errors
    # the strings encode() reads as control tokens -> their ids (set by each tokenizer)
    special_tokens: dict[str, int]

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """ids of text; special=False reads special-token strings in it as ordinary text."""
        return self._encode(check_text(text), add_bos, special)

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """ids of the concatenated pieces, each (text, is_content): special-token strings are special
        tokens only in the pieces that are not content; content is always ordinary text. No BOS is added
        beyond what the pieces hold."""
        for text, _ in pieces:
            check_text(text)
        ids: list[int] = []
        for run in special_runs(pieces, self.special_tokens):
            if isinstance(run, int):
                ids.append(run)
            else:
                ids.extend(self._encode(run, False, special=False))
        return ids

    def _encode(self, text: str, add_bos: bool | None, special: bool) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def special_runs(pieces: list[tuple[str, bool]], specials: dict[str, int]) -> list[str | int]:
    """The pieces as runs of ordinary text (str) and special token ids (int). Special-token strings are
    found (leftmost, longest first) inside the non-content pieces alone, so one cannot begin in
    content; the text between two of them, content included, is one run, as a tokenizer splits a text
    at its special tokens and encodes what lies between."""
    finder = _special_finder(specials)
    runs: list[str | int] = []
    text: list[str] = []
    for piece, is_content in pieces:
        if is_content or finder is None:
            text.append(piece)
            continue
        pos = 0
        for m in finder.finditer(piece):
            text.append(piece[pos : m.start()])
            if "".join(text):
                runs.append("".join(text))
            text = []
            runs.append(specials[m.group()])
            pos = m.end()
        text.append(piece[pos:])
    if "".join(text):
        runs.append("".join(text))
    return runs


def _special_finder(specials: Iterable[str]) -> re.Pattern[str] | None:
    longest_first = sorted((s for s in specials if s), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first))) if longest_first else None


class StreamDecoder:
    """Incremental detokenization: feed ids, get the text they complete. Text that ends in an
    unfinished character (a replacement character) is held back until the next token completes it,
    and the concatenation of everything returned equals decode(all ids).

    Only a window at the end is decoded, never the whole reply (that cost grew with the reply: 1.3 ms a
    token at 2,000 tokens): the tokens of the last piece returned (`start`..`done`, context for decoders
    that treat a sequence's first token apart, such as SentencePiece's leading space) and those fed
    since. The new tokens' text is the window's text past the context's text. A window starts where a
    piece ended on a whole character, so the text is what decoding everything at once gives: for
    byte-level and tiktoken vocabularies always, for byte-fallback tokens whenever the reply is valid
    UTF-8 (the decoders of `tokenizers` render a token from it and the tokens before it, never after)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.start = 0  # the window's first token: the first of the last piece returned
        self.done = 0  # tokens whose text has been returned

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.done == len(self.ids):
            return ""
        context = self.tok.decode(self.ids[self.start : self.done]) if self.start < self.done else ""
        text = self.tok.decode(self.ids[self.start :])
        if text.endswith("\ufffd") and not final:
            return ""
        self.start, self.done = self.done, len(self.ids)
        return text[len(context) :]


# ---- tokenizer_config.json ---------------------------------------------------------------------


def check_config(cfg: Any, path: Path) -> dict[str, Any]:
    """tokenizer_config.json's fields this project reads, type-checked."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: corrupt tokenizer_config.json (not an object)")
    for key in ("bos_token", "eos_token"):
        v = cfg.get(key)
        content = v.get("content") if isinstance(v, dict) else v
        if not (content is None or isinstance(content, str)):
            raise CheckpointError(f"{path}: {key} must be a string or {{'content': string}}")
        if isinstance(content, str):
            check_text(content, f"{path}: {key}")
    if cfg.get("add_bos_token") not in (None, True, False):
        raise CheckpointError(f"{path}: add_bos_token must be true, false or null")
    if not isinstance(cfg.get("added_tokens_decoder") or {}, dict):
        raise CheckpointError(f"{path}: added_tokens_decoder must be an object of id -> token")
    return cfg


def _special_tokens(cfg: dict[str, Any], path: Path) -> dict[str, int]:
    """added_tokens_decoder as content -> id: ids are decimal integers, contents non-empty strings,
    neither repeated."""
    out: dict[str, int] = {}
    for sid, tok in (cfg.get("added_tokens_decoder") or {}).items():
        content = tok.get("content") if isinstance(tok, dict) else None
        if not isinstance(content, str) or not content:
            raise CheckpointError(f"{path}: added_tokens_decoder[{sid!r}] needs a non-empty 'content' string")
        check_text(content, f"{path}: added_tokens_decoder[{sid!r}]")
        if not (sid.isascii() and sid.isdigit() and len(sid) <= 10 and int(sid) <= MAX_RANK):
            raise CheckpointError(f"{path}: added_tokens_decoder id {sid!r} is not an integer in 0..{MAX_RANK}")
        if content in out:
            raise CheckpointError(f"{path}: special token {content!r} appears twice in added_tokens_decoder")
        out[content] = int(sid)
    if len(set(out.values())) != len(out):
        raise CheckpointError(f"{path}: added_tokens_decoder gives one id to two tokens")
    return out


def _token_id(cfg: dict[str, Any], key: str, specials: dict[str, int]) -> int | None:
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    if isinstance(v, str):
        return specials.get(v)
    return None


# ---- tokenizer.json ----------------------------------------------------------------------------


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path, cfg: dict[str, Any]):
        from tokenizers import Tokenizer as _Tok

        self.source = path
        data = decode_utf8(_read_bytes(path, "tokenizer.json"), f"{path}", CheckpointError)
        try:
            self.tok = _Tok.from_str(data)
            self._json = data
            vocab = self.tok.get_vocab(with_added_tokens=True)
            added = self.tok.get_added_tokens_decoder()
        except Exception as e:  # the library raises plain Exception on a bad file
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        except BaseException as e:
            if not _is_rust_panic(e):
                raise
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        self.special_tokens = {t.content: i for i, t in added.items() if t.special and t.content}
        self.bos_id = _token_id(cfg, "bos_token", vocab)
        eos = _token_id(cfg, "eos_token", vocab)
        self.eos_ids = (eos,) if eos is not None else ()
        self.add_bos_cfg: bool | None = cfg.get("add_bos_token")
        self.add_bos = bool(self.add_bos_cfg)

    @functools.cached_property
    def plain(self) -> Any:
        """A second instance that reads special-token strings as text: the flag is per instance, so
        threads encoding at once never see each other's setting. Made on first use (chat, server)."""
        from tokenizers import Tokenizer as _Tok

        tok = _Tok.from_str(self._json)  # loaded once already: it loads again
        tok.encode_special_tokens = True
        return tok

    def _run(self, tok: Any, text: str, add_special_tokens: bool) -> Any:
        try:
            return tok.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:
            raise InputError(f"{self.source}: cannot encode the text ({e})") from None
        except BaseException as e:
            if not _is_rust_panic(e):
                raise
            raise InputError(f"{self.source}: cannot encode the text ({e})") from None

    def _encode(self, text: str, add_bos: bool | None, special: bool) -> list[int]:
        ids: list[int] = self._run(self.tok if special else self.plain, text, True).ids
        want = self.add_bos_cfg if add_bos is None else add_bos
        if want is None:  # no word from tokenizer_config: the post-processor decides
            return ids
        has = bool(ids) and self.bos_id is not None and ids[0] == self.bos_id
        if want and not has and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        elif not want and has:
            ids = ids[1:]
        return ids

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """As Tokenizer.encode_pieces; when no content holds a special token the ids are those of the
        whole text encoded at once (as transformers encodes a rendered template), byte for byte."""
        for text, _ in pieces:
            check_text(text)
        whole = self._run(self.tok, "".join(t for t, _ in pieces), False)
        if not _special_in_content(whole.ids, whole.offsets, pieces, set(self.special_tokens.values())):
            return list(whole.ids)
        ids: list[int] = []
        for run in special_runs(pieces, self.special_tokens):
            ids.extend([run] if isinstance(run, int) else self._run(self.plain, run, False).ids)
        return ids

    def decode(self, ids: list[int]) -> str:
        try:
            text: str = self.tok.decode([int(i) for i in ids], skip_special_tokens=False)
        except Exception as e:
            raise InputError(f"{self.source}: cannot decode ids ({e})") from None
        return text


def _special_in_content(
    ids: list[int], offsets: list[tuple[int, int]], pieces: list[tuple[str, bool]], special_ids: set[int]
) -> bool:
    """Whether any special token among ids has its characters (offsets) in a content piece."""
    spans, pos = [], 0
    for text, is_content in pieces:
        if is_content and text:
            spans.append((pos, pos + len(text)))
        pos += len(text)
    return any(
        i in special_ids and any(start < end and a < end and start < b for start, end in spans)
        for i, (a, b) in zip(ids, offsets, strict=True)
    )


# ---- tiktoken.model ----------------------------------------------------------------------------


def _read_pattern(model_dir: Path) -> tuple[str, Path]:
    """pat_str from tokenization_*.py, parsed with ast: a string literal, a '|'.join([...]) of literals,
    or a concatenation of them; and the file it came from. The file is never executed."""
    for py in sorted(model_dir.glob("tokenization_*.py")):
        data = _read_bytes(py, "tokenizer code")
        try:
            with warnings.catch_warnings():  # an invalid escape in the file is not the user's concern
                warnings.simplefilter("ignore")
                tree = ast.parse(data.decode("utf-8"))
        except (UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # not the file that holds the pattern
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", None) for t in targets]
                if "pat_str" in names and node.value is not None:
                    try:
                        return _literal_str(node.value), py
                    except (ValueError, RecursionError):
                        continue
    raise CheckpointError(f"{model_dir}: tiktoken.model found but no pat_str in a tokenization_*.py")


def _literal_str(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_str(node.left) + _literal_str(node.right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.List | ast.Tuple)
    ):
        return _literal_str(node.func.value).join(_literal_str(e) for e in node.args[0].elts)
    raise ValueError("not a literal string expression")


def _check_pattern(pat: str, path: Path) -> Any:
    """pat_str compiled with `regex` (the syntax tiktoken's engine reads, set operations included), when it
    compiles and matches no empty text on the probes."""
    import regex

    try:
        check_text(pat, f"{path}: pat_str")
        compiled = regex.compile(pat, regex.V1)
    except (regex.error, InputError, ValueError, OverflowError, RecursionError) as e:
        raise CheckpointError(f"{path}: pat_str does not compile ({e})") from None
    try:
        empty = any(_empty_match(compiled, probe) is not None for probe in PATTERN_PROBES)
    except TimeoutError:
        raise CheckpointError(f"{path}: pat_str takes too long to match a short text") from None
    if empty:
        raise CheckpointError(f"{path}: pat_str matches empty text (it must match at least one character)")
    return compiled


def _empty_match(compiled: Any, text: str) -> int | None:
    """The offset of the first empty match of the pattern in text, or None (TimeoutError when matching
    takes longer than any real pattern would: catastrophic backtracking)."""
    for m in compiled.finditer(text, timeout=PATTERN_SECONDS):
        if m.start() == m.end():
            return int(m.start())
    return None


def _read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: one 'BASE64 RANK' a line; tokens and ranks unique, every byte a token (the encoder
    starts from single bytes), ranks below MAX_RANK and dense enough that most of 0..max are used."""
    ranks: dict[bytes, int] = {}
    used: set[int] = set()
    for n, line in enumerate(_read_bytes(path, "tiktoken.model").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise CheckpointError(f"{path}: line {n}: want 'BASE64-TOKEN RANK', got {len(fields)} fields")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointError(f"{path}: line {n}: the token is not base64") from None
        rank_text = fields[1]
        if not (rank_text.isdigit() and len(rank_text) <= 10 and int(rank_text) <= MAX_RANK):
            raise CheckpointError(f"{path}: line {n}: the rank is not an integer in 0..{MAX_RANK}")
        rank = int(rank_text)
        if not token:
            raise CheckpointError(f"{path}: line {n}: empty token")
        if token in ranks:
            raise CheckpointError(f"{path}: line {n}: token {token!r} appears twice")
        if rank in used:
            raise CheckpointError(f"{path}: line {n}: rank {rank} appears twice")
        ranks[token] = rank
        used.add(rank)
    if not ranks:
        raise CheckpointError(f"{path}: no tokens in tiktoken.model")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise CheckpointError(f"{path}: byte 0x{missing[0]:02x} has no token (every byte must have one)")
    if max(used) >= 2 * len(ranks):
        raise CheckpointError(f"{path}: ranks go up to {max(used)} for {len(ranks)} tokens (too sparse)")
    return ranks


class TiktokenTokenizer(Tokenizer):
    def __init__(self, model_dir: Path, cfg: dict[str, Any], cfg_path: Path):
        import tiktoken

        path = model_dir / "tiktoken.model"
        self.source = path
        ranks = _read_ranks(path)
        specials = _special_tokens(cfg, cfg_path)
        taken = sorted(set(specials.values()) & set(ranks.values()))
        if taken:
            raise CheckpointError(f"{cfg_path}: special token id {taken[0]} is also a rank in {path.name}")
        pat, pat_path = _read_pattern(model_dir)
        self.pattern = _check_pattern(pat, pat_path)
        try:
            self.enc = tiktoken.Encoding(
                name=model_dir.name, pat_str=pat, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as e:  # the engine's own regex compiler disagrees with `regex`
            raise CheckpointError(f"{pat_path}: pat_str does not compile ({e})") from None
        self.special_tokens = specials
        self.ranks = ranks  # token bytes -> id (the same dict tiktoken holds): structured output reads it
        self.pat_str = pat
        self._special_bytes = {v: k.encode() for k, v in specials.items()}
        self.bos_id = _token_id(cfg, "bos_token", specials)
        eos = _token_id(cfg, "eos_token", specials)
        self.eos_ids = (eos,) if eos is not None else ()
        self.add_bos = bool(cfg.get("add_bos_token", False))

    def _encode(self, text: str, add_bos: bool | None, special: bool) -> list[int]:
        try:
            at = _empty_match(self.pattern, text)
        except TimeoutError:
            raise InputError(f"{self.source}: the model's pat_str takes too long on this text") from None
        if at is not None:  # the engine would panic on the empty piece
            raise InputError(f"{self.source}: the model's pat_str matches empty text at character {at}")
        if special:
            ids: list[int] = self.enc.encode(text, allowed_special="all")
        else:
            ids = self.enc.encode(text, allowed_special=set(), disallowed_special=())
        want = self.add_bos if add_bos is None else add_bos
        if want and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        out = []
        for i in ids:
            if i in self._special_bytes:
                out.append(self._special_bytes[i])
            else:
                try:
                    out.append(self.enc.decode_single_token_bytes(i))
                except (KeyError, OverflowError, TypeError):
                    out.append(b"")
        return b"".join(out)


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model's tokenizer, or None when the directory has none (then only --ids work)."""
    cfg_path = model_dir / "tokenizer_config.json"
    cfg: Any = {}
    if cfg_path.exists():
        regular_file(cfg_path, "tokenizer_config.json")
        cfg = read_json(cfg_path, "tokenizer_config.json")
    cfg = check_config(cfg, cfg_path)
    if (model_dir / "tokenizer.json").exists():
        return HFTokenizer(model_dir / "tokenizer.json", cfg)
    if (model_dir / "tiktoken.model").exists():
        return TiktokenTokenizer(model_dir, cfg, cfg_path)
    return None
