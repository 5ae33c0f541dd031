"""Shared blocks of every decoder: norms, rotary embeddings, GQA and MLA attention with their caches,
dense and MoE feed-forward layers, and the decoder that strings them together.

Shapes: T = tokens in this call, S = positions attended to (cache + new), E = hidden size,
H = attention heads, KV = key/value heads, D = head dim. Activations are float32 numpy arrays; every
weight product goes through a C kernel (quant.Weight) straight from the checkpoint bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from .. import _C
from ..config import RopeSpec
from ..quant import Weight, matmul_many


@dataclass
class Ctx:
    """Per-call execution settings."""

    threads: int = 1


# ---- elementwise blocks ---------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., n] * rsqrt(mean(x^2) + eps) * w, in float32 as transformers computes it. For float32 rows
    and weights, one C call with the bits of the numpy expression below."""
    if (
        x.dtype == np.float32
        and w.dtype == np.float32
        and w.ndim == 1
        and x.shape[-1] == w.shape[0]
        and x.flags.c_contiguous
        and w.flags.c_contiguous
        and x.flags.aligned
        and w.flags.aligned  # a float32 tensor of a mapped checkpoint may sit at any byte offset
    ):
        out = np.empty_like(x)
        _C.rms_norm(x, w, eps, out)
        return out
    # the mean as np.mean computes it (a float32 sum divided by n), without its Python-level wrapper
    var = np.add.reduce(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32) / np.float32(
        x.shape[-1]
    )
    return (w * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))).astype(np.float32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)), its operations in one new array, without a temporary per step."""
    h = np.negative(x)
    np.exp(h, out=h)
    h += np.float32(1.0)
    np.divide(x, h, out=h)
    return h


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    # the ufuncs' reduce directly (what np.max and np.sum call), without their wrappers' cost per call
    e = np.exp(x - np.maximum.reduce(x, axis=axis, keepdims=True))
    return e / np.add.reduce(e, axis=axis, keepdims=True)


def exp_shifted_inplace(x: np.ndarray) -> np.ndarray:
    """x := exp(x - max over the last axis), in place (float32); returns the sums over that axis
    (keepdims): softmax's numerator and denominator, for callers that divide later."""
    np.subtract(x, np.maximum.reduce(x, axis=-1, keepdims=True), out=x)
    np.exp(x, out=x)
    return np.add.reduce(x, axis=-1, keepdims=True)


def softmax_last_inplace(x: np.ndarray) -> np.ndarray:
    """softmax(x) over the last axis, with its bits, written over x (float32): no temporaries the size of
    x, which for prefill attention scores are megabytes each."""
    np.divide(x, exp_shifted_inplace(x), out=x)
    return x


_head_pool: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool), made on first use


def matmul_f32(a: np.ndarray, b: np.ndarray, b_transposed: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """a [m, k] @ b [k, n], or @ b.T for b [n, k] (b_transposed), in float32 (C-contiguous operands): each
    element one fused multiply-add chain over k in order (csrc/gemm_f32.c), so the bits are the same on
    every instruction set and whatever BLAS numpy carries."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    m, k = a.shape
    n = b.shape[0] if b_transposed else b.shape[1]
    if out is None:
        out = np.empty((m, n), np.float32)
    _C.gemm_f32(a, b, out, m, k, n, b_transposed)
    return out


def over_heads(fn: Callable[[slice], None], n: int, threads: int) -> None:
    """fn(part) for contiguous parts of range(n) (attention heads), on up to `threads` threads: gemm_f32
    and numpy's ufunc loops release the GIL (and numpy's BLAS runs on the calling thread only,
    blas_threads.py), so the prefill attention of different heads runs on different cores. Each head's arithmetic is
    the same whichever thread takes it, so the result does not depend on the thread count."""
    global _head_pool
    k = max(1, min(threads, n))
    bounds = [n * i // k for i in range(k + 1)]
    parts = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    if k == 1:
        fn(parts[0])
        return
    if _head_pool is None or _head_pool[0] < k - 1:
        _head_pool = (k - 1, ThreadPoolExecutor(max_workers=k - 1, thread_name_prefix="moestream-heads"))
    futures = [_head_pool[1].submit(fn, part) for part in parts[1:]]
    try:
        fn(parts[0])
    finally:  # no part outlives the call, whichever raises
        wait(futures)
    for f in futures:
        f.result()


class Linear:
    """y = x W^T (+ b); W in any kernel format."""

    def __init__(self, weight: Weight, bias: np.ndarray | None = None):
        self.weight = weight
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)

    @property
    def out_features(self) -> int:
        return self.weight.rows

    def __call__(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        y = self.weight.matmul(x, ctx.threads)
        if self.bias is not None:
            y += self.bias
        return y


def linears(x: np.ndarray, layers: tuple[Linear, ...], ctx: Ctx) -> list[np.ndarray]:
    """[layer(x) for layer in layers], the products in one pass of the kernels (x prepared once)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    outs = [np.empty((x.shape[0], layer.out_features), np.float32) for layer in layers]
    matmul_many([(layer.weight, x, out) for layer, out in zip(layers, outs, strict=True)], ctx.threads)
    for layer, out in zip(layers, outs, strict=True):
        if layer.bias is not None:
            out += layer.bias
    return outs


# ---- rotary embeddings ----------------------------------------------------------------------------


