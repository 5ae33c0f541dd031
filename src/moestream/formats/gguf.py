"""GGUF files (llama.cpp's format) as a tensor store the model builders use unchanged: the GGUF's
metadata becomes an HF-style config (one function per architecture), its tensor names become ours (one
table per architecture, GGUF_NAMES), and every matrix is a Weight over the file's memory map in its
stored block format (the GGUF block layouts are ours byte for byte: quant/blocks.py).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; the
metadata as (string key, u32 type, value); the tensor infos as (string name, u32 n_dims, u64 dims
[innermost first], u32 GGML type, u64 offset in the data region); padding to general.alignment (32);
the data region. The header is walked here, with the `gguf` package's type tables, rather than by its
GGUFReader: every count is checked against the bytes left before it is used (the reader loops on a
count of 2^60 one-byte values past the end of the file), every tensor must lie inside its file without
overlapping another, and a 150k-token vocabulary parses in a fraction of a second.

Stacked routed experts (`blk.N.ffn_{gate,up,down}_exps.weight`, [E, rows, cols]) become per-expert
matrices that are views of the map, so a budgeted run reads each expert's bytes from its own offset in
the file. Three things are copies made at load, which therefore cannot be streamed under --ram (for
routed experts; the trunk is fine): llama's q/k rows (the converter permutes them for llama.cpp's rope:
un-permuted here), DeepSeek's kv_b_proj when the file splits it into attn_k_b (transposed per head) and
attn_v_b, and MXFP4, whose 17-byte blocks (an E8M0 scale then 16 bytes of nibbles) are split into our
nibble and scale arrays (a GGUF with MXFP4 experts runs under --ram only after `moestream pack`).

A split GGUF (`name-00001-of-0000N.gguf`) is opened from its first part; the parts' tensors together are
the model, the first part's metadata describes it.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from ..config import MAX_LAYERS
from ..errors import CheckpointError, InputError
from ..quant import FORMATS, Weight
from ..quant.formats import MXFP4_BLOCK
from .checkpoint import TensorStore
from .safetensors import MappedFile, TensorInfo, open_regular

MAX_TENSORS = 1 << 24
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: llama.cpp writes none; a bound keeps a hostile header shallow
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
MAX_PARTS = 9999

# GGML type -> our format (quant/formats.py FORMATS); every other type is refused naming it
GGML_FORMATS: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "f32",
    GGMLQuantizationType.F16: "f16",
    GGMLQuantizationType.BF16: "bf16",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q6_K: "q6_k",
    GGMLQuantizationType.Q3_K: "q3_k",
    GGMLQuantizationType.Q2_K: "q2_k",
    GGMLQuantizationType.TQ1_0: "tq1_0",
    GGMLQuantizationType.TQ2_0: "tq2_0",
    GGMLQuantizationType.MXFP4: "mxfp4",
}
FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16),
}


def _check_block_sizes() -> None:
    """Our block layouts are ggml's: the same elements and bytes per block (MXFP4 differs only in where
    the scale byte lies, which load-time conversion handles)."""
    for t, name in GGML_FORMATS.items():
        block, nbytes = GGML_QUANT_SIZES[t]
        f = FORMATS[name]
        ours = (f.block, f.block_bytes + (1 if name == "mxfp4" else 0))
        if t not in FLOAT_DTYPES and ours != (block, nbytes):
            raise ImportError(f"GGUF block size mismatch for {t.name}: ggml {(block, nbytes)}, ours {ours}")


_check_block_sizes()


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether path is a regular file that starts with the GGUF magic."""
    try:
        if not os.path.isfile(path):  # before opening: a FIFO would block the open
            return False
        with open(path, "rb") as f:
            return f.read(4) == struct.pack("<I", GGUF_MAGIC)
    except (OSError, ValueError):
        return False


