"""The packed store (`moestream pack`): a checkpoint rewritten once for streaming.

    DST/manifest.json   what is where: every tensor's file, offset, bytes, dtype or format, CRC-32C
                        (and one CRC-32C per expert blob, which the expert cache checks on every read)
    DST/trunk.bin       everything but the routed experts, each layer's tensors contiguous, 4096-aligned
    DST/experts.bin     one 4096-aligned blob per (layer, expert): gate, up and down together
    DST/config.json and the tokenizer files, copied

Matrices may be requantized on the way (--experts / --trunk FORMAT; `keep` leaves a tensor in its
checkpoint format; `q4_k_m` is llama.cpp's Q4_K_M mix); vectors (norms, biases, convolutions) are always
kept as they are.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import stat
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from .. import _C
from ..errors import CheckpointError, InputError, IntegrityError
from ..ordered_map import ordered_map
from ..quant import FORMATS, Weight, blocks
from ..quant.formats import FP8_BLOCK, quantize_fp8_reference, quantize_int4_reference, quantize_mxfp4_reference
from .checkpoint import Checkpoint, TensorStore, read_json
from .safetensors import DTYPE_NAMES, DTYPES, MappedFile, TensorInfo

MANIFEST = "manifest.json"
# 2: CRC-32C per entry and per expert blob (version 1 had zlib CRC32 per entry and none per blob)
VERSION = 2
ALIGN = 4096
PACK_FORMATS = [
    "keep",
    "f32",
    "bf16",
    "f16",
    "fp8",
    "q8_0",
    "q6_k",
    "q4_k",
    "q3_k",
    "q2_k",
    "tq2_0",
    "tq1_0",
    "mxfp4",
    "int4",
    "q4_k_m",
]
# Mixes: a name that resolves per matrix to a format, as llama.cpp's file types do. q4_k_m is its Q4_K_M:
# q4_k, with q6_k for the output matrix and for attention V and FFN down in the layers use_more_bits picks.
MIXES = {"q4_k_m": ("q4_k", "q6_k")}
_MORE_BITS = re.compile(r"(v_proj|down_proj|\.w2)(\.|$)")


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def resolve_format(fmt: str, name: str, n_layers: int, head: bool) -> str:
    """The format a matrix gets under `fmt` (a format, or a mix); head: the matrix is the output matrix
    (lm_head, or the embedding when it is tied)."""
    if fmt not in MIXES:
        return fmt
    base, more = MIXES[fmt]
    if head:
        return more
    m = _LAYER.search(name)
    if m and _MORE_BITS.search(name) and _use_more_bits(int(m.group(1)), n_layers):
        return more
    return base


# the numpy dtype of a float format's stored elements
FLOAT_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "fp8": ml_dtypes.float8_e4m3fn}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "generation_config.json")
_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_experts" not in name


def is_router(name: str) -> bool:
    """MoE routers stay as they are (as llama.cpp keeps them): a small change there flips expert choices."""
    return name.endswith(".gate.weight")


@dataclass
class Matrix:
    """A logical weight matrix of the source: its tensors and how to read it as a Weight."""

    name: str  # the name the architecture asks for (X.weight, or X for an MXFP4 pair)
    tensors: list[str]  # source tensors that hold it
    rows: int
    cols: int


class _MatrixProbe:
    """Wraps a checkpoint and records which names the architecture's builder multiplies with (asks for
    as matrices); everything else it reads as plain tensors, which a pack keeps."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.path, self.config, self.tensors = ckpt.path, ckpt.config, ckpt.tensors
        self.asked: set[str] = set()

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def info(self, name: str) -> TensorInfo:
        return self.ckpt.info(name)

    def array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        return self.ckpt.array(name, shape)

    def matrix(self, name: str, rows: int, cols: int) -> None:
        self.asked.add(name)


