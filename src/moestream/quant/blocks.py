"""The GGUF block formats (q8_0, q4_k, q6_k, q3_k, q2_k, tq2_0, tq1_0) and compressed-tensors int4: numpy
dequantizers written from the block layouts (bit for bit as GGUF stores them, checked against the `gguf`
package's own dequantizers in the tests), and simple quantizers that produce valid blocks.

Each dequantizer takes raw bytes [n_blocks, block_bytes] and returns f32 [n_blocks, block]; the order of
the float operations is part of the definition (the C kernels repeat it exactly).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# name -> (elements per block, bytes per block)
LAYOUTS: dict[str, tuple[int, int]] = {
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q6_k": (256, 210),
    "q3_k": (256, 110),
    "q2_k": (256, 84),
    "tq2_0": (256, 66),
    "tq1_0": (256, 54),
}


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bits(b: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """[..., n] bytes -> [..., len(shifts), n]: (b >> s) & mask for every shift s."""
    return (b[..., None, :] >> np.array(shifts, np.uint8)[:, None]) & np.uint8(mask)


def dequant_q8_0(b: np.ndarray) -> np.ndarray:
    # {f16 d; int8 qs[32]}
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_k's 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, mn


def dequant_q4_k(b: np.ndarray) -> np.ndarray:
    # {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: 8 sub-blocks of 32, each (d*sc) * q - (dmin*m)
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k4_scales(b[:, 4:16])
    q = _bits(b[:, 16:].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32).astype(np.float32)
    dl = (d * sc.astype(np.float32))[..., None]
    ml = (dmin * mn.astype(np.float32))[..., None]
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q6_k(b: np.ndarray) -> np.ndarray:
    # {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: 16 sub-blocks of 16, each (d*sc) * q, q in [-32, 31]
    n = b.shape[0]
    ql = _bits(b[:, 0:128].reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 2, 4, 32)  # [half, (lo l, lo l+32, hi..)]
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 0x03)  # [n, half, 4, 32]
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    dl = (_f16(b[:, 208:210]) * sc).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def dequant_q3_k(b: np.ndarray) -> np.ndarray:
    # {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}: 16 sub-blocks of 16, (d*(sc-32)) * q, q in [-4, 3]
    n = b.shape[0]
    s = b[:, 96:108]
    lo = _bits(s[:, 0:8], [0, 4], 0x0F).reshape(n, 16)
    hi = _bits(s[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
    sc = ((lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    ql = _bits(b[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 16, 16)
    qh = _bits(b[:, 0:32], list(range(8)), 0x01).reshape(n, 16, 16) ^ np.uint8(1)
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
    dl = (_f16(b[:, 108:110]) * sc).reshape(n, 16, 1)
    return (dl * q).reshape(n, QK_K)


def dequant_q2_k(b: np.ndarray) -> np.ndarray:
    # {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}: 16 sub-blocks of 16, (d*sc) * q - (dmin*m), q in [0, 3]
    n = b.shape[0]
    s = b[:, 0:16]
    dl = (_f16(b[:, 80:82]) * (s & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (_f16(b[:, 82:84]) * (s >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequant_tq2_0(b: np.ndarray) -> np.ndarray:
    # {u8 qs[64]; f16 d}: 2-bit codes 0..2 are -1, 0, 1
    n = b.shape[0]
    q = _bits(b[:, 0:64].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, QK_K).astype(np.int8) - np.int8(1)
    return _f16(b[:, 64:66]) * q.astype(np.float32)


POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _trits(b: np.ndarray, k: int) -> np.ndarray:
    """Five (or four) base-3 digits per byte, stored as a fixed-point fraction: digit j of byte v is
    ((v * 3^j mod 256) * 3) >> 8."""
    return ((b[..., None, :] * POW3[:k, None]).astype(np.uint16) * 3 >> 8).astype(np.int8)


def dequant_tq1_0(b: np.ndarray) -> np.ndarray:
    # {u8 qs[48]; u8 qh[4]; f16 d}: 1.6 bits per ternary weight
    n = b.shape[0]
    q0 = _trits(b[:, 0:32], 5).reshape(n, 160)
    q1 = _trits(b[:, 32:48], 5).reshape(n, 80)
    qh = _trits(b[:, 48:52], 4).reshape(n, 16)
    q = np.concatenate([q0, q1, qh], axis=1) - np.int8(1)
    return _f16(b[:, 52:54]) * q.astype(np.float32)


DEQUANT = {
    "q8_0": dequant_q8_0,
    "q4_k": dequant_q4_k,
    "q6_k": dequant_q6_k,
    "q3_k": dequant_q3_k,
    "q2_k": dequant_q2_k,
    "tq2_0": dequant_tq2_0,
    "tq1_0": dequant_tq1_0,
}


def dequantize(fmt: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    _block, nbytes = LAYOUTS[fmt]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, nbytes)
    return DEQUANT[fmt](raw).reshape(rows, cols).astype(np.float32)


# ---- quantizers: simple, deterministic, valid blocks (not llama.cpp's iterative searches) -------------


def _half(x: np.ndarray) -> np.ndarray:
    """f32 [..] -> the two little-endian bytes of its f16 [.., 2]."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _round(x: np.ndarray) -> np.ndarray:
    """Round half away from zero, as ggml's reference quantizers do."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _safe_inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0.0, 1.0 / np.where(d == 0, 1.0, d))


def quant_q8_0(x: np.ndarray) -> np.ndarray:
    """x [n, 32] -> [n, 34]."""
    d = np.abs(x).max(axis=1, keepdims=True) / 127
    q = _round(x * _safe_inv(d)).astype(np.int8)
    return np.concatenate([_half(d[:, 0]), q.view(np.uint8)], axis=1)


def _pack_bits(q: np.ndarray, shifts: list[int]) -> np.ndarray:
    """Inverse of _bits: [..., len(shifts), n] small codes -> [..., n] bytes."""
    out = np.zeros(q.shape[:-2] + q.shape[-1:], np.uint8)
    for k, s in enumerate(shifts):
        out |= (q[..., k, :].astype(np.uint8) << np.uint8(s)).astype(np.uint8)
    return out


def _minmax_subblocks(
    x: np.ndarray, levels: int, scale_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [n, g, size] -> (d, dmin f16-rounded [n], sc, m [n, g] codes, q [n, g, size] in 0..levels)."""
    mn = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - mn) / levels
    top = (1 << scale_bits) - 1
    d = (scale.max(axis=1) / top).astype(np.float16).astype(np.float32)
    dmin = ((-mn).max(axis=1) / top).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale * _safe_inv(d)[:, None]), 0, top).astype(np.uint8)
    m = np.clip(_round(-mn * _safe_inv(dmin)[:, None]), 0, top).astype(np.uint8)
    dl = d[:, None] * sc.astype(np.float32)
    ml = dmin[:, None] * m.astype(np.float32)
    q = np.clip(_round((x + ml[..., None]) * _safe_inv(dl)[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def quant_q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _minmax_subblocks(x.reshape(n, 8, 32), 15, 6)
    s = np.zeros((n, 12), np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = _pack_bits(q.reshape(n, 4, 2, 32), [0, 4]).reshape(n, 128)
    return np.concatenate([_half(d), _half(dmin), s, qs], axis=1)


def quant_q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _minmax_subblocks(x.reshape(n, 16, 16), 3, 4)
    qs = _pack_bits(q.reshape(n, 2, 4, 32), [0, 2, 4, 6]).reshape(n, 64)
    return np.concatenate([sc | (m << 4), qs, _half(d), _half(dmin)], axis=1)


def _symmetric_subblocks(x: np.ndarray, qmax: int, scale_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [n, g, size] -> (d f16-rounded [n], sc [n, g] signed codes, q [n, g, size] in -qmax-1..qmax)."""
    scale = np.abs(x).max(axis=2) / qmax
    d = (scale.max(axis=1) / scale_max).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale * _safe_inv(d)[:, None]), -scale_max, scale_max).astype(np.int32)
    dl = d[:, None] * sc.astype(np.float32)
    q = np.clip(_round(x * _safe_inv(dl)[..., None]), -qmax - 1, qmax).astype(np.int32)
    return d, sc, q


def quant_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, sc, q = _symmetric_subblocks(x.reshape(n, 16, 16), 31, 127)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, k, i]: element 128h + 32k + i
    lo = u & 0x0F
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = _pack_bits(u >> 4, [0, 2, 4, 6])  # [n, 2, 32]
    return np.concatenate(
        [ql.reshape(n, 128).astype(np.uint8), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _half(d)], axis=1
    )


def quant_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, sc, q = _symmetric_subblocks(x.reshape(n, 16, 16), 3, 31)
    s6 = (sc + 32).astype(np.uint8)  # [n, 16]
    s = np.zeros((n, 12), np.uint8)
    s[:, 0:8] = (s6[:, 0:8] & 0x0F) | ((s6[:, 8:16] & 0x0F) << 4)
    s[:, 8:12] = _pack_bits((s6 >> 4).reshape(n, 4, 4), [0, 2, 4, 6])
    qf = q.reshape(n, QK_K)
    hbit = (qf >= 0).astype(np.uint8)
    low = (qf & 3).astype(np.uint8)
    qs = _pack_bits(low.reshape(n, 2, 4, 32), [0, 2, 4, 6]).reshape(n, 64)
    hm = _pack_bits(hbit.reshape(n, 8, 32), list(range(8)))
    return np.concatenate([hm, qs, s, _half(d)], axis=1)


def _ternary(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = np.abs(x).max(axis=1).astype(np.float16).astype(np.float32)
    t = (np.clip(_round(x * _safe_inv(d)[:, None]), -1, 1) + 1).astype(np.uint8)  # 0, 1, 2
    return d, t


def quant_tq2_0(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, t = _ternary(x)
    return np.concatenate([_pack_bits(t.reshape(n, 2, 4, 32), [0, 2, 4, 6]).reshape(n, 64), _half(d)], axis=1)


def _pack_trits(t: np.ndarray, digits: int) -> np.ndarray:
    """t [n, digits, m] trits -> [n, m] bytes holding them as a base-3 fraction (digit 0 first)."""
    v = np.zeros(t.shape[0:1] + t.shape[2:], np.uint16)
    for j in range(digits):
        v = v * 3 + t[:, j]
    v = v * (3 ** (5 - digits))
    return ((v * 256 + 242) // 243).astype(np.uint8)


def quant_tq1_0(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, t = _ternary(x)
    q0 = _pack_trits(t[:, 0:160].reshape(n, 5, 32), 5)
    q1 = _pack_trits(t[:, 160:240].reshape(n, 5, 16), 5)
    qh = _pack_trits(t[:, 240:256].reshape(n, 4, 4), 4)
    return np.concatenate([q0, q1, qh, _half(d)], axis=1)


QUANT = {
    "q8_0": quant_q8_0,
    "q4_k": quant_q4_k,
    "q6_k": quant_q6_k,
    "q3_k": quant_q3_k,
    "q2_k": quant_q2_k,
    "tq2_0": quant_tq2_0,
    "tq1_0": quant_tq1_0,
}


def quantize(fmt: str, w: np.ndarray) -> np.ndarray:
    """f32 [rows, cols] -> bytes [rows, cols / block * block_bytes] (cols a multiple of the block)."""
    block, nbytes = LAYOUTS[fmt]
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"{fmt} needs a row length divisible by {block}, got {cols}")
    out = QUANT[fmt](np.ascontiguousarray(w, np.float32).reshape(-1, block))
    return np.ascontiguousarray(out).reshape(rows, cols // block * nbytes)