# ---- the file: header, metadata, tensor infos -------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first): the GGUF dims reversed
    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def _f32_value(v: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (1e-06, not 9.99999997e-07):
    the value its config.json had, so that a GGUF and its checkpoint compute the same bits."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


class _Cursor:
    """Reads the header from a memory map, refusing any read past the end of the file."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt GGUF header ({why})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(
                f"{self.path}: truncated GGUF file ({what} at byte {self.pos} runs past the end, {self.size} bytes)"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 at byte {e.start}") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype], what)
            return _f32_value(v) if vtype == GGUFValueType.FLOAT32 else v
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {MAX_NESTING}")
        itype = self.scalar("<I", what)
        count = self.scalar("<Q", what)
        if itype in _SCALARS:
            size = struct.calcsize(_SCALARS[itype])
            self.need(count * size, what)
            if count == 0:
                return []
            arr = np.frombuffer(self.buf, np.dtype(_SCALARS[itype]), count, self.pos).copy()
            self.pos += count * size
            if itype == GGUFValueType.FLOAT32:
                return [_f32_value(x) for x in arr.tolist()]
            return arr.tolist()
        if itype not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            raise self.fail(f"{what} is an array of unknown value type {itype}")
        self.need(count * (8 if itype == GGUFValueType.STRING else 12), what)  # each item at least its header
        return [self.value(itype, what, depth + 1) for _ in range(count)]


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and tensor infos of one GGUF file, each tensor checked to lie inside the file, no two
    overlapping, every type one ggml defines."""
    try:
        with open_regular(path, "GGUF file") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes, no header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path), path, size)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None


def _parse(c: _Cursor, path: Path, size: int) -> GGUFFile:
    magic = c.scalar("<I", "magic")
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (bad magic {struct.pack('<I', magic)!r})")
    version = c.scalar("<I", "version")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.scalar("<Q", "tensor count")
    n_kv = c.scalar("<Q", "metadata count")
    if n_tensors > MAX_TENSORS:
        raise c.fail(f"{n_tensors} tensors")
    c.need(n_kv * 12, "metadata")  # key length + type, at the least
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string("metadata key")
        vtype = c.scalar("<I", f"type of {key[:100]}")
        if key in metadata:
            raise c.fail(f"metadata key {key[:100]!r} appears twice")
        metadata[key] = c.value(vtype, f"metadata {key[:100]}")
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise c.fail(f"general.alignment {alignment!r} is not a power of two")
    c.need(n_tensors * 24, "tensor infos")
    infos = []
    for _ in range(n_tensors):
        name = c.string("tensor name")
        n_dims = c.scalar("<I", f"tensor {name[:100]}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name[:100]} has {n_dims} dimensions")
        dims = [c.scalar("<Q", f"tensor {name[:100]}") for _ in range(n_dims)]
        raw_type = c.scalar("<I", f"tensor {name[:100]}")
        offset = c.scalar("<Q", f"tensor {name[:100]}")
        infos.append((name, dims, raw_type, offset))
    data_start = -(-c.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in infos:
        tensors[name] = _tensor(path, name, dims, raw_type, offset, data_start, alignment, size)
    if len(tensors) != len(infos):
        raise c.fail("a tensor name appears twice")
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {first} and {second} overlap in the file")
    return GGUFFile(path, metadata, tensors)


def _tensor(
    path: Path, name: str, dims: list[int], raw_type: int, offset: int, data_start: int, alignment: int, size: int
) -> GGUFTensor:
    try:
        gtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name[:200]} has unknown GGML type {raw_type}") from None
    block, type_size = GGML_QUANT_SIZES[gtype]
    if any(d >= 1 << 40 for d in dims) or math.prod(dims) >= 1 << 50:
        raise CheckpointError(f"{path}: tensor {name[:200]} has impossible dimensions {dims}")
    if dims[0] % block:
        raise CheckpointError(
            f"{path}: tensor {name[:200]} rows of {dims[0]} are not whole {gtype.name} blocks of {block}"
        )
    nbytes = math.prod(dims) // block * type_size
    if offset % alignment:
        raise CheckpointError(f"{path}: tensor {name[:200]} data offset {offset} is not {alignment}-aligned")
    begin = data_start + offset
    if begin + nbytes > size:
        raise CheckpointError(
            f"{path}: tensor {name[:200]} lies outside the file (ends at byte {begin + nbytes}, file has {size}); "
            "the file is truncated"
        )
    return GGUFTensor(name, gtype, tuple(reversed(dims)), path, begin, nbytes)