class Rope:
    """Rotary position embedding (default, linear or YaRN), computed in float32 like transformers."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        dim = spec.dim
        pos_freqs = np.float32(spec.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
        self.attention_factor = 1.0
        if spec.kind == "linear":
            inv_freq = (inv_freq / np.float32(spec.factor)).astype(np.float32)
        elif spec.kind == "yarn":
            inv_freq, self.attention_factor = self._yarn(spec, pos_freqs)
        self.inv_freq = inv_freq
        self._last: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None

    @staticmethod
    def _yarn(spec: RopeSpec, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
        dim, factor = spec.dim, spec.factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if spec.attention_factor is not None:
            attention_factor = spec.attention_factor
        elif spec.mscale and spec.mscale_all_dim:
            attention_factor = get_mscale(factor, spec.mscale) / get_mscale(factor, spec.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

        def correction_dim(rot: float) -> float:
            return (dim * math.log(spec.original_max_position_embeddings / (rot * 2 * math.pi))) / (
                2 * math.log(spec.theta)
            )

        low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
        if spec.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation_factor = (np.float32(1) - ramp).astype(np.float32)
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        inv_freq = inv_inter * (np.float32(1) - extrapolation_factor) + inv_extra * extrapolation_factor
        return inv_freq.astype(np.float32), float(attention_factor)

    def cos_sin(self, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [n, dim/2] for positions pos0 .. pos0+n-1 (kept for the next caller: every layer of a
        forward pass asks for the same positions)."""
        if self._last is not None and self._last[0] == (pos0, n):
            return self._last[1]
        freqs = np.arange(pos0, pos0 + n, dtype=np.float32)[:, None] * self.inv_freq[None, :]
        af = np.float32(self.attention_factor)
        cs = (np.cos(freqs) * af).astype(np.float32), (np.sin(freqs) * af).astype(np.float32)
        self._last = ((pos0, n), cs)
        return cs

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, heads, dim] -> rotated, in the layout transformers produces."""
        half = x.shape[-1] // 2
        if (
            x.ndim == 3
            and x.dtype == np.float32
            and x.flags.c_contiguous
            and x.flags.aligned
            and cos.shape == sin.shape == (x.shape[0], half)
            and cos.dtype == sin.dtype == np.float32
            and cos.flags.c_contiguous
            and sin.flags.c_contiguous
            and x.shape[-1] == 2 * half > 0
        ):  # one C pass with the bits of the numpy steps below (a 128-token prefill: 1.9 -> 0.34 ms a layer)
            out = np.empty_like(x)
            _C.rope(x, cos, sin, x.shape[0], x.shape[1], x.shape[2], bool(self.spec.interleave), out)
            return out
        if self.spec.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        # [x1 c - x2 s, x2 c + x1 s] written into place: the same float32 operations, without the temporaries
        # and the copies of a concatenate (a 128-token prefill's queries: 1.1 -> 0.5 ms a layer)
        out = np.empty((*x.shape[:-1], 2 * half), np.float32)
        lo, hi = out[..., :half], out[..., half:]
        tmp = np.multiply(x2, s, dtype=np.float32)
        np.subtract(np.multiply(x1, c, out=lo), tmp, out=lo)
        np.multiply(x1, s, out=tmp)
        np.add(np.multiply(x2, c, out=hi), tmp, out=hi)
        return out


# ---- attention ------------------------------------------------------------------------------------


class Cache(Protocol):
    """What every attention's cache has: the positions it holds, and a way back to fewer of them (a rejected
    speculative draft is taken back out)."""

    length: int

    def rewind(self, length: int, ctx: Ctx) -> None: ...

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...


def _grow(buf: np.ndarray, axis: int, need: int) -> np.ndarray:
    if buf.shape[axis] >= need:
        return buf
    shape = list(buf.shape)
    shape[axis] = max(need, 2 * shape[axis], 16)
    out = np.zeros(shape, np.float32)
    sl = [slice(None)] * buf.ndim
    sl[axis] = slice(0, buf.shape[axis])
    out[tuple(sl)] = buf
    return out


@dataclass
class KVCache:
    """GQA cache: k, v [KV, capacity, D] of which the first `length` positions are filled."""

    k: np.ndarray
    v: np.ndarray
    length: int = 0

    def reserve(self, n: int) -> None:
        """Room for n positions."""
        self.k = _grow(self.k, 1, n)
        self.v = _grow(self.v, 1, n)

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k, v [T, KV, D] -> all keys and values [KV, S, D]."""
        n = self.length + k.shape[0]
        self.reserve(n)
        self.k[:, self.length : n] = k.transpose(1, 0, 2)
        self.v[:, self.length : n] = v.transpose(1, 0, 2)
        self.length = n
        return self.k[:, :n], self.v[:, :n]

    def rewind(self, length: int, ctx: Ctx) -> None:
        """Keeps the first `length` positions (the rest is overwritten by the next append)."""
        assert 0 <= length <= self.length
        self.length = length

    def snapshot(self) -> Any:
        return self.length  # appends never write below length: the length is the whole snapshot

    def restore(self, snap: Any) -> None:
        self.length = snap


# Prefill attention takes the queries of this many positions at a time (per key/value head): their
# scores stay in cache through the softmax's passes, and they skip the keys past their last position.
PREFILL_QUERIES = 64


def causal_mask(pos0: int, t: int, s: int, window: int | None = None) -> np.ndarray:
    """[t, s] additive mask: query at position pos0+i sees key j iff j <= pos0+i (and within window)."""
    qpos = np.arange(pos0, pos0 + t)[:, None]
    kpos = np.arange(s)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    return np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)


