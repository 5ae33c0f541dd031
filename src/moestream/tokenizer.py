"""Tokenizers of real checkpoints: tokenizer.json through `tokenizers`, or tiktoken.model through
`tiktoken` with the pre-tokenizer pattern read (never executed) from the model's tokenization_*.py and
special tokens from tokenizer_config.json. BOS is added as tokenizer_config.json says."""

from __future__ import annotations

import ast
import base64
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .formats.checkpoint import read_json


class Tokenizer:
    """encode(text) -> ids; decode(ids) -> text; a StreamDecoder yields text as whole characters."""

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenization: feed ids, get the text they complete. Text that ends in an
    unfinished character (a replacement character) is held back until the next token completes it,
    and the concatenation of everything returned equals decode(all ids)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.emitted = 0

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.emitted :]
        self.emitted = len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        new = text[self.emitted :]
        self.emitted = len(text)
        return new


def _special_tokens(cfg: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for sid, tok in (cfg.get("added_tokens_decoder") or {}).items():
        content = tok.get("content") if isinstance(tok, dict) else None
        if isinstance(content, str):
            out[content] = int(sid)
    return out


def _token_id(cfg: dict[str, Any], key: str, specials: dict[str, int]) -> int | None:
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    if isinstance(v, str):
        return specials.get(v)
    return None


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path, cfg: dict[str, Any]):
        from tokenizers import Tokenizer as _Tok

        try:
            self.tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises plain Exception on a bad file
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        specials = {k: v for k, v in self.tok.get_vocab(with_added_tokens=True).items()}
        self.bos_id = _token_id(cfg, "bos_token", specials)
        eos = _token_id(cfg, "eos_token", specials)
        self.eos_ids = (eos,) if eos is not None else ()
        self.add_bos_cfg: bool | None = cfg.get("add_bos_token")
        self.add_bos = bool(self.add_bos_cfg)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids: list[int] = self.tok.encode(text, add_special_tokens=True).ids
        want = self.add_bos_cfg if add_bos is None else add_bos
        if want is None:  # no word from tokenizer_config: the post-processor decides
            return ids
        has = bool(ids) and self.bos_id is not None and ids[0] == self.bos_id
        if want and not has and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        elif not want and has:
            ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.tok.decode([int(i) for i in ids], skip_special_tokens=False)
        return text


def _read_pattern(model_dir: Path) -> str:
    """pat_str from tokenization_*.py, parsed with ast: a string literal, a '|'.join([...]) of literals,
    or a concatenation of them. The file is never executed."""
    for py in sorted(model_dir.glob("tokenization_*.py")):
        try:
            tree = ast.parse(py.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", None) for t in targets]
                if "pat_str" in names and node.value is not None:
                    try:
                        return _literal_str(node.value)
                    except ValueError:
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


class TiktokenTokenizer(Tokenizer):
    def __init__(self, model_dir: Path, cfg: dict[str, Any]):
        import tiktoken

        path = model_dir / "tiktoken.model"
        ranks: dict[bytes, int] = {}
        n = 0
        try:
            for n, line in enumerate(path.read_bytes().splitlines(), 1):  # noqa: B007 (n is in the message)
                if not line.strip():
                    continue
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{path}: corrupt tiktoken.model (line {n}: {e})") from None
        specials = _special_tokens(cfg)
        self.enc = tiktoken.Encoding(
            name=model_dir.name,
            pat_str=_read_pattern(model_dir),
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._specials = specials
        self._special_bytes = {v: k.encode() for k, v in specials.items()}
        self.bos_id = _token_id(cfg, "bos_token", specials)
        eos = _token_id(cfg, "eos_token", specials)
        self.eos_ids = (eos,) if eos is not None else ()
        self.add_bos = bool(cfg.get("add_bos_token", False))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids: list[int] = self.enc.encode(text, allowed_special="all")
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
                except KeyError:
                    out.append(b"")
        return b"".join(out)


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model's tokenizer, or None when the directory has none (then only --ids work)."""
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = read_json(cfg_path, "tokenizer_config.json") if cfg_path.exists() else {}
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: corrupt tokenizer_config.json (not an object)")
    if (model_dir / "tokenizer.json").exists():
        return HFTokenizer(model_dir / "tokenizer.json", cfg)
    if (model_dir / "tiktoken.model").exists():
        return TiktokenTokenizer(model_dir, cfg)
    return None