def split_parts(path: Path, first: GGUFFile) -> list[Path]:
    """The files of a split GGUF, given its first part (split.count in its metadata), else [path]."""
    count = first.metadata.get("split.count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PARTS:
        raise CheckpointError(f"{path}: split.count {count!r} is not a number of files")
    m = SPLIT_NAME.match(path.name)
    if count == 1:
        if m is not None and int(m["count"]) > 1:
            raise CheckpointError(f"{path}: named as one of {int(m['count'])} parts, but its split.count is 1")
        return [path]
    if m is None:
        raise CheckpointError(f"{path}: split into {count} files, but not named NAME-00001-of-{count:05d}.gguf")
    if int(m["no"]) != 1:
        raise InputError(f"{path}: part {int(m['no'])} of a split GGUF; give the first part (-00001-of-...)")
    if int(m["count"]) != count:
        raise CheckpointError(f"{path}: named as one of {int(m['count'])} parts, but its split.count is {count}")
    suffix = path.name[-5:]  # keep the case of ".gguf" as given
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}{suffix}") for i in range(1, count + 1)]


# ---- the name tables --------------------------------------------------------------------------------

# One table per architecture: GGUF name <-> ours (the checkpoint's). "{i}" is the layer, "{e}" the expert
# of a stacked tensor [E, rows, cols]. A GGUF name without a row is ignored (llama.cpp's extras:
# rope_freqs, DeepSeek's multi-token-prediction layers). How: "" the tensor as it is; "experts" one
# matrix per expert, views; "rope_q" / "rope_k" rows un-permuted (llama's converter permutes them).
Row = tuple[str, str, str]

_GQA: list[Row] = [
    ("token_embd.weight", "model.embed_tokens.weight", ""),
    ("output_norm.weight", "model.norm.weight", ""),
    ("output.weight", "lm_head.weight", ""),
    ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", ""),
    ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight", ""),
    ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", ""),
]