class GQAttention:
    """Grouped-query attention with RoPE (Qwen3-MoE: per-head q/k RMSNorm before RoPE)."""

    def __init__(
        self,
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rope: Rope,
        q_norm: np.ndarray | None = None,
        k_norm: np.ndarray | None = None,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
    ):
        self.q, self.k, self.v, self.o = q, k, v, o
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope = rope
        # the C decode takes aligned float32 weights (a mapped checkpoint's may sit at any byte offset)
        self.q_norm, self.k_norm = (
            None if n is None else np.require(n, np.float32, ("C", "A")) for n in (q_norm, k_norm)
        )
        self.norm_eps = norm_eps
        self.sliding_window = sliding_window
        self.scaling = np.float32(head_dim**-0.5)

    def new_cache(self) -> KVCache:
        z = np.zeros((self.kv_heads, 0, self.head_dim), np.float32)
        return KVCache(z, z.copy())

    def __call__(self, x: np.ndarray, cache: KVCache, ctx: Ctx) -> np.ndarray:
        return self.output(self.mix(self.project(x, ctx), cache, ctx), x, ctx)

    def project(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, ...]:
        """q [T, H*D], k and v [T, KV*D]: row by row, so one call serves every sequence of a step."""
        return tuple(linears(x, (self.q, self.k, self.v), ctx))

    def output(self, o: np.ndarray, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        return self.o(o, ctx)  # [T, E]

    def mix(self, qkv: tuple[np.ndarray, ...], cache: KVCache, ctx: Ctx) -> np.ndarray:
        """One sequence's rows of project's arrays, with its cache -> [T, H*D]."""
        q, k, v = qkv
        T = q.shape[0]
        pos0 = cache.length
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        if T == 1:
            return self._decode(q, k, v, cache, ctx)
        q = q.reshape(T, H, D)  # [T, H, D]
        k = k.reshape(T, KV, D)  # [T, KV, D]
        v = v.reshape(T, KV, D)  # [T, KV, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.norm_eps)
            k = rms_norm(k, self.k_norm, self.norm_eps)
        cos, sin = self.rope.cos_sin(pos0, T)
        q = self.rope.apply(q, cos, sin)
        k = self.rope.apply(k, cos, sin)
        keys, values = cache.append(k, v)  # [KV, S, D]
        rep = H // KV
        # the scaled queries, rows in (position, head of the group) order: a run of positions is a run of rows
        qg = np.ascontiguousarray((q * self.scaling).reshape(T, KV, rep, D).transpose(1, 0, 2, 3)).reshape(
            KV, T * rep, D
        )
        o = np.empty((KV, T * rep, D), np.float32)  # [KV, T*rep, D]
        window = self.sliding_window

        def heads(part: slice) -> None:  # key/value heads `part`, one at a time, PREFILL_QUERIES positions a time
            for g in range(part.start, part.stop):
                for t0 in range(0, T, PREFILL_QUERIES):
                    t1 = min(T, t0 + PREFILL_QUERIES)
                    # the keys these positions may see: none past the last one's position, none before the
                    # first one's window
                    s0, s1 = 0 if window is None else max(0, pos0 + t0 - window + 1), pos0 + t1
                    rows = slice(t0 * rep, t1 * rep)
                    scores = matmul_f32(qg[g, rows], keys[g, s0:s1], b_transposed=True)  # [n*rep, s]
                    by_query = scores.reshape(t1 - t0, rep, s1 - s0)  # a view: the mask goes in place
                    if window is None:  # only the block of keys at the positions' own positions is masked
                        by_query[:, :, pos0 + t0 - s0 :] += causal_mask(0, t1 - t0, t1 - t0)[:, None]
                    else:
                        by_query += causal_mask(pos0 + t0, t1 - t0, s1, window)[:, None, s0:]
                    total = exp_shifted_inplace(scores)  # [n*rep, 1]; the division comes after p V
                    np.divide(matmul_f32(scores, values[g, s0:s1], out=o[g, rows]), total, out=o[g, rows])

        over_heads(heads, KV, ctx.threads)
        return np.ascontiguousarray(o.reshape(KV, T, rep, D).transpose(1, 0, 2, 3).reshape(T, H * D))  # [T, H*D]

    def _decode(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, ctx: Ctx) -> np.ndarray:
        """One token (q [1, H*D], k and v [1, KV*D]) -> attention output [1, H*D]: the norms, the rope, the
        cache append and the attention in one C call. The new key and value get the bits the numpy steps
        above give them; the attention products have the kernel's own fixed order."""
        pos = cache.length
        cache.reserve(pos + 1)
        cos, sin = self.rope.cos_sin(pos, 1)  # [1, D/2] each
        both = self.q_norm is not None and self.k_norm is not None
        q_norm, k_norm = (self.q_norm, self.k_norm) if both else (None, None)
        out = np.empty((1, self.heads * self.head_dim), np.float32)
        _C.gqa_decode(
            q,
            k,
            v,
            cache.k,
            cache.v,
            pos,
            self.heads,
            self.kv_heads,
            self.head_dim,
            q_norm,
            k_norm,
            self.norm_eps,
            cos[0],
            sin[0],
            self.rope.spec.interleave,
            float(self.scaling),
            self.sliding_window or 0,
            out,
            ctx.threads,
        )
        cache.length = pos + 1
        return out


@dataclass
class LatentCache:
    """MLA cache of the latent only: c [capacity, kv_lora_rank] (after kv_a_layernorm) and the shared
    rotated key k_r [capacity, rope_dim]."""

    c: np.ndarray
    kr: np.ndarray
    length: int = 0

    def append(self, c: np.ndarray, kr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.length + c.shape[0]
        self.c = _grow(self.c, 0, n)
        self.kr = _grow(self.kr, 0, n)
        self.c[self.length : n] = c
        self.kr[self.length : n] = kr
        self.length = n
        return self.c[:n], self.kr[:n]

    def rewind(self, length: int, ctx: Ctx) -> None:
        """Keeps the first `length` positions (the rest is overwritten by the next append)."""
        assert 0 <= length <= self.length
        self.length = length

    def snapshot(self) -> Any:
        return self.length  # appends never write below length: the length is the whole snapshot

    def restore(self, snap: Any) -> None:
        self.length = snap


class MLAttention:
    """Multi-head latent attention (DeepSeek-V3 / Kimi K2). Prefill expands k and v from the latent;
    decode (one token) uses the absorbed form: kv_b_proj folded into the query and into the output,
    so only the latent is ever cached. The folding multiplies by kv_b_proj's own bytes (its blocks of
    rows per head: Weight.combine_rows, block_rows_matmul); only an fp8 kv_b_proj whose head blocks do
    not start at multiples of 128 rows keeps dequantized f32 copies (absorbed)."""

    def __init__(
        self,
        q_proj: Linear | None,
        q_a_proj: Linear | None,
        q_a_norm: np.ndarray | None,
        q_b_proj: Linear | None,
        kv_a_proj: Linear,
        kv_a_norm: np.ndarray,
        kv_b_proj: Linear,
        o_proj: Linear,
        heads: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        kv_lora_rank: int,
        rope: Rope | None,
        scaling: float,
        norm_eps: float,
        out_gate: Linear | None = None,
    ):
        self.out_gate = out_gate  # Kimi K3: o * sigmoid(g_proj x) before o_proj
        self.q_proj, self.q_a_proj, self.q_a_norm, self.q_b_proj = q_proj, q_a_proj, q_a_norm, q_b_proj
        self.kv_a_proj, self.kv_a_norm, self.kv_b_proj, self.o_proj = kv_a_proj, kv_a_norm, kv_b_proj, o_proj
        self.heads, self.nope, self.rope_dim, self.v_dim, self.rank = (
            heads,
            nope_dim,
            rope_dim,
            v_dim,
            kv_lora_rank,
        )
        self.rope = rope
        self.scaling = np.float32(scaling)
        self.norm_eps = norm_eps
        self._absorbed: tuple[np.ndarray, np.ndarray] | None = None

    def new_cache(self) -> LatentCache:
        return LatentCache(np.zeros((0, self.rank), np.float32), np.zeros((0, self.rope_dim), np.float32))

    def _query(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        if self.q_proj is not None:
            return self.q_proj(x, ctx)
        assert self.q_a_proj is not None and self.q_b_proj is not None and self.q_a_norm is not None
        return self.q_b_proj(rms_norm(self.q_a_proj(x, ctx), self.q_a_norm, self.norm_eps), ctx)

    @property
    def direct(self) -> bool:
        """Decode multiplies by kv_b_proj's bytes (else by the f32 copies of absorbed())."""
        align = self.kv_b_proj.weight.row_align
        return self.nope % align == 0 and (self.nope + self.v_dim) % align == 0

    def absorbed(self) -> tuple[np.ndarray, np.ndarray]:
        """W_uk^T [H, rank, nope] and W_uv [H, v, rank] from kv_b_proj [H*(nope+v), rank], as f32."""
        if self._absorbed is None:
            w = self.kv_b_proj.weight.dequantize().reshape(self.heads, self.nope + self.v_dim, self.rank)
            self._absorbed = (
                np.ascontiguousarray(w[:, : self.nope, :].transpose(0, 2, 1)),
                np.ascontiguousarray(w[:, self.nope :, :]),
            )
        return self._absorbed

    def __call__(self, x: np.ndarray, cache: LatentCache, ctx: Ctx) -> np.ndarray:
        return self.output(self.mix(self.project(x, ctx), cache, ctx), x, ctx)

    def project(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, ...]:
        """q [T, H*(nope+rope)] and the compressed kv [T, rank+rope]: row by row (see GQAttention)."""
        return self._query(x, ctx), self.kv_a_proj(x, ctx)

    def output(self, o: np.ndarray, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        if self.out_gate is not None:
            o = o * sigmoid(self.out_gate(x, ctx))
        return self.o_proj(o.astype(np.float32), ctx)  # [T, E]

    def mix(self, projected: tuple[np.ndarray, ...], cache: LatentCache, ctx: Ctx) -> np.ndarray:
        """One sequence's rows of project's arrays, with its cache -> [T, H*v]."""
        q, ckv = projected
        T = q.shape[0]
        pos0 = cache.length
        H, N, R, V = self.heads, self.nope, self.rope_dim, self.v_dim
        q = q.reshape(T, H, N + R)  # [T, H, nope+rope]
        q_nope, q_rot = q[..., :N], q[..., N:]
        c = rms_norm(ckv[:, : self.rank], self.kv_a_norm, self.norm_eps)  # [T, rank]
        k_rot = ckv[:, None, self.rank :]  # [T, 1, rope]: one rotary key shared by all heads
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(pos0, T)
            q_rot = self.rope.apply(q_rot, cos, sin)
            k_rot = self.rope.apply(k_rot, cos, sin)
        c_all, kr_all = cache.append(c, k_rot[:, 0])  # [S, rank], [S, rope]
        S = c_all.shape[0]
        if T == 1:
            W = self.kv_b_proj.weight  # [H*(nope+v), rank]: head h's W_uk [nope, rank], then its W_uv [v, rank]
            if self.direct:
                q_lat = W.combine_rows(q_nope[0], 0, N + V, ctx.threads)  # [H, rank]: q_nope[h] W_uk[h]
            else:
                q_lat = np.einsum("hn,hrn->hr", q_nope[0], self.absorbed()[0])
            scores = (q_lat @ c_all.T + q_rot[0] @ kr_all.T) * self.scaling  # [H, S]
            p = softmax(scores)
            o_lat = p @ c_all  # [H, rank]
            if self.direct:
                o = W.block_rows_matmul(o_lat, N, N + V, V, ctx.threads).reshape(1, H * V)  # o_lat[h] W_uv[h]^T
            else:
                o = np.einsum("hvr,hr->hv", self.absorbed()[1], o_lat).reshape(1, H * V)  # [1, H*v]
        else:
            kv = self.kv_b_proj(c_all, ctx).reshape(S, H, N + V)  # [S, H, nope+v]
            k_nope, v = kv[..., :N], kv[..., N:]
            mask = causal_mask(pos0, T, S)  # [T, S]
            # a head's query and keys as one vector each, nope then rope, so that a score is one product
            qs = np.empty((H, T, N + R), np.float32)  # [H, T, nope+rope], scaled
            np.multiply(q_nope.transpose(1, 0, 2), self.scaling, out=qs[..., :N])
            np.multiply(q_rot.transpose(1, 0, 2), self.scaling, out=qs[..., N:])
            o_h = np.empty((H, T, V), np.float32)

            def heads(part: slice) -> None:
                k = np.empty((S, N + R), np.float32)  # [S, nope+rope]: head h's keys
                k[:, N:] = kr_all
                for h in range(part.start, part.stop):
                    k[:, :N] = k_nope[:, h]
                    scores = matmul_f32(qs[h], k, b_transposed=True)  # [T, S]
                    scores += mask
                    matmul_f32(softmax_last_inplace(scores), v[:, h], out=o_h[h])

            over_heads(heads, H, ctx.threads)
            o = o_h.transpose(1, 0, 2).reshape(T, H * V)  # [T, H*v]
        return o


# ---- feed-forward ---------------------------------------------------------------------------------


Glu = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # act(g, u, threads)


def silu_glu(g: np.ndarray, u: np.ndarray, threads: int = 1) -> np.ndarray:
    """silu(g) * u = g / (1 + exp(-g)) * u (float32 [..., n] each), in one C pass on csrc/exp_f32.h's exp:
    the same bits on every instruction set and thread count, within 3 ulp of the exact value (numpy's
    five passes took 14-37 us a decode layer). The values are split over up to `threads` threads where
    each thread gets 2 k or more of them (ms_threads_for in csrc/threadpool.c)."""
    g = np.ascontiguousarray(g, dtype=np.float32)
    u = np.ascontiguousarray(u, dtype=np.float32)
    if g.shape != u.shape:
        raise ValueError(f"silu_glu: gate {list(g.shape)} and up {list(u.shape)} differ")
    h = np.empty_like(g)
    _C.silu_mul(g, u, h, threads)
    return h


class DenseMLP:
    """down(act(gate x, up x)); act is SwiGLU unless the architecture says otherwise."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, act: Glu = silu_glu):
        self.gate, self.up, self.down, self.act = gate, up, down, act

    def __call__(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        return glu_many([(self, x)], ctx)[0]


def glu_kernel_args(mlp: DenseMLP | Expert) -> list[tuple[int, np.ndarray, np.ndarray | None, int, int]]:
    """The MLP's gate, up and down as the C kernels take them, made on first use and kept on the MLP (whose
    matrices are never reassigned: an expert cache makes a new Expert for each read)."""
    args = mlp.__dict__.get("_kernel_args")
    if args is None:
        args = mlp.__dict__["_kernel_args"] = [w.kernel_args() for w in (mlp.gate, mlp.up, mlp.down)]
    return args


def glu_one_x(mlps: list[Any], x: np.ndarray, ctx: Ctx, coef: np.ndarray | None = None) -> np.ndarray:
    """[mlp(x) for mlp in mlps] as one array [n, out] for a single token x [1, E] (decode) and MLPs of one
    shape (a MoE layer's experts), or with coef [n] their sum coef[0] * mlp_0(x) + coef[1] * mlp_1(x) + ...
    [1, out] as combine_slots adds them: glu_many's products and bits. SwiGLU experts go through one C call
    (csrc/moe_decode.c: both passes of products, the activation and the sum)."""
    first = mlps[0]
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, inner, width = len(mlps), first.gate.rows, first.down.rows
    if all(m.act is silu_glu and m.gate.rows == inner and m.down.rows == width for m in mlps):
        out = np.empty((1 if coef is not None else n, width), np.float32)
        args = [a for m in mlps for a in glu_kernel_args(m)]
        _C.glu_experts(args, x, None if coef is None else np.ascontiguousarray(coef, np.float32), out, ctx.threads)
        return out
    if any(m.act is not first.act or m.gate.rows != inner for m in mlps):
        ys = np.concatenate(glu_many([(m, x) for m in mlps], ctx))
    else:
        g = np.empty((n, inner), np.float32)  # [n, I]
        u = np.empty((n, inner), np.float32)
        matmul_many(
            [p for i, m in enumerate(mlps) for p in ((m.gate, x, g[i : i + 1]), (m.up, x, u[i : i + 1]))],
            ctx.threads,
        )
        h = first.act(g, u, ctx.threads)  # [n, I]
        ys = np.empty((n, width), np.float32)  # [n, out]
        matmul_many([(m.down, h[i : i + 1], ys[i : i + 1]) for i, m in enumerate(mlps)], ctx.threads)
    if coef is None:
        return ys
    return combine_slots(ys, np.arange(n, dtype=np.int64)[None, :], np.asarray(coef, np.float32)[None, :], ctx)


def glu_many(
    batch: list[tuple[DenseMLP | Expert, np.ndarray]], ctx: Ctx, outs: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    """[mlp(x) for mlp, x in batch]: the gate and up products of all of them in one pass of the kernels,
    the activation over all of them at once, then the down products in one pass. Elementwise steps and
    per-row products give each output the same bits as running the MLPs one by one. `outs`: where to put
    them (C-contiguous float32 [n, out] each), else new arrays."""
    if not batch:
        return []
    if len({mlp.act for mlp, _ in batch}) > 1:
        if outs is None:
            return [glu_many([item], ctx)[0] for item in batch]
        return [glu_many([item], ctx, [out])[0] for item, out in zip(batch, outs, strict=True)]
    act = batch[0][0].act
    xs = [np.ascontiguousarray(x, dtype=np.float32) for _, x in batch]
    sizes = [x.shape[0] * mlp.gate.rows for (mlp, _), x in zip(batch, xs, strict=True)]
    ends = np.cumsum(sizes).tolist()
    g_all = np.empty(ends[-1], np.float32)  # every MLP's [n, I] gate output, one after the other
    u_all = np.empty(ends[-1], np.float32)
    first: list[tuple[Weight, np.ndarray, np.ndarray]] = []
    for (mlp, _), x, end, size in zip(batch, xs, ends, sizes, strict=True):
        shape = (x.shape[0], mlp.gate.rows)
        first.append((mlp.gate, x, g_all[end - size : end].reshape(shape)))
        first.append((mlp.up, x, u_all[end - size : end].reshape(shape)))
    matmul_many(first, ctx.threads)
    h_all = act(g_all, u_all, ctx.threads)
    if outs is None:
        outs = [np.empty((x.shape[0], mlp.down.rows), np.float32) for (mlp, _), x in zip(batch, xs, strict=True)]
    second = [
        (mlp.down, h_all[end - size : end].reshape(x.shape[0], mlp.gate.rows), out)
        for (mlp, _), x, end, size, out in zip(batch, xs, ends, sizes, outs, strict=True)
    ]
    matmul_many(second, ctx.threads)
    return outs


class Router(Protocol):
    def __call__(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
        """x [T, E] -> (expert ids [T, k] int64, weights [T, k] f32), in the order outputs are summed."""
        ...


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first; ties go to the lower index."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[:, :k]


def per_row(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The index of a [T, n] array at idx [T, k] (column idx[t, j] of row t): what take_along_axis and
    put_along_axis build, without their overhead on the one-row decode step."""
    return np.arange(idx.shape[0])[:, None], idx


class SoftmaxRouter:
    """Softmax over all experts, top-k, optional renormalisation (Mixtral, Qwen3-MoE)."""

    def __init__(self, gate: Weight, top_k: int, renormalize: bool):
        self.gate, self.top_k, self.renormalize = gate, top_k, renormalize

    def __call__(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
        logits = self.gate.matmul(x, ctx.threads)  # [T, n_experts]
        T = logits.shape[0]
        idx = np.empty((T, self.top_k), np.int64)
        w = np.empty((T, self.top_k), np.float32)
        # softmax, top-k (ties to the lower index) and the renormalisation in one C pass (csrc/activations.h)
        _C.softmax_topk(logits, self.gate.rows, self.top_k, self.renormalize, idx, w)
        return idx, w


class SigmoidGroupRouter:
    """DeepSeek-V3 noaux_tc: sigmoid scores; the correction bias steers selection only; groups ranked
    by the sum of their two best biased scores; weights are the unbiased scores of the chosen
    experts, optionally renormalised, times routed_scaling_factor."""

    def __init__(
        self,
        gate: Weight,
        bias: np.ndarray | None,
        top_k: int,
        n_group: int,
        topk_group: int,
        renormalize: bool,
        scaling: float,
    ):
        self.gate, self.top_k, self.n_group, self.topk_group = gate, top_k, n_group, topk_group
        self.bias = None if bias is None else np.asarray(bias, np.float32)
        self.renormalize, self.scaling = renormalize, np.float32(scaling)

    def __call__(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
        scores = sigmoid(self.gate.matmul(x, ctx.threads))  # [T, n_experts]
        choice = scores + self.bias if self.bias is not None else scores.copy()
        T, n = choice.shape
        if self.n_group > 1:
            grouped = choice.reshape(T, self.n_group, n // self.n_group)
            top2 = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)  # [T, n_group]
            keep = topk_desc(top2, self.topk_group)
            mask = np.zeros((T, self.n_group), bool)
            mask[per_row(keep)] = True
            choice = np.where(np.repeat(mask, n // self.n_group, axis=-1), choice, -np.inf)
        idx = topk_desc(choice, self.top_k)
        w = scores[per_row(idx)]
        if self.renormalize:
            w = w / (np.add.reduce(w, axis=-1, keepdims=True) + np.float32(1e-20))
        return idx, (w * self.scaling).astype(np.float32)


@dataclass
class Expert:
    gate: Weight  # [I, E]
    up: Weight  # [I, E]
    down: Weight  # [E, I]
    act: Glu = silu_glu

    def __call__(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        return glu_many([(self, x)], ctx)[0]


class ExpertSource(Protocol):
    """Where a MoE layer's routed experts come from: all in memory (ResidentExperts), or read on demand
    within a budget (runtime/expert_cache.py StreamedExperts, from a packed store, a checkpoint's own
    tensors or a GGUF's stacked ones). Every source serves the same bytes, so the layer computes the
    same numbers from any of them."""

    at_hand: bool  # every expert can be taken by index at any time (decode's one-pass path)

    def __len__(self) -> int: ...

    def __getitem__(self, e: int) -> Expert: ...

    def fetch(self, ids: list[int]) -> Iterable[list[tuple[int, Expert]]]:
        """The experts ids (sorted, distinct), in groups of (id, expert); a group's experts stay valid
        until the next group is asked for."""
        ...

    def announce(self, x: np.ndarray, ctx: Ctx) -> None:
        """The layer's router input [T, E], given before fetch (a streamed source predicts the next
        layer's experts from it)."""
        ...


class ResidentExperts(list[Expert]):
    """Every expert of a layer in memory (or in a memory map): one group with all that are asked for."""

    at_hand = True

    def fetch(self, ids: list[int]) -> Iterable[list[tuple[int, Expert]]]:
        return [[(e, self[e]) for e in ids]]

    def announce(self, x: np.ndarray, ctx: Ctx) -> None:
        pass


def expert_source(experts: ExpertSource | list[Expert]) -> ExpertSource:
    """A builder's list of experts as a ResidentExperts; any other source as it is."""
    if isinstance(experts, list) and not isinstance(experts, ResidentExperts):
        return ResidentExperts(experts)
    return experts


class MoE:
    """Routed experts (+ shared experts). Each token's outputs are summed in its own top-k order, and
    a batch is computed expert by expert over the tokens that chose it, so the result for a token is
    identical whether it comes alone (decode) or in a batch (prefill)."""

    def __init__(self, router: Router, experts: ExpertSource | list[Expert], shared: DenseMLP | None):
        self.router, self.experts, self.shared = router, expert_source(experts), shared

    def __call__(self, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        idx, w = self.router(x, ctx)  # [T, k] each
        self.experts.announce(x, ctx)
        out = mix_experts(self.experts, x, idx, w, ctx)
        if self.shared is not None:
            out += self.shared(x, ctx)
        return out


def mix_experts(experts: ExpertSource, x: np.ndarray, idx: np.ndarray, w: np.ndarray, ctx: Ctx) -> np.ndarray:
    """sum_j w[t, j] * experts[idx[t, j]](x[t]) for every token t, summed in top-k order j = 0, 1, ...
    Each distinct expert runs once over all the tokens that chose it. Whatever the source serves the
    experts from (memory, or a cache that hands them over in groups), every expert computes from the same
    bytes, so the result is the same."""
    T, k = idx.shape
    if T == 1 and experts.at_hand:  # decode, all at hand: one pass in slot order, summed on the way
        return glu_one_x([experts[e] for e in idx[0].tolist()], x, ctx, w[0])
    ids = sorted({int(e) for e in idx.ravel()})
    groups = experts.fetch(ids)
    if T == 1:  # decode: each chosen expert once, at its slot in the top-k order, all on the one x
        slots = idx[0].tolist()
        slot_of = {e: j for j, e in enumerate(slots)}
        by_slot: np.ndarray | None = None  # [k, out]: row j = expert_{idx[0, j]}(x)
        out: np.ndarray | None = None
        served = 0
        for group in groups:
            if len(group) == k:  # all of them in one group (the usual case): as when all are at hand
                of = dict(group)
                out = glu_one_x([of[e] for e in slots], x, ctx, w[0])
            elif group:
                y = glu_one_x([expert for _, expert in group], x, ctx)  # [n, out]; x prepared once for all
                if by_slot is None:
                    by_slot = np.empty((k, y.shape[1]), np.float32)
                by_slot[[slot_of[e] for e, _ in group]] = y
            served += len(group)
        assert served == k, "the expert set did not serve every chosen expert"
        if out is not None:
            return out
        assert by_slot is not None
        return combine_slots(by_slot, np.arange(k, dtype=np.int64)[None, :], w, ctx)  # [1, out]
    # the (token, slot) pairs t * k + j grouped by expert, in token order within each (as np.nonzero(idx == e)
    # gives them) with one stable sort: expert e's are flat[a_e:b_e], and its tokens' rows of xs
    flat_idx = idx.ravel()
    flat = np.argsort(flat_idx, kind="stable")
    bounds = np.searchsorted(flat_idx[flat], [*ids, np.iinfo(np.int64).max]).tolist()
    span = {e: slice(a, b) for e, a, b in zip(ids, bounds[:-1], bounds[1:], strict=True)}
    xs = x[flat // k]  # [T * k, E]: every expert's tokens, one contiguous run each
    ys: np.ndarray | None = None  # [T * k, out]: the experts' outputs, in the rows of xs
    for group in groups:
        if not group:
            continue
        if ys is None:
            ys = np.empty((T * k, group[0][1].down.rows), np.float32)
        glu_many([(expert, xs[span[e]]) for e, expert in group], ctx, [ys[span[e]] for e, _ in group])
    assert ys is not None
    row = np.empty_like(flat)  # [T, k]: the row of ys holding expert_{idx[t, j]}(x[t])
    row[flat] = np.arange(flat.size)
    return combine_slots(ys, row.reshape(T, k), w, ctx)


def combine_slots(ys: np.ndarray, rows: np.ndarray, w: np.ndarray, ctx: Ctx) -> np.ndarray:
    """out[t] = ys[rows[t, 0]] * w[t, 0] + ys[rows[t, 1]] * w[t, 1] + ... [T, out] (ys [N, out], rows int64 and
    w [T, k]): slot by slot, each product a float32 multiply and each sum a float32 add, in top-k order, in C
    on the threads (numpy's gathers and passes took 2-3 ms a layer of a 128-token prefill)."""
    T, k = rows.shape
    out = np.empty((T, ys.shape[1]), np.float32)
    rows = np.ascontiguousarray(rows, np.int64)
    _C.moe_combine(ys, rows, np.ascontiguousarray(w, np.float32), out, ys.shape[1], T, k, ctx.threads)
    return out


class TrunkHooks(Protocol):
    """Called around each part of the trunk ("embed", "layer.N", "head") so a streaming runtime can
    read the next part ahead and drop an unpinned part once it has run."""

    def enter(self, group: str) -> None: ...

    def leave(self, group: str) -> None: ...


FFN = DenseMLP | MoE


class Attention(Protocol):
    """Any token mixer: GQA, MLA, KDA. The cache holds whatever it carries between calls."""

    def new_cache(self) -> Any: ...

    def __call__(self, x: np.ndarray, cache: Any, ctx: Ctx) -> np.ndarray: ...


# ---- the decoder ----------------------------------------------------------------------------------


@dataclass
class Rows:
    """Where each sequence's positions sit in a step over several sequences (concurrent requests, a prefill
    chunk beside decoding tokens): sequence i's rows of the step's activations are spans[i]. Every part but
    attention works row by row (norms, products, the experts: each expert runs once over all the rows
    that chose it, combined in each row's own top-k order), so a row's result does not depend on the
    other rows in the step; attention runs per sequence on its own cache."""

    spans: list[slice]
    flat_ids: np.ndarray  # [T] int64: every sequence's ids, one after another
    head: np.ndarray  # [R] int64: the rows the head computes logits for
    head_spans: list[slice]  # sequence i's logits are head_spans[i] of the head's output
    # stepwise[i]: sequence i's positions are successive decode steps (a speculative draft under
    # verification), each attended as if it came alone, so that its logits have the bits one-token
    # decoding gives them; otherwise they are a prompt chunk, attended in one pass
    stepwise: list[bool]

    @classmethod
    def of(cls, ids: list[list[int]], all_logits: list[bool] | None = None, stepwise: list[bool] | None = None) -> Rows:
        every = all_logits or [False] * len(ids)
        spans: list[slice] = []
        head: list[int] = []
        head_spans: list[slice] = []
        t = 0
        for seq, all_rows in zip(ids, every, strict=True):
            if not seq:
                raise ValueError("every sequence in a step needs at least one position")
            spans.append(slice(t, t + len(seq)))
            picked = range(t, t + len(seq)) if all_rows else [t + len(seq) - 1]
            head_spans.append(slice(len(head), len(head) + len(picked)))
            head.extend(picked)
            t += len(seq)
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=t)
        steps = stepwise or [False] * len(ids)
        if len(steps) != len(ids):
            raise ValueError("one stepwise flag per sequence")
        return cls(spans, flat, np.asarray(head, np.int64), head_spans, steps)

    def split_head(self, logits: np.ndarray) -> list[np.ndarray]:
        return [logits[s] for s in self.head_spans]


class SplitAttention(Protocol):
    """An attention whose products are row by row (project, output) around a per-sequence core (mix), so
    that a step's sequences share one read of the projection weights."""

    def project(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, ...]: ...

    def mix(self, projected: tuple[np.ndarray, ...], cache: Any, ctx: Ctx) -> np.ndarray: ...

    def output(self, o: np.ndarray, x: np.ndarray, ctx: Ctx) -> np.ndarray: ...


def attend(attn: Attention, x: np.ndarray, rows: Rows, caches: list[Any], ctx: Ctx) -> np.ndarray:
    """attn over each sequence's rows of x [T, E] with that sequence's cache, as if each came alone (a
    stepwise sequence's rows one position at a time, as decoding feeds them)."""
    if len(caches) == 1 and not rows.stepwise[0]:
        return attn(x, caches[0], ctx)
    split = cast(SplitAttention, attn)
    projected = split.project(x, ctx)
    mixed = []
    for span, cache, stepwise in zip(rows.spans, caches, rows.stepwise, strict=True):
        mine = tuple(a[span] for a in projected)
        if not stepwise:
            mixed.append(split.mix(mine, cache, ctx))
            continue
        remember = getattr(cache, "remember", None)
        if remember is not None:  # a recurrent state cannot be cut back: it keeps what rewind replays
            remember(split, mine)
        mixed.extend(split.mix(tuple(a[r : r + 1] for a in mine), cache, ctx) for r in range(span.stop - span.start))
    return split.output(np.concatenate(mixed), x, ctx)


@dataclass
class Block:
    input_norm: np.ndarray
    attn: Attention
    post_norm: np.ndarray
    ffn: FFN
    eps: float

    def __call__(self, x: np.ndarray, rows: Rows, caches: list[Any], ctx: Ctx) -> np.ndarray:
        h = x + attend(self.attn, rms_norm(x, self.input_norm, self.eps), rows, caches, ctx)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps), ctx)


@dataclass
class State:
    """Everything a sequence carries between calls: the caches of every layer and the ids so far."""

    caches: list[Any]
    ids: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.ids)

    def snapshot(self) -> tuple[int, list[Any]]:
        """What restore() needs to bring the state back to now, whatever is fed in between."""
        return len(self.ids), [c.snapshot() for c in self.caches]

    def restore(self, snap: tuple[int, list[Any]]) -> None:
        n, caches = snap
        for cache, saved in zip(self.caches, caches, strict=True):
            cache.restore(saved)
        del self.ids[n:]

    def rewind(self, length: int, ctx: Ctx) -> None:
        """Takes the positions from `length` on back out (rejected speculative drafts): the state is then
        bit for bit what feeding only the first `length` ids gave."""
        if not 0 <= length <= len(self.ids):
            raise ValueError(f"cannot rewind {len(self.ids)} positions to {length}")
        for cache in self.caches:
            cache.rewind(length, ctx)
        del self.ids[length:]


class Model(Protocol):
    """What generation needs from an architecture's network."""

    vocab_size: int

    def new_state(self) -> State: ...

    def forward(self, ids: list[int], state: State, ctx: Ctx, all_logits: bool = False) -> np.ndarray: ...

    def forward_batch(
        self,
        ids: list[list[int]],
        states: list[State],
        ctx: Ctx,
        all_logits: list[bool] | None = None,
        stepwise: list[bool] | None = None,
    ) -> list[np.ndarray]: ...


class Decoder:
    """embed -> blocks -> final norm -> lm_head."""

    def __init__(
        self,
        embed: Weight,
        blocks: list[Block],
        norm: np.ndarray,
        lm_head: Weight,
        eps: float,
        vocab_size: int,
    ):
        self.embed, self.blocks, self.norm, self.lm_head, self.eps = embed, blocks, norm, lm_head, eps
        self.vocab_size = vocab_size
        self.hooks: TrunkHooks | None = None

    def new_state(self) -> State:
        return State([b.attn.new_cache() for b in self.blocks])

    def forward(self, ids: list[int], state: State, ctx: Ctx, all_logits: bool = False) -> np.ndarray:
        """Runs ids (continuing state) and returns logits [T, vocab] (all_logits) or [1, vocab]."""
        return self.forward_batch([ids], [state], ctx, [all_logits])[0]

    def forward_batch(
        self,
        ids: list[list[int]],
        states: list[State],
        ctx: Ctx,
        all_logits: list[bool] | None = None,
        stepwise: list[bool] | None = None,
    ) -> list[np.ndarray]:
        """One step over several sequences: ids[i] continues states[i]; each sequence's logits as forward
        gives them alone (Rows)."""
        rows = Rows.of(ids, all_logits, stepwise)
        hooks = self.hooks
        if hooks:
            hooks.enter("embed")
        x = self.embed.dequantize_rows(rows.flat_ids)  # [T, E], every sequence's rows one after another
        if hooks:
            hooks.leave("embed")
        for i, block in enumerate(self.blocks):
            if hooks:
                hooks.enter(f"layer.{i}")
            x = block(x, rows, [st.caches[i] for st in states], ctx)
            if hooks:
                hooks.leave(f"layer.{i}")
        for st, seq in zip(states, ids, strict=True):
            st.ids.extend(int(i) for i in seq)
        if hooks:
            hooks.enter("head")
        h = rms_norm(x[rows.head], self.norm, self.eps)
        logits = self.lm_head.matmul(h, ctx.threads)
        if hooks:
            hooks.leave("head")
        return rows.split_head(logits)
