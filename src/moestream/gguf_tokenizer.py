"""The tokenizer of a GGUF file, from its metadata: a byte-level BPE (`tokenizer.ggml.model` "gpt2") with
its vocabulary (`tokens`, ids in order), `merges`, token types (CONTROL tokens are special, USER_DEFINED
ones are added tokens) and the pre-tokenizer that `tokenizer.ggml.pre` names, rebuilt as a `tokenizers`
Tokenizer: the one the model's tokenizer.json describes, so ids equal the checkpoint's.

The pre-tokenizers are the split patterns of the models' own tokenizer.json (llama.cpp keeps the same
ones, some rewritten for its regex engine). A pre-tokenizer not listed here, or a tokenizer that is not
byte-level BPE (SentencePiece "llama", WordPiece "bert", ...), is refused naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError
from .tokenizer import HFTokenizer, _is_rust_panic

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_KIMI_K2 = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        + _CONTRACTIONS
        + "?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        + _CONTRACTIONS
        + "?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]  # each an isolating split, in order; () = GPT-2's own byte-level regex
    ignore_merges: bool = False  # a piece that is a whole token is that token (tiktoken, Llama 3)
    add_bos: bool = False  # when the GGUF does not say (llama.cpp's default for this pre-tokenizer)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer(()),
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "deepseek-v3": PreTokenizer(_DEEPSEEK3),
    "kimi-k2": PreTokenizer((_KIMI_K2,), ignore_merges=True),
}


class GGUFTokenizer(HFTokenizer):
    """HFTokenizer over a `tokenizers` Tokenizer built from a GGUF's metadata (no tokenizer.json)."""

    def __init__(self, store: Any):
        self.source = store.path
        meta: dict[str, Any] = store.metadata
        path = store.path

        def key(name: str, typ: type, default: Any = None) -> Any:
            v = meta.get(f"tokenizer.ggml.{name}", default)
            if v is not None and (not isinstance(v, typ) or (typ is int and isinstance(v, bool))):
                raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.{name} must be {typ.__name__}")
            return v

        model = key("model", str)
        if model != "gpt2":
            raise CheckpointError(
                f"{path}: GGUF tokenizer model {str(model)[:40]!r} is not supported (byte-level BPE, gpt2, is)"
            )
        pre_name = key("pre", str, "")
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            known = ", ".join(sorted(PRE_TOKENIZERS))
            raise CheckpointError(f"{path}: GGUF pre-tokenizer {pre_name[:40]!r} is not supported ({known} are)")
        tokens = _strings(key("tokens", list), path, "tokens")
        if not tokens:
            raise CheckpointError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
        types = key("token_type", list, [NORMAL] * len(tokens))
        if len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
            raise CheckpointError(f"{path}: tokenizer.ggml.token_type does not give one type per token")
        merges = []
        for m in _strings(key("merges", list), path, "merges"):
            at = m.find(" ", 1)
            if at < 0:
                raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {m[:40]!r} is not two tokens")
            merges.append((m[:at], m[at + 1 :]))
        self.tok = _build(tokens, types, merges, pre, path)
        self._json = self.tok.to_str()
        self.special_tokens = {t: i for i, t in enumerate(tokens) if types[i] == CONTROL and t}
        n = len(tokens)

        def token_id(name: str) -> int | None:
            v = key(f"{name}_token_id", int)
            if v is not None and not 0 <= v < n:
                raise CheckpointError(f"{path}: tokenizer.ggml.{name}_token_id {v} is outside the vocabulary")
            return v

        self.bos_id = token_id("bos")
        self.eos_ids = tuple(dict.fromkeys(i for i in (token_id(k) for k in ("eos", "eot", "eom")) if i is not None))
        add_bos = key("add_bos_token", bool)
        self.add_bos_cfg = pre.add_bos if add_bos is None else add_bos
        self.add_bos = bool(self.add_bos_cfg)


def _strings(v: list[Any] | None, path: Any, what: str) -> list[str]:
    if v is None:
        raise CheckpointError(f"{path}: GGUF metadata has no tokenizer.ggml.{what}")
    if not all(isinstance(s, str) for s in v):
        raise CheckpointError(f"{path}: tokenizer.ggml.{what} must be a list of strings")
    return v


def _build(tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: PreTokenizer, path: Any) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token string encodes as its first id
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
        if pre.splits:
            splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.splits]
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        added = [
            AddedToken(t, special=types[i] == CONTROL, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] in (CONTROL, USER_DEFINED) and t and vocab[t] == i
        ]
        tok.add_special_tokens([t for t in added if t.special])
        tok.add_tokens([t for t in added if not t.special])
    except CheckpointError:
        raise
    except Exception as e:  # the library raises plain Exception on a bad vocabulary or merge
        raise CheckpointError(f"{path}: cannot build the GGUF tokenizer ({str(e)[:200]})") from None
    except BaseException as e:
        if not _is_rust_panic(e):
            raise
        raise CheckpointError(f"{path}: cannot build the GGUF tokenizer ({str(e)[:200]})") from None
    return tok


def gguf_tokenizer(store: Any) -> GGUFTokenizer | None:
    """The tokenizer of a GGUFStore (generate.load calls this for a .gguf source); None when the file has
    no vocabulary (then only ids work, as for a checkpoint without tokenizer files)."""
    if "tokenizer.ggml.model" not in store.metadata and "tokenizer.ggml.tokens" not in store.metadata:
        return None
    return GGUFTokenizer(store)