def find_matrices(ckpt: Checkpoint) -> tuple[dict[str, Matrix], list[str]]:
    """Splits the checkpoint into the matrices the model multiplies with (2-D float weights, fp8 with
    scales, MXFP4 pairs) and the other tensors, which are always kept."""
    from .. import models

    probe = _MatrixProbe(ckpt)
    models.build(probe, models.read_spec(ckpt.config))  # type: ignore[arg-type]
    matrices: dict[str, Matrix] = {}
    used: set[str] = set()
    for name, info in ckpt.tensors.items():
        if name not in probe.asked and name.removesuffix(".weight_packed") not in probe.asked:
            continue
        if name.endswith(".weight_packed") and info.dtype == "U8":
            prefix = name.removesuffix(".weight_packed")
            scale = prefix + ".weight_scale"
            if ckpt.has(scale):
                matrices[prefix] = Matrix(prefix, [name, scale], info.shape[0], info.shape[1] * 2)
                used.update((name, scale))
        elif is_gguf_store(ckpt):  # every matrix the builder asks for, whatever its block format
            matrices[name] = Matrix(name, [name], info.shape[0], info.shape[1])
            used.add(name)
        elif name.endswith(".weight") and len(info.shape) == 2 and info.dtype in ("F32", "BF16", "F16", "F8_E4M3"):
            tensors = [name]
            inv = name.removesuffix("weight") + "weight_scale_inv"
            if info.dtype == "F8_E4M3" and ckpt.has(inv):
                tensors.append(inv)
            matrices[name] = Matrix(name, tensors, info.shape[0], info.shape[1])
            used.update(tensors)
    others = [n for n in ckpt.tensors if n not in used]
    return matrices, others


def is_gguf_store(ckpt: Any) -> bool:
    return getattr(ckpt, "gguf_tensors", None) is not None


def open_source(src: Path) -> Any:
    """What pack reads: a checkpoint directory, or a GGUF file (the first part of a split one)."""
    from .gguf import GGUFStore, is_gguf

    return GGUFStore(src) if is_gguf(src) else Checkpoint(src)


def source_weight(ckpt: Checkpoint, m: Matrix) -> Weight:
    if is_gguf_store(ckpt):
        return ckpt.matrix(m.name, m.rows, m.cols)  # type: ignore[attr-defined]
    if len(m.tensors) == 2 and m.tensors[0].endswith(".weight_packed"):
        return Weight(ckpt.array(m.tensors[0]), ckpt.array(m.tensors[1]), fmt="mxfp4")
    scales = ckpt.array(m.tensors[1]).astype(np.float32) if len(m.tensors) == 2 else None
    return Weight(ckpt.array(m.tensors[0]), scales)