GGUF_NAMES: dict[str, list[Row]] = {
    "qwen3moe": [
        *_GQA,
        *[
            (f"blk.{{i}}.attn_{x}.{p}", f"model.layers.{{i}}.self_attn.{x}_proj.{p}", "")
            for x in "qkv"
            for p in ("weight", "bias")
        ],
        ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", ""),
        ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", ""),
        ("blk.{i}.ffn_gate_inp.weight", "model.layers.{i}.mlp.gate.weight", ""),
        ("blk.{i}.ffn_gate_exps.weight", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "experts"),
        ("blk.{i}.ffn_up_exps.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight", "experts"),
        ("blk.{i}.ffn_down_exps.weight", "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "experts"),
        ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", ""),
        ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", ""),
        ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", ""),
    ],
    # llama with experts: Mixtral
    "llama": [
        *_GQA,
        ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", "rope_q"),
        ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight", "rope_k"),
        ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight", ""),
        ("blk.{i}.ffn_gate_inp.weight", "model.layers.{i}.block_sparse_moe.gate.weight", ""),
        ("blk.{i}.ffn_gate_exps.weight", "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "experts"),
        ("blk.{i}.ffn_up_exps.weight", "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "experts"),
        ("blk.{i}.ffn_down_exps.weight", "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "experts"),
    ],
    # DeepSeek-V3/R1, Kimi K2. attn_k_b + attn_v_b (newer converters) are joined into kv_b_proj by
    # _join_kv_b; they have no row of their own.
    "deepseek2": [
        *_GQA,
        ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", ""),
        ("blk.{i}.attn_q_a.weight", "model.layers.{i}.self_attn.q_a_proj.weight", ""),
        ("blk.{i}.attn_q_a_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight", ""),
        ("blk.{i}.attn_q_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight", ""),
        ("blk.{i}.attn_kv_a_mqa.weight", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", ""),
        ("blk.{i}.attn_kv_a_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight", ""),
        ("blk.{i}.attn_kv_b.weight", "model.layers.{i}.self_attn.kv_b_proj.weight", ""),
        ("blk.{i}.ffn_gate_inp.weight", "model.layers.{i}.mlp.gate.weight", ""),
        ("blk.{i}.exp_probs_b.bias", "model.layers.{i}.mlp.gate.e_score_correction_bias", ""),
        ("blk.{i}.ffn_gate_exps.weight", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "experts"),
        ("blk.{i}.ffn_up_exps.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight", "experts"),
        ("blk.{i}.ffn_down_exps.weight", "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "experts"),
        ("blk.{i}.ffn_gate_shexp.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight", ""),
        ("blk.{i}.ffn_up_shexp.weight", "model.layers.{i}.mlp.shared_experts.up_proj.weight", ""),
        ("blk.{i}.ffn_down_shexp.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight", ""),
        ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", ""),
        ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", ""),
        ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", ""),
    ],
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


# ---- the config of each architecture ----------------------------------------------------------------


class _Meta:
    """Typed access to an architecture's metadata keys ({arch}.KEY), with errors naming the key."""

    def __init__(self, metadata: dict[str, Any], arch: str, path: Path):
        self.d, self.arch, self.path = metadata, arch, path

    def get(self, key: str, typ: type, default: Any = None, required: bool = False) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        v = self.d.get(full)
        if v is None:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata has no {full}")
            return default
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise CheckpointError(f"{self.path}: GGUF metadata {full} must be {typ.__name__}, got {str(v)[:60]}")
        return v

    def req_int(self, key: str) -> int:
        v: int = self.get(key, int, required=True)
        return v


def _common(m: _Meta, store: GGUFStore, model_type: str) -> dict[str, Any]:
    embed = store.gguf_tensor("token_embd.weight")
    layers = m.req_int("block_count")
    if not 0 < layers <= MAX_LAYERS:  # checked here too: the name mapping walks the layers
        raise CheckpointError(f"{m.path}: GGUF metadata {m.arch}.block_count {layers} is not a number of layers")
    eos = [m.get(f"tokenizer.ggml.{k}_token_id", int) for k in ("eos", "eot", "eom")]
    return {
        "model_type": model_type,
        "vocab_size": embed.shape[0],
        "hidden_size": m.req_int("embedding_length"),
        "num_hidden_layers": layers,
        "rms_norm_eps": m.get("attention.layer_norm_rms_epsilon", float, required=True),
        "tie_word_embeddings": "output.weight" not in store.gguf_tensors,
        "max_position_embeddings": m.get("context_length", int, 4096),
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", int),
        "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
        "hidden_act": "silu",
        "num_attention_heads": m.req_int("attention.head_count"),
        "rope_theta": m.get("rope.freq_base", float, 10000.0),
    }


def _rope(m: _Meta, cfg: dict[str, Any]) -> None:
    """rope.scaling.* as transformers' rope_scaling (linear or YaRN)."""
    kind = m.get("rope.scaling.type", str, "none")
    if kind == "none":
        return
    factor = m.get("rope.scaling.factor", float, required=True)
    if kind == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        return
    if kind != "yarn":
        raise CheckpointError(f"{m.path}: rope scaling {kind!r} is not supported (linear and yarn are)")
    scaling = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": m.get("rope.scaling.original_context_length", int, required=True),
        "beta_fast": m.get("rope.scaling.yarn_beta_fast", float, 32.0),
        "beta_slow": m.get("rope.scaling.yarn_beta_slow", float, 1.0),
    }
    attn = m.get("rope.scaling.yarn_attn_factor", float)
    if attn is not None:
        scaling["attention_factor"] = attn
    # DeepSeek: the converter writes 0.1 * mscale_all_dim; llama.cpp's graph assumes mscale equals it
    log_mul = m.get("rope.scaling.yarn_log_multiplier", float)
    if log_mul is not None:
        mscale = _f32_value(log_mul / 0.1)
        scaling["mscale"] = scaling["mscale_all_dim"] = mscale
    cfg["rope_scaling"] = scaling


def _experts_shape(store: GGUFStore, m: _Meta) -> tuple[int, int]:
    return m.req_int("expert_count"), m.req_int("expert_used_count")


def _qwen3moe_config(m: _Meta, store: GGUFStore) -> dict[str, Any]:
    cfg = _common(m, store, "qwen3_moe")
    n, k = _experts_shape(store, m)
    moe_inter = m.req_int("expert_feed_forward_length")
    heads = cfg["num_attention_heads"]
    cfg.update(
        num_key_value_heads=m.get("attention.head_count_kv", int, heads),
        head_dim=m.get("attention.key_length", int, cfg["hidden_size"] // max(1, heads)),
        num_experts=n,
        num_experts_per_tok=k,
        moe_intermediate_size=moe_inter,
        intermediate_size=m.get("feed_forward_length", int, moe_inter),
        norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises the top-k weights
        # dense layers, if any, are the ones without routed experts
        mlp_only_layers=[
            i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in store.gguf_tensors
        ],
        attention_bias="blk.0.attn_q.bias" in store.gguf_tensors,
        sliding_window=m.get("attention.sliding_window", int),
        use_sliding_window=m.get("attention.sliding_window", int) is not None,
    )
    _rope(m, cfg)
    return cfg


def _llama_config(m: _Meta, store: GGUFStore) -> dict[str, Any]:
    n = m.get("expert_count", int, 0)
    if not n:
        raise CheckpointError(
            f"{m.path}: a llama GGUF without experts is a dense model; moestream runs llama with experts (Mixtral)"
        )
    cfg = _common(m, store, "mixtral")
    heads = cfg["num_attention_heads"]
    head_dim = m.get("attention.key_length", int, cfg["hidden_size"] // max(1, heads))
    if m.get("rope.dimension_count", int, head_dim) != head_dim:
        raise CheckpointError(f"{m.path}: partial rotary embeddings (rope.dimension_count) are not supported")
    cfg.update(
        num_key_value_heads=m.get("attention.head_count_kv", int, heads),
        head_dim=head_dim,
        num_local_experts=n,
        num_experts_per_tok=m.req_int("expert_used_count"),
        intermediate_size=m.get("expert_feed_forward_length", int) or m.req_int("feed_forward_length"),
        sliding_window=m.get("attention.sliding_window", int),
    )
    _rope(m, cfg)
    return cfg


# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2


def _deepseek2_config(m: _Meta, store: GGUFStore) -> dict[str, Any]:
    gating = m.get("expert_gating_func", int, GATING_SOFTMAX)  # absent: llama.cpp's DeepSeek-V2 default
    if gating != GATING_SIGMOID:
        raise CheckpointError(
            f"{m.path}: deepseek2 with expert_gating_func {gating} (softmax: DeepSeek-V2) is not supported; "
            "moestream runs the sigmoid router of DeepSeek-V3/R1 and Kimi K2"
        )
    cfg = _common(m, store, "deepseek_v3")
    n, k = _experts_shape(store, m)
    rope_dim = m.req_int("rope.dimension_count")
    # Newer converters describe MLA as MQA over the latent (key_length = kv_lora_rank + rope) and keep
    # the per-head sizes in the _mla keys; older files have the per-head sizes in key/value_length.
    key_len = m.get("attention.key_length_mla", int) or m.req_int("attention.key_length")
    value_len = m.get("attention.value_length_mla", int) or m.req_int("attention.value_length")
    q_a = store.gguf_tensors.get("blk.0.attn_q_a.weight")  # q LoRA is there when its tensors are
    q_lora = (m.get("attention.q_lora_rank", int) or q_a.shape[0]) if q_a is not None else None
    cfg.update(
        num_key_value_heads=cfg["num_attention_heads"],
        q_lora_rank=q_lora,
        kv_lora_rank=m.req_int("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_len - rope_dim,
        v_head_dim=value_len,
        intermediate_size=m.req_int("feed_forward_length"),
        moe_intermediate_size=m.req_int("expert_feed_forward_length"),
        n_routed_experts=n,
        num_experts_per_tok=k,
        n_shared_experts=m.get("expert_shared_count", int, 0),
        first_k_dense_replace=m.get("leading_dense_block_count", int, 0),
        n_group=m.get("expert_group_count", int, 1) or 1,
        topk_group=m.get("expert_group_used_count", int, 1) or 1,
        norm_topk_prob=m.get("expert_weights_norm", bool, False),
        routed_scaling_factor=m.get("expert_weights_scale", float, 1.0) or 1.0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_interleave=True,
        attention_bias=False,
    )
    _rope(m, cfg)
    return cfg


CONFIGS: dict[str, Callable[[_Meta, GGUFStore], dict[str, Any]]] = {
    "qwen3moe": _qwen3moe_config,
    "llama": _llama_config,
    "deepseek2": _deepseek2_config,
}


# ---- the store --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """One of our tensors: where its bytes are, and how they become it."""

    source: GGUFTensor
    shape: tuple[int, ...]  # ours ([rows, cols] for a matrix)
    how: str = ""  # as a table row's, or "kv_b" (joined from source and `other`)
    expert: int | None = None
    other: GGUFTensor | None = None
    heads: int = 0  # rope_q / rope_k: heads whose rows are un-permuted


class GGUFStore(TensorStore):
    """A GGUF file (or a split one, given its first part) with our tensor names and an HF-style config."""

    def __init__(self, path: str | os.PathLike[str], preload: bool = False):
        self.path = Path(path)
        self.preload = preload
        if not self.path.exists():
            raise InputError(f"GGUF file {self.path} does not exist")
        if self.path.is_dir():
            raise InputError(f"{self.path} is a directory, not a GGUF file")
        first = read_gguf(self.path)
        files = [first] + [self._part(p, i) for i, p in enumerate(split_parts(self.path, first)[1:], 2)]
        self.metadata = first.metadata
        self.gguf_tensors: dict[str, GGUFTensor] = {}
        for f in files:
            for name, t in f.tensors.items():
                if name in self.gguf_tensors:
                    raise CheckpointError(f"{f.path}: tensor {name} appears in two parts of the split GGUF")
                self.gguf_tensors[name] = t
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or arch not in CONFIGS:
            known = ", ".join(sorted(CONFIGS))
            raise CheckpointError(f"{self.path}: GGUF architecture {str(arch)[:60]!r} is not supported ({known} are)")
        self.arch = arch
        self.config: dict[str, Any] = CONFIGS[arch](_Meta(self.metadata, arch, self.path), self)
        template = self.metadata.get("tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._entries = self._map_names()
        self.tensors: dict[str, TensorInfo] = {name: _info(name, e) for name, e in self._entries.items()}
        self._maps: dict[Path, MappedFile] = {}

    def _part(self, path: Path, no: int) -> GGUFFile:
        if not path.exists():
            raise CheckpointError(f"{path}: part {no} of the split GGUF {self.path.name} is missing")
        f = read_gguf(path)
        if f.metadata.get("split.no", no - 1) != no - 1:
            raise CheckpointError(f"{path}: split.no {f.metadata.get('split.no')!r}, expected {no - 1}")
        return f

    def gguf_tensor(self, name: str) -> GGUFTensor:
        try:
            return self.gguf_tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing GGUF tensor {name}") from None

    # ---- names ----------------------------------------------------------------------------------

    def _map_names(self) -> dict[str, _Entry]:
        rows = {g: (h, how) for g, h, how in GGUF_NAMES[self.arch]}
        heads = self.config.get("num_attention_heads", 0)
        kv_heads = self.config.get("num_key_value_heads", heads)
        out: dict[str, _Entry] = {}
        for name, t in self.gguf_tensors.items():
            m = _LAYER.match(name)
            key = f"blk.{{i}}.{m[2]}" if m else name
            if key not in rows:
                continue  # llama.cpp's extras (rope_freqs, multi-token prediction, k_b / v_b: joined below)
            hf, how = rows[key]
            if m:
                hf = hf.replace("{i}", m[1])
            if how == "experts":
                if len(t.shape) != 3:
                    raise CheckpointError(f"{self.path}: tensor {name} is not stacked experts [E, rows, cols]")
                for e in range(t.shape[0]):
                    out[hf.replace("{e}", str(e))] = _Entry(t, t.shape[1:], how, expert=e)
                continue
            shape = t.shape if len(t.shape) == 1 else (math.prod(t.shape[:-1]), t.shape[-1])
            out[hf] = _Entry(t, shape, how, heads=heads if how == "rope_q" else kv_heads if how == "rope_k" else 0)
        if self.arch == "deepseek2":
            self._join_kv_b(out)
        return out

    def _join_kv_b(self, out: dict[str, _Entry]) -> None:
        """Newer converters store kv_b_proj as attn_k_b [H, kv_lora_rank, nope] (each head's block
        transposed, for llama.cpp's absorbed MLA) and attn_v_b [H, v_head_dim, kv_lora_rank]."""
        c = self.config
        H, C = c["num_attention_heads"], c["kv_lora_rank"]
        N, V = c["qk_nope_head_dim"], c["v_head_dim"]
        for i in range(c["num_hidden_layers"]):
            hf = f"model.layers.{i}.self_attn.kv_b_proj.weight"
            k_b, v_b = (self.gguf_tensors.get(f"blk.{i}.attn_{x}_b.weight") for x in "kv")
            if hf in out or k_b is None or v_b is None:
                continue
            for t, want in ((k_b, (H, C, N)), (v_b, (H, V, C))):
                if t.shape != want:
                    raise CheckpointError(
                        f"{self.path}: tensor {t.name} has shape {list(t.shape)}, the metadata implies {list(want)}"
                    )
            out[hf] = _Entry(k_b, (H * (N + V), C), "kv_b", other=v_b, heads=H)

    # ---- the TensorStore protocol ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.gguf_tensors.values())

    def has(self, name: str) -> bool:
        return name in self._entries

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self._entries if n.startswith(prefix)]

    def _entry(self, name: str, shape: tuple[int, ...] | None) -> _Entry:
        self.checked(name, shape)
        return self._entries[name]

    def _bytes(self, t: GGUFTensor, expert: int | None = None) -> np.ndarray:
        """The tensor's bytes (one expert's, of stacked experts) as a uint8 view of the file's map."""
        mf = self._maps.get(t.path)
        if mf is None:
            mf = self._maps[t.path] = MappedFile(t.path, self.preload)
        raw = mf.map[t.offset : t.offset + t.nbytes]
        if expert is not None:
            per = t.nbytes // t.shape[0]
            raw = raw[expert * per : (expert + 1) * per]
        return raw

    def matrix(self, name: str, rows: int, cols: int) -> Weight:
        """The [rows, cols] matrix in its stored format, over the file's bytes (a copy only for the
        conversions the module docstring lists)."""
        e = self._entry(name, (rows, cols))
        if e.how == "kv_b":
            return self._kv_b(e)
        w = self._weight(e.source, self._bytes(e.source, e.expert), rows, cols)
        if e.how in ("rope_q", "rope_k"):
            w = _unpermute(w, e.heads)
        return w

    def array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A vector (norms, biases) or other tensor as an array: a view for float types, dequantized
        otherwise."""
        e = self._entry(name, shape)
        if e.how or (len(e.shape) != 1 and e.source.type not in FLOAT_DTYPES):
            return self.matrix(name, *e.shape).dequantize()
        if e.source.type not in FLOAT_DTYPES:
            return self._weight(e.source, self._bytes(e.source), 1, e.shape[0]).dequantize().reshape(e.shape)
        return self._bytes(e.source, e.expert).view(FLOAT_DTYPES[e.source.type]).reshape(e.shape)

    def mapped_files(self) -> list[tuple[Path, np.ndarray]]:
        """Every file the model's tensors were taken from, with its whole-file memory map (the tensors are
        views of these: a budgeted run reads the routed experts' ranges from the files themselves)."""
        return [(path, mf.map) for path, mf in self._maps.items()]

    # ---- formats --------------------------------------------------------------------------------

    def _weight(self, t: GGUFTensor, raw: np.ndarray, rows: int, cols: int) -> Weight:
        fmt = GGML_FORMATS.get(t.type)
        if fmt is None:
            supported = ", ".join(x.name for x in GGML_FORMATS)
            raise CheckpointError(
                f"{self.path}: tensor {t.name} is {t.type.name}, a type moestream does not multiply ({supported} are)"
            )
        if t.type in FLOAT_DTYPES:
            return Weight(raw.view(FLOAT_DTYPES[t.type]).reshape(rows, cols))
        if fmt == "mxfp4":
            return self._mxfp4(t, raw, rows, cols)
        return Weight(raw.reshape(rows, -1), fmt=fmt)

    def _mxfp4(self, t: GGUFTensor, raw: np.ndarray, rows: int, cols: int) -> Weight:
        """ggml's MXFP4 blocks (E8M0 scale byte, then 16 bytes: element j in the low nibble of byte j and
        element j + 16 in its high nibble) as our split arrays (nibbles of columns 2k, 2k+1 in byte k; one
        scale byte per 32 columns). A copy: see the module docstring."""
        blocks = raw.reshape(rows, cols // MXFP4_BLOCK, 17)
        scales = np.ascontiguousarray(blocks[:, :, 0])
        if np.any(scales == 255):
            raise CheckpointError(f"{self.path}: tensor {t.name} has an E8M0 scale of 255 (NaN in the OCP spec)")
        qs = blocks[:, :, 1:]
        nib = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # element order
        packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        return Weight(packed, scales, fmt="mxfp4")

    def _kv_b(self, e: _Entry) -> Weight:
        """kv_b_proj [H * (nope + v), C] from attn_k_b and attn_v_b: per head, k_b's block transposed then
        v_b's rows. Float files keep their type; otherwise the exact dequantized values as f32."""
        assert e.other is not None
        k_t, v_t = e.source, e.other
        H, C, N = k_t.shape
        V = v_t.shape[1]
        k = self._weight(k_t, self._bytes(k_t), H * C, N)
        v = self._weight(v_t, self._bytes(v_t), H * V, C)
        same_float = k_t.type == v_t.type and k_t.type in FLOAT_DTYPES
        kd = k.data if same_float else k.dequantize()
        vd = v.data if same_float else v.dequantize()
        joined = np.concatenate([kd.reshape(H, C, N).transpose(0, 2, 1), vd.reshape(H, V, C)], axis=1)
        return Weight(np.ascontiguousarray(joined.reshape(H * (N + V), C)))


def _unpermute(w: Weight, heads: int) -> Weight:
    """Rows of q_proj / k_proj back in the checkpoint's order: llama's converter writes each head's rows
    as (pairs, 2) -> (2, pairs) interleaved for llama.cpp's rope; whole rows move, so any format works."""
    rows = w.rows
    if heads <= 0 or rows % (2 * heads):
        raise CheckpointError(f"cannot un-permute {rows} rows over {heads} heads")
    half = rows // heads // 2
    order = np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)
    data = np.ascontiguousarray(w.data[order])
    return Weight(data, fmt=w.fmt.name) if w.fmt.name not in ("f32", "f16", "bf16") else Weight(data)


def _info(name: str, e: _Entry) -> TensorInfo:
    t = e.source
    if e.expert is not None:
        per = t.nbytes // t.shape[0]
        return TensorInfo(name, t.type.name, e.shape, t.path, t.offset + e.expert * per, per)
    nbytes = t.nbytes + (e.other.nbytes if e.other is not None else 0)
    return TensorInfo(name, t.type.name, e.shape, t.path, t.offset, nbytes)
