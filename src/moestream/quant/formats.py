"""The format table on the Python side: one row per format, the same ids and block sizes as the C table
in csrc/quant_float.c (checked at import), with the numpy dequantizer that defines each format.

Matmul error bound per format, against dequantize-then-multiply in float64 (tests use these):
  formats multiplied in float: the kernels compute the exact dequantized values and accumulate in f32
  with a fixed order, so |err| <= 1e-5 * sum_i |w_i x_i| (f32 accumulation error for the sizes we use).
  formats with integer kernels (act_block > 0): the activations are rounded to integers per act_block
  (scale amax/act_levels: int8 for the GGUF-style kernels; for mxfp4 an integer of up to 2^20 held
  as three int8 digits, good to 2^-20 of the block's max), which adds at most
  sum over blocks of sum_i |w_i| * amax_block(x) / (2 * act_levels).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import _C
from . import blocks


@dataclass(frozen=True)
class Format:
    name: str
    id: int
    block: int  # elements per block along a row
    block_bytes: int
    matmul_rel_bound: float  # see the module docstring
    act_block: int = 0  # > 0: activations are quantized per this many (integer dot kernels)
    act_levels: int = 127  # ... to this many steps each side of zero (127: int8; 2**19: mxfp4's three digits)


FORMATS: dict[str, Format] = {
    "f32": Format("f32", 0, 1, 4, 1e-5),
    "bf16": Format("bf16", 1, 1, 2, 1e-5),
    "f16": Format("f16", 2, 1, 2, 1e-5),
    "fp8": Format("fp8", 3, 1, 1, 1e-5),  # e4m3 with one f32 scale per 128x128 block
    # E2M1 nibbles + one E8M0 byte per 32 (compressed-tensors), against three-digit int8 activations
    "mxfp4": Format("mxfp4", 4, 32, 16, 1e-5, act_block=32, act_levels=2**19),
    # GGUF block formats (quant/blocks.py), multiplied after an exact in-register dequantization
    "q8_0": Format("q8_0", 5, 32, 34, 1e-5, act_block=32),
    "q4_k": Format("q4_k", 6, 256, 144, 1e-5, act_block=256),
    "q6_k": Format("q6_k", 7, 256, 210, 1e-5, act_block=256),
    "q3_k": Format("q3_k", 8, 256, 110, 1e-5, act_block=256),
    "q2_k": Format("q2_k", 9, 256, 84, 1e-5, act_block=256),
    "tq2_0": Format("tq2_0", 10, 256, 66, 1e-5, act_block=256),  # ternary: exact integer sums, as q4_k
    "tq1_0": Format("tq1_0", 11, 256, 54, 1e-5, act_block=256),
    # compressed-tensors pack-quantized int4 (Kimi K2 Thinking experts): nibble - 8, f32 scale per 32
    "int4": Format("int4", 12, 32, 16, 1e-5, act_block=32),
}

# Nibble 8 (negative zero) decodes as +0.0 on every path, so that dequantization is bit-exact everywhere.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
MXFP4_BLOCK = 32

FP8_BLOCK = 128


def _check_against_c() -> None:
    c_table = _C.formats()
    for f in FORMATS.values():
        name, block, block_bytes = c_table[f.id]
        if (name, block, block_bytes) != (f.name, f.block, f.block_bytes):
            raise ImportError(f"format table mismatch for {f.name}: C has {(name, block, block_bytes)}")


_check_against_c()


def fp8_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    return (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def dequantize_reference(fmt: Format, data: np.ndarray, scales: np.ndarray | None, rows: int, cols: int) -> np.ndarray:
    """The definition of each format: raw storage -> float32 [rows, cols]."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    if fmt.name == "f32":
        return raw.view(np.float32).copy()
    if fmt.name == "bf16":
        return raw.view(ml_dtypes.bfloat16).astype(np.float32)
    if fmt.name == "f16":
        return raw.view(np.float16).astype(np.float32)
    if fmt.name == "fp8":
        assert scales is not None
        w = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = np.asarray(scales, dtype=np.float32)
        s_full = np.repeat(np.repeat(s, FP8_BLOCK, axis=0)[:rows], FP8_BLOCK, axis=1)[:, :cols]
        return (w * s_full).astype(np.float32)
    if fmt.name == "mxfp4":
        assert scales is not None
        packed = raw.reshape(rows, cols // 2)
        nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols)  # low nibble = even column
        s8 = np.asarray(scales, np.uint8).reshape(rows, cols // MXFP4_BLOCK)
        scale = np.ldexp(np.float32(1), s8.astype(np.int32) - 127).astype(np.float32)
        scale[s8 == 255] = np.nan
        return (E2M1[nib] * np.repeat(scale, MXFP4_BLOCK, axis=1)).astype(np.float32)
    if fmt.name == "int4":
        assert scales is not None
        packed = raw.reshape(rows, cols // 2)
        nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols).astype(np.int8) - np.int8(8)
        scale = np.asarray(scales, np.float32).reshape(rows, cols // 32)
        return (nib.astype(np.float32) * np.repeat(scale, 32, axis=1)).astype(np.float32)
    if fmt.name in blocks.LAYOUTS:
        return blocks.dequantize(fmt.name, raw, rows, cols)
    raise ValueError(f"no reference for format {fmt.name}")


def quantize_fp8_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, cols] -> (e4m3 bytes, f32 block scales), as DeepSeek-V3 checkpoints store them
    (weight_scale_inv = amax / 448 per 128x128 block; dequantized value = byte * scale)."""
    rows, cols = w.shape
    sr, sc = fp8_scale_shape(rows, cols)
    scales = np.zeros((sr, sc), np.float32)
    q = np.zeros((rows, cols), ml_dtypes.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK].astype(np.float32)
            amax = float(np.abs(blk).max())
            s = np.float32(amax / 448.0) if amax > 0 else np.float32(1.0)
            scales[i, j] = s
            q[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK] = (blk / s).astype(
                ml_dtypes.float8_e4m3fn
            )
    return q, scales


def quantize_mxfp4_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, cols] -> (packed uint8 [rows, cols/2], E8M0 uint8 [rows, cols/32]), OCP MX style:
    the block exponent is floor(log2(amax)) - 2, values rounded to the nearest E2M1 magnitude."""
    rows, cols = w.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 needs cols divisible by {MXFP4_BLOCK}, got {cols}")
    blocks = w.astype(np.float32).reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).astype(np.int32)
    s8 = np.clip(exp + 127, 0, 254).astype(np.uint8)
    scaled = blocks / np.ldexp(np.float32(1), s8.astype(np.int32) - 127)[..., None]
    mags = E2M1[:8]
    idx = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1).astype(np.uint8)  # nearest magnitude
    nib = (idx | np.where(scaled < 0, 8, 0).astype(np.uint8)).reshape(rows, cols)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return packed, s8.reshape(rows, cols // MXFP4_BLOCK)


def quantize_int4_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, cols] -> (int32 weight_packed [rows, cols/8], f32 weight_scale [rows, cols/32]) as
    compressed-tensors pack-quantized stores symmetric int4 with group size 32 (value + 8 per nibble)."""
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"int4 needs cols divisible by 32, got {cols}")
    g = w.astype(np.float32).reshape(rows, cols // 32, 32)
    scale = (np.abs(g).max(axis=-1) / 7).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.round(g / scale[..., None]), 0)
    u = (np.clip(q, -8, 7) + 8).astype(np.uint8).reshape(rows, cols)
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    return packed.view("<i4").reshape(rows, cols // 8), scale