def quantize(fmt: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """f32 [rows, cols] -> (data, scales) of a pack format."""
    if fmt == "fp8":
        return quantize_fp8_reference(w)
    if fmt in FLOAT_DTYPES:
        return w.astype(FLOAT_DTYPES[fmt]), None
    if fmt == "mxfp4":
        return quantize_mxfp4_reference(w)
    if fmt == "int4":
        packed, scale = quantize_int4_reference(w)
        return packed.view(np.uint8), scale
    return blocks.quantize(fmt, w), None


# bytes of f32 source rows that conversions may hold at once
CONVERT_BUDGET = 1 << 30
# row chunks a conversion thread may run ahead of the writes (those converted wait as their packed bytes)
CONVERT_AHEAD = 8
# a requantized matrix converts in chunks of about this many elements (64 MB as f32), whole multiples of
# 128 rows (fp8's scale blocks): every format quantizes rows (fp8: 128-row blocks) on their own, so the
# chunks give the bytes of the whole
CHUNK_ELEMENTS = 1 << 24

# (name, its matrix or None for a tensor copied as it is, rows [r0, r1) of a requantized matrix or None)
_Piece = tuple[str, Matrix | None, tuple[int, int] | None]


def chunk_rows(cols: int) -> int:
    return max(FP8_BLOCK, CHUNK_ELEMENTS // cols // FP8_BLOCK * FP8_BLOCK)


@dataclass
class _Converted:
    """Rows of a matrix in their pack format, and (for --report) their squared error and squared norm."""

    data: np.ndarray
    scales: np.ndarray | None
    sq_err: float
    sq: float
    finite: bool = True  # every source value is finite (no NaN or Inf)


def _convert(ckpt: Checkpoint, m: Matrix, rows: tuple[int, int], fmt: str, measure: bool) -> _Converted:
    """Rows [r0, r1) of m in fmt (r0 a multiple of FP8_BLOCK)."""
    src = source_weight(ckpt, m)
    if fmt == src.fmt.name and is_gguf_store(ckpt):  # a GGUF's matrix kept: its bytes as they are
        data = np.ascontiguousarray(src.data[rows[0] : rows[1]])
        scales = None if src.scales is None else np.ascontiguousarray(src.scales[rows[0] : rows[1]])
        return _Converted(data, scales, 0.0, 0.0, all_finite(data))
    original = (src if rows == (0, m.rows) else src.row_slice(*rows)).dequantize()  # [r1 - r0, cols] f32
    data, scales = quantize(fmt, original)
    sq_err = sq = 0.0
    if measure:
        back = Weight(np.ascontiguousarray(data).reshape(rows[1] - rows[0], -1), scales, fmt=fmt).reference()
        sq_err = float(np.sum((back.astype(np.float64) - original) ** 2))
        sq = float(np.sum(original.astype(np.float64) ** 2))
    return _Converted(data, scales, sq_err, sq, all_finite(original))


def all_finite(arr: np.ndarray) -> bool:
    """Whether a tensor has no NaN or Inf (always true of integer and packed tensors), looked at in runs of
    CHUNK_ELEMENTS so that the mask stays small however large the tensor."""
    if arr.dtype.kind in "iub":
        return True
    flat = arr.reshape(-1)
    return all(np.isfinite(flat[i : i + CHUNK_ELEMENTS]).all() for i in range(0, flat.size, CHUNK_ELEMENTS))


def _refuse_nonfinite(ckpt: Checkpoint, name: str) -> None:
    raise InputError(
        f"pack: {ckpt.path}: tensor {name} has NaN or Inf values (--allow-nonfinite packs them as they are)"
    )


def fits(fmt: str, cols: int) -> bool:
    return fmt == "keep" or cols % FORMATS[fmt].block == 0


def _group_key(name: str) -> tuple[int, int]:
    """Layer order: the embedding first, layers in order, the rest (final norm, head) last."""
    m = _LAYER.search(name)
    if m:
        return (1, int(m.group(1)))
    return (0, 0) if "embed" in name else (2, 0)


class _Writer:
    def __init__(self, path: Path):
        self.f = open(path, "wb")
        self.pos = 0
        self.run_crc = 0  # CRC-32C of what was written since the last align() (an expert blob's bytes)

    def align(self) -> None:
        pad = -self.pos % ALIGN
        if pad:
            self.f.write(b"\0" * pad)
            self.pos += pad
        self.run_crc = 0

    def write(self, arr: np.ndarray, crc: int = 0) -> tuple[int, int, int]:
        """Appends arr's bytes: (offset, bytes, CRC-32C continuing crc, the CRC of the bytes before them)."""
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data  # its bytes, not a copy of them
        off = self.pos
        self.f.write(raw)
        self.pos += raw.nbytes
        self.run_crc = _C.crc32c(raw, self.run_crc)
        return off, raw.nbytes, _C.crc32c(raw, crc)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def tensor_class(name: str) -> str:
    if is_router(name):
        return "router"
    if is_routed_expert(name):
        return "routed experts"
    if "shared_expert" in name:
        return "shared experts"
    if "self_attn" in name:
        return "attention"
    if "embed" in name:
        return "embedding"
    if "lm_head" in name:
        return "lm_head"
    if ".mlp." in name or "block_sparse_moe" in name:
        return "dense / latent MLP"
    return "other"


@dataclass
class Report:
    """Quantization error of a pack: per tensor class, sum of squared errors and of squares."""

    sq_err: dict[str, float]
    sq: dict[str, float]
    formats: dict[str, set[str]]

    def rows(self) -> list[tuple[str, str, float]]:
        return [
            (c, ",".join(sorted(self.formats[c])), math.sqrt(self.sq_err[c] / self.sq[c]) if self.sq[c] else 0.0)
            for c in sorted(self.sq)
        ]


def pack(
    src: Path,
    dst: Path,
    experts: str = "keep",
    trunk: str = "keep",
    force: bool = False,
    progress: bool | None = None,
    report: Report | None = None,
    threads: int | None = None,
    allow_nonfinite: bool = False,
) -> Path:
    """Writes the packed store of src to dst (see the module docstring); threads: how many row chunks of
    requantized matrices convert at once (default: one per core); the store is the same for any count. A
    float tensor with NaN or Inf is refused (InputError) unless allow_nonfinite."""
    for what, fmt in (("--experts", experts), ("--trunk", trunk)):
        if fmt not in PACK_FORMATS:
            raise InputError(f"pack: {what} {fmt!r} is not a format (choose from {', '.join(PACK_FORMATS)})")
    from ..atomic import atomic_dir, refuse_overlap

    src, dst = Path(src), Path(dst)
    refuse_overlap(dst, [src], "pack")  # replacing dst must never delete the checkpoint it is made from
    if dst.exists() and not force:
        raise InputError(f"pack: {dst} exists (use --force to replace it)")
    ckpt = open_source(src)
    matrices, others = find_matrices(ckpt)  # also refuses an unsupported or inconsistent model

    n_layers = 1 + max((int(x.group(1)) for x in map(_LAYER.search, matrices) if x), default=0)
    tied = not any("lm_head" in n for n in matrices)
    native: dict[str, str] = {}

    def kept(m: Matrix) -> str:
        """A checkpoint's tensors are kept as they are; a GGUF's matrix is kept in its block format (as a
        matrix of the store: the store has no tensor type for a block format)."""
        if not is_gguf_store(ckpt):
            return "keep"
        if m.name not in native:
            native[m.name] = source_weight(ckpt, m).fmt.name
        return native[m.name]

    def target(m: Matrix) -> str:
        if is_router(m.name):
            return kept(m)
        head = "lm_head" in m.name or (tied and "embed" in m.name)
        fmt = resolve_format(experts if is_routed_expert(m.name) else trunk, m.name, n_layers, head)
        return fmt if fmt != "keep" and fits(fmt, m.cols) else kept(m)

    def out_bytes(m: Matrix) -> int:
        fmt = target(m)
        if fmt == "keep":
            return sum(ckpt.info(t).nbytes for t in m.tensors)
        f = FORMATS[fmt]
        extra = {"mxfp4": 1, "int4": 4}.get(fmt, 0) * m.rows * (m.cols // 32)
        return m.rows * (m.cols // f.block) * f.block_bytes + extra

    need = sum(out_bytes(m) for m in matrices.values()) + sum(ckpt.info(n).nbytes for n in others)
    need += ALIGN * (len(matrices) + len(others))
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if need > free:
        raise InputError(f"pack: {dst.parent} has {free / 1e9:.2f} GB free, the packed store needs {need / 1e9:.2f} GB")

    from ..generate import default_threads  # generate imports this module

    n_threads = default_threads() if threads is None else max(1, threads)
    with atomic_dir(dst, protect=[src], what="pack") as tmp:
        manifest = _write(
            ckpt, tmp, matrices, others, target, progress, experts, trunk, report, n_threads, allow_nonfinite
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if is_gguf_store(ckpt):
            _write_gguf_companions(ckpt, tmp)
        else:
            shutil.copy(src / "config.json", tmp / "config.json")
            for f in [*TOKENIZER_FILES, *(p.name for p in Path(src).glob("tokenization_*.py"))]:
                if (Path(src) / f).exists():
                    shutil.copy(Path(src) / f, tmp / f)
        verify(tmp, n_threads)
    return dst


def _write_gguf_companions(store: Any, out: Path) -> None:
    """A GGUF's config, tokenizer and chat template as the files a checkpoint directory has, so that the
    packed store loads as any other: config.json, tokenizer.json, tokenizer_config.json."""
    from ..gguf_tokenizer import gguf_tokenizer

    config = dict(store.config)
    tok = gguf_tokenizer(store)
    if tok is not None:  # every end-of-text id the GGUF names (eos, eot, eom) stops generation as before
        given = config.get("eos_token_id")
        ids = [given] if isinstance(given, int) else list(given or [])
        config["eos_token_id"] = list(dict.fromkeys([*ids, *tok.eos_ids]))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tok is None:
        return
    (out / "tokenizer.json").write_text(tok._json)
    cfg: dict[str, Any] = {"add_bos_token": bool(tok.add_bos)}
    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_ids[0] if tok.eos_ids else None)):
        if i is not None:
            cfg[key] = tok.tok.id_to_token(i)
    cfg["added_tokens_decoder"] = {str(i): {"content": t, "special": True} for t, i in tok.special_tokens.items()}
    if store.chat_template is not None:
        cfg["chat_template"] = store.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False))


def _write(
    ckpt: Checkpoint,
    tmp: Path,
    matrices: dict[str, Matrix],
    others: list[str],
    target: Callable[[Matrix], str],
    progress: bool | None,
    experts_fmt: str,
    trunk_fmt: str,
    report: Report | None,
    threads: int,
    allow_nonfinite: bool = False,
) -> dict[str, Any]:
    writers = {"trunk": _Writer(tmp / "trunk.bin"), "experts": _Writer(tmp / "experts.bin")}
    tensors: dict[str, Any] = {}
    mats: dict[str, Any] = {}
    blobs: dict[str, Any] = {}

    def put_raw(w: _Writer, name: str) -> None:
        info = ckpt.info(name)
        arr = ckpt.array(name)
        if not allow_nonfinite and not all_finite(arr):
            _refuse_nonfinite(ckpt, name)
        off, n, crc = w.write(arr)
        tensors[name] = {
            "file": "trunk" if w is writers["trunk"] else "experts",
            "offset": off,
            "nbytes": n,
            "dtype": info.dtype,
            "shape": list(info.shape),
            "crc32c": crc,
        }

    def start_matrix(m: Matrix) -> str:
        fmt = target(m)
        if report is not None:
            cls = tensor_class(m.name)
            report.formats.setdefault(cls, set()).add(fmt)
            report.sq_err.setdefault(cls, 0.0)
            report.sq.setdefault(cls, 0.0)
        return fmt

    # the requantized matrix being written: its manifest entry and its scales so far (they follow the data)
    current: dict[str, Any] = {}

    def put_piece(w: _Writer, m: Matrix, rows: tuple[int, int], conv: _Converted) -> bool:
        """Writes rows [r0, r1) of a requantized matrix after the rows before them; True once it is whole."""
        if rows[0] == 0:
            current.clear()
            current["entry"] = {
                "file": "trunk" if w is writers["trunk"] else "experts",
                "format": start_matrix(m),
                "rows": m.rows,
                "cols": m.cols,
                "offset": w.pos,
                "nbytes": 0,
                "crc32c": 0,
                "scales": None,
            }
            current["scales"] = []
        entry = current["entry"]
        _, n, entry["crc32c"] = w.write(conv.data, entry["crc32c"])
        entry["nbytes"] += n
        if conv.scales is not None:
            current["scales"].append(conv.scales)
        if report is not None:  # summed in the rows' order, whatever thread converted them
            cls = tensor_class(m.name)
            report.sq_err[cls] += conv.sq_err
            report.sq[cls] += conv.sq
        if rows[1] < m.rows:
            return False
        if current["scales"]:
            scales = np.concatenate(current["scales"])
            soff, sn, scrc = w.write(scales)
            entry["scales"] = {
                "offset": soff,
                "nbytes": sn,
                "dtype": DTYPE_NAMES[scales.dtype],
                "shape": list(scales.shape),
                "crc32c": scrc,
            }
        mats[m.name] = entry
        return True

    trunk_items = [(n, None) for n in others] + [(m.name, m) for m in matrices.values() if not is_routed_expert(m.name)]
    trunk_items.sort(key=lambda it: _group_key(it[0]))
    expert_items = [m for m in matrices.values() if is_routed_expert(m.name)]
    expert_items.sort(key=lambda m: (_group_key(m.name), int(_EXPERT.search(m.name).group(1))))  # type: ignore[union-attr]
    bar = tqdm(
        total=len(trunk_items) + len(expert_items),
        desc="pack",
        unit="tensor",
        disable=None if progress is None else not progress,
    )

    def pieces(name: str, m: Matrix | None) -> list[_Piece]:
        """A requantized matrix in row chunks (each converts on its own, so that memory stays bounded
        however large the matrix); anything else whole."""
        if m is None or target(m) == "keep":
            return [(name, m, None)]
        step = chunk_rows(m.cols)
        return [(name, m, (r0, min(m.rows, r0 + step))) for r0 in range(0, m.rows, step)]

    trunk_pieces = [p for name, m in trunk_items for p in pieces(name, m)]
    items = trunk_pieces + [p for m in expert_items for p in pieces(m.name, m)]

    def convert(item: _Piece) -> _Converted | None:
        _, m, rows = item
        return None if m is None or rows is None else _convert(ckpt, m, rows, target(m), report is not None)

    def cost(item: _Piece) -> int:  # the f32 copy of the source rows a conversion holds
        _, m, rows = item
        return 0 if m is None or rows is None else (rows[1] - rows[0]) * m.cols * 4

    # row chunks convert `threads` at a time, ahead of the writes, which stay in order; while a write waits
    # on the disk the threads go on, up to CONVERT_AHEAD chunks a thread or the budget
    converted = ordered_map(convert, items, threads, cost, CONVERT_BUDGET, CONVERT_AHEAD * threads)

    def put(w: _Writer, piece: _Piece, conv: _Converted | None) -> None:
        name, m, rows = piece
        if conv is not None and not conv.finite and not allow_nonfinite:
            _refuse_nonfinite(ckpt, name)
        if m is None:
            put_raw(w, name)
        elif rows is None or conv is None:  # kept as it is
            start_matrix(m)
            for t in m.tensors:
                put_raw(w, t)
        elif not put_piece(w, m, rows, conv):
            return  # more rows to come
        bar.update(1)

    w = writers["trunk"]
    group = None
    for piece, conv in itertools.islice(converted, len(trunk_pieces)):
        name, _, rows = piece
        if (rows is None or rows[0] == 0) and _group_key(name) != group:
            group = _group_key(name)
            w.align()
        put(w, piece, conv)
    w = writers["experts"]
    key = None
    for piece, conv in converted:
        name, _, rows = piece
        if rows is None or rows[0] == 0:
            layer = _LAYER.search(name)
            k = f"{layer.group(1) if layer else '?'}.{_EXPERT.search(name).group(1)}"  # type: ignore[union-attr]
            if k != key:
                if key is not None:
                    blobs[key]["nbytes"] = w.pos - blobs[key]["offset"]
                    blobs[key]["crc32c"] = w.run_crc
                w.align()
                key = k
                blobs[k] = {"offset": w.pos, "nbytes": 0}
        put(w, piece, conv)
    if key is not None:
        blobs[key]["nbytes"] = w.pos - blobs[key]["offset"]
        blobs[key]["crc32c"] = w.run_crc
    bar.close()
    for wr in writers.values():
        wr.align()
        wr.close()
    return {
        "format": "moestream-packed",
        "version": VERSION,
        "experts_format": experts_fmt,
        "trunk_format": trunk_fmt,
        "files": {"trunk": "trunk.bin", "experts": "experts.bin"},
        "tensors": tensors,
        "matrices": mats,
        "expert_blobs": blobs,
    }


def verify(path: Path, threads: int = 1) -> None:
    """Re-reads every entry and expert blob of a packed store and checks its CRC-32C, straight from the
    mapped files (no copy of an entry, so memory stays flat however large a tensor), `threads` entries at
    a time (crc32c lets go of the GIL). The first bad entry in manifest order is the one named."""
    store = PackedStore(path)
    checks = store.entries()

    def reads_back(check: tuple[str, dict[str, Any]]) -> bool:
        return store.crc_ok(check[1])

    for (name, _), good in ordered_map(reads_back, checks, threads, lambda _: 0, 1):
        if not good:
            raise CheckpointError(f"{path}: {name} does not read back as written")


U32 = 1 << 32
# what an entry of each kind holds besides file, offset, nbytes and crc32c
_ENTRY_KEYS = {"tensor": ("dtype", "shape"), "matrix": ("format", "rows", "cols", "scales"), "blob": ()}
_BLOB_KEY = re.compile(r"(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})")


def _is_int(v: Any, low: int = 0, high: int = 1 << 62) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < high


def _plain_file_name(name: Any) -> bool:
    """A name of a file in the directory itself: no separator, not . or .., no NUL, encodable."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\0" in name:
        return False
    try:
        name.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _shape_bytes(shape: Any, dtype: Any) -> int | None:
    """The bytes of a tensor of this shape and dtype, or None if either is not one."""
    if not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(shape, list) or len(shape) > 8:
        return None
    if not all(_is_int(d, 0, 1 << 40) for d in shape):
        return None
    return math.prod(shape) * DTYPES[dtype].itemsize


class _ManifestCheck:
    """Validates a parsed manifest where it is read: every field's type and range, every entry inside its
    file, shapes that multiply out to the sizes, known formats and dtypes, file names that stay in the
    store directory and name regular files. Any fault is one CheckpointError naming the manifest."""

    def __init__(self, path: Path, doc: Any):
        self.where = path / MANIFEST
        if not isinstance(doc, dict) or doc.get("format") != "moestream-packed":
            self.fail("not a moestream packed store manifest")
        if doc.get("version") == 1:
            self.fail("a version-1 packed store (no checksum per expert blob): repack it with this moestream")
        if doc.get("version") != VERSION:
            self.fail(f"not a moestream packed store of version {VERSION}")
        self.doc = doc
        self.sizes = self.files(path, doc.get("files"))

    def fail(self, why: str) -> Any:
        raise CheckpointError(f"{self.where}: {why}")

    def files(self, path: Path, files: Any) -> dict[str, int]:
        """file key -> its size; a key whose file is missing has size -1 (refused if an entry lies in it)."""
        if not isinstance(files, dict) or set(files) != {"trunk", "experts"}:
            self.fail("'files' must map trunk and experts to file names")
        sizes = {}
        for key, name in files.items():
            if not _plain_file_name(name):
                self.fail(f"file name {name!r} of {key} is not a plain file name in the store directory")
            try:
                st = os.stat(path / name)  # not opened: a FIFO would block a read
            except FileNotFoundError:
                sizes[key] = -1
                continue
            except OSError as e:
                self.fail(f"cannot stat {name}: {e.strerror}")
            if not stat.S_ISREG(st.st_mode):
                self.fail(f"{name} is not a regular file")
            sizes[key] = st.st_size
        return sizes

    def section(self, key: str, kind: str) -> dict[str, Any]:
        sec = self.doc.get(key, {} if kind == "blob" else None)
        if not isinstance(sec, dict):
            self.fail(f"'{key}' must be an object")
        for name, e in sec.items():
            if kind == "blob" and not _BLOB_KEY.fullmatch(name):
                self.fail(f"expert blob key {name!r} is not LAYER.EXPERT")
            self.entry(name, e, kind)
        return sec

    def span(self, name: str, e: Any, file: Any) -> None:
        """offset, nbytes and crc32c of an entry (or of its scales), inside its file."""
        if not isinstance(e, dict):
            self.fail(f"entry {name} must be an object")
        if not isinstance(file, str) or file not in self.sizes:
            self.fail(f"entry {name} names file {file!r}, not one of {sorted(self.sizes)}")
        off, n, crc = e.get("offset"), e.get("nbytes"), e.get("crc32c")
        if not _is_int(off) or not _is_int(n) or not _is_int(crc, 0, U32):
            self.fail(f"entry {name} needs integer offset, nbytes and crc32c (a 32-bit value)")
        size = self.sizes[file]
        if off + n > max(size, 0):
            what = "is missing" if size < 0 else f"has {size} bytes"
            self.fail(f"entry {name} reaches byte {off + n} of {file}, which {what} (truncated?)")

    def entry(self, name: str, e: Any, kind: str) -> None:
        file = "experts" if kind == "blob" else e.get("file") if isinstance(e, dict) else None
        self.span(name, e, file)
        if any(k not in e for k in _ENTRY_KEYS[kind]):
            self.fail(f"entry {name} needs {', '.join(_ENTRY_KEYS[kind])}")
        if kind == "tensor" and _shape_bytes(e["shape"], e["dtype"]) != e["nbytes"]:
            self.fail(f"tensor {name}: shape {e['shape']!r} of {e['dtype']!r} does not make {e['nbytes']} bytes")
        if kind == "matrix":
            self.matrix(name, e)

    def matrix(self, name: str, e: dict[str, Any]) -> None:
        fmt, rows, cols = e["format"], e["rows"], e["cols"]
        if not isinstance(fmt, str) or fmt not in FORMATS:
            self.fail(f"matrix {name} has unknown format {fmt!r}")
        f = FORMATS[fmt]
        if not _is_int(rows, 1, 1 << 40) or not _is_int(cols, 1, 1 << 40) or cols % f.block:
            self.fail(f"matrix {name}: {rows!r} x {cols!r} is not a size of {fmt}")
        if rows * (cols // f.block) * f.block_bytes != e["nbytes"]:
            self.fail(f"matrix {name}: {rows} x {cols} {fmt} does not make {e['nbytes']} bytes")
        s = e["scales"]
        if s is None:
            return
        self.span(f"{name} (scales)", s, e["file"])
        if _shape_bytes(s.get("shape"), s.get("dtype")) != s["nbytes"]:
            self.fail(f"matrix {name}: its scales' shape and dtype do not make {s['nbytes']} bytes")


class PackedStore(TensorStore):
    """Reads a packed store with the same interface as Checkpoint (has / info / array), plus matrix()
    for requantized matrices. The manifest is validated as it is read (_ManifestCheck); crc_ok checks an
    entry's bytes against it."""

    def __init__(self, path: str | Path, preload: bool = False):
        self.path = Path(path)
        self.preload = preload
        check = _ManifestCheck(self.path, read_json(self.path / MANIFEST, "manifest.json"))
        tensors, matrices = check.section("tensors", "tensor"), check.section("matrices", "matrix")
        blobs = check.section("expert_blobs", "blob")
        self.manifest: dict[str, Any] = {**check.doc, "tensors": tensors, "matrices": matrices, "expert_blobs": blobs}
        config = read_json(self.path / "config.json", "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{self.path}/config.json: corrupt config.json (not a JSON object)")
        self.config: dict[str, Any] = config
        self.maps: dict[str, np.ndarray] = {}
        for key, fname in self.manifest["files"].items():
            size = check.sizes[key]
            self.maps[key] = self._map(self.path / fname, preload) if size > 0 else np.zeros(0, np.uint8)
        self.tensors = {
            n: TensorInfo(
                n,
                e["dtype"],
                tuple(e["shape"]),
                self.path / self.manifest["files"][e["file"]],
                e["offset"],
                e["nbytes"],
            )
            for n, e in tensors.items()
        }

    @staticmethod
    def _map(path: Path, preload: bool) -> np.ndarray:
        arr = MappedFile(path, preload).map
        guard_map(arr, path)
        return arr

    @property
    def nbytes(self) -> int:
        return sum(int(m.size) for m in self.maps.values())

    def _bytes(self, e: dict[str, Any]) -> np.ndarray:
        return self.maps[e.get("file", "experts")][e["offset"] : e["offset"] + e["nbytes"]]

    def entries(self) -> list[tuple[str, dict[str, Any]]]:
        """Every checksummed range in manifest order: tensors, matrices and their scales (with their file),
        expert blobs (named "expert blob L.E")."""
        out: list[tuple[str, dict[str, Any]]] = list(self.manifest["tensors"].items())
        for name, e in self.manifest["matrices"].items():
            out.append((name, e))
            if e["scales"]:
                out.append((name, {**e["scales"], "file": e["file"]}))
        out += [(f"expert blob {k}", {**b, "file": "experts"}) for k, b in self.manifest["expert_blobs"].items()]
        return out

    def crc_ok(self, e: dict[str, Any]) -> bool:
        """Whether the entry's bytes (in the map) have the CRC-32C the manifest gives them."""
        return bool(_C.crc32c(self._bytes(e)) == e["crc32c"])

    def check_entry(self, e: dict[str, Any]) -> None:
        """IntegrityError unless the entry's bytes have their CRC-32C."""
        if not checks_enabled() or self.crc_ok(e):
            return
        raise IntegrityError(mismatch(self.path / self.manifest["files"][e.get("file", "experts")], e))

    def has(self, name: str) -> bool:
        return name in self.tensors or name in self.manifest["matrices"]

    def array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        info = self.checked(name, shape)
        e = self.manifest["tensors"][name]
        return self._bytes(e).view(DTYPES[info.dtype]).reshape(info.shape)

    def matrix(self, name: str, rows: int, cols: int) -> Weight | None:
        """The requantized matrix `name` as a Weight, or None if it was kept (then read it by array)."""
        e = self.manifest["matrices"].get(name)
        if e is None:
            return None
        if (e["rows"], e["cols"]) != (rows, cols):
            raise CheckpointError(
                f"{self.path}: matrix {name} is {e['rows']}x{e['cols']}, the config implies {rows}x{cols}"
            )
        data = self._bytes(e)
        if e["format"] in FLOAT_DTYPES:
            data = data.view(FLOAT_DTYPES[e["format"]])
        data = data.reshape(rows, -1)
        scales = None
        if e["scales"]:
            s = e["scales"]
            scales = self._bytes({**s, "file": e["file"]}).view(DTYPES[s["dtype"]]).reshape(s["shape"])
        try:
            return Weight(data, scales, fmt=e["format"])
        except ValueError as err:
            raise CheckpointError(f"{self.path}: matrix {name}: {err}") from None


def guard_map(arr: np.ndarray, path: Path) -> None:
    """Registers a file's map with the SIGBUS guard (csrc/mapguard.h), installing it: a truncation of the
    file under the map is then one line naming it and exit 4, not a silent death. Forgotten with the map."""
    if arr.size:
        base = int(arr.ctypes.data)
        _C.guard_mapping(base, int(arr.size), str(path))
        weakref.finalize(arr, _C.unguard_mapping, base)


CHECKS_OFF_ENV = "MOESTREAM_NO_INTEGRITY_CHECKS"  # benchmarks/integrity.py's A/B only: skip the run-time CRCs


def checks_enabled() -> bool:
    return not os.environ.get(CHECKS_OFF_ENV)


def mismatch(path: Path, e: dict[str, Any]) -> str:
    """The line for bytes that fail their checksum."""
    return (
        f"{path}: checksum mismatch at offset {e['offset']} ({e['nbytes']} bytes): the file is corrupt or was "
        "changed after packing (repack it, or restore it from its source)"
    )


def is_packed(path: Path) -> bool:
    return (Path(path) / MANIFEST).exists()
