"""The C pieces of the decode step against the numpy steps they replace. RMSNorm: numpy's float32 bits.
Decode attention (one new token against the key/value cache): the new key written to the cache has the
numpy steps' bits, the output is softmax attention to float rounding, the sliding window is honoured,
and the bits depend on neither the instruction set nor the thread count. Prefill attention splits its
heads among threads (over_heads) with the same bits at every thread count; its two products (scores,
then p V) go through gemm_f32, one fused multiply-add chain per element, the same bits on every
instruction set."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from moestream import _C
from moestream.config import RopeSpec
from moestream.models.base import (
    Ctx,
    GQAttention,
    KVCache,
    Linear,
    MLAttention,
    Rope,
    matmul_f32,
    over_heads,
    rms_norm,
)
from moestream.quant import Weight
from moestream.quant.formats import quantize_fp8_reference
from moestream.runtime.streaming import derived_bytes


def numpy_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The float32 numpy expression the C norm reproduces."""
    var = np.add.reduce(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    var = var / np.float32(x.shape[-1])
    return (w * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))).astype(np.float32, copy=False)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 127, 128, 129, 200, 256, 1000, 2048, 7168])
def test_rms_norm_has_the_numpy_bits(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((5, n)) * np.exp(3 * rng.standard_normal((5, 1)))).astype(np.float32)
    x[3] = 0  # a zero row: eps alone
    w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    for eps in (1e-6, 1e-5):
        assert rms_norm(x, w, eps).tobytes() == numpy_rms_norm(x, w, eps).tobytes()
        assert rms_norm(x[1], w, eps).tobytes() == numpy_rms_norm(x[1], w, eps).tobytes()
    xf = np.asfortranarray(x)  # not C-contiguous: the numpy expression itself
    assert rms_norm(xf, w, 1e-6).tobytes() == numpy_rms_norm(xf, w, 1e-6).tobytes()
    f64 = x.astype(np.float64)  # not float32: the numpy expression itself
    assert rms_norm(f64, w, 1e-6).dtype == np.float32
    with pytest.raises(ValueError):
        _C.rms_norm(x, w[:-1] if n > 1 else np.zeros(2, np.float32), 1e-6, np.empty_like(x))


def numpy_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """The float32 numpy steps the C rope reproduces: x [T, heads, D], cos and sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 4, 8), (37, 5, 64), (128, 32, 128)])
def test_rope_has_the_numpy_bits(shape, interleave):
    """Rope.apply on a float32 [T, heads, D] array runs in one C pass (_C.rope) with the bits of the numpy
    steps, YaRN's attention factor included; other layouts (a strided view) take the numpy steps."""
    T, H, D = shape
    rng = np.random.default_rng(T * H + D)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    for spec in (
        RopeSpec(theta=10000.0, dim=D, interleave=interleave),
        RopeSpec(theta=1e6, dim=D, interleave=interleave, kind="yarn", factor=4.0, original_max_position_embeddings=64),
    ):
        rope = Rope(spec)
        cos, sin = rope.cos_sin(11, T)
        want = numpy_rope(x, cos, sin, interleave).tobytes()
        assert rope.apply(x, cos, sin).tobytes() == want
        wide = np.zeros((T, H, D + 3), np.float32)
        wide[..., :D] = x
        assert rope.apply(wide[..., :D], cos, sin).tobytes() == want  # not C-contiguous: numpy
    longer = np.zeros((T + 1, D // 2), np.float32)  # a position too many
    with pytest.raises(ValueError, match="do not add up"):
        _C.rope(x, longer, longer, T, H, D, interleave, np.empty_like(x))
    with pytest.raises(ValueError, match="must not be x"):
        _C.rope(x, cos, sin, T, H, D, interleave, x)
    with pytest.raises(ValueError, match="float32"):
        _C.rope(x.astype(np.float64), cos, sin, T, H, D, interleave, np.empty_like(x))


def make_attention(H: int, KV: int, D: int, norms: bool, interleave: bool = False, window: int | None = None):
    rng = np.random.default_rng(H * 1000 + D)
    E = 48

    def lin(rows: int, cols: int = E) -> Linear:
        return Linear(Weight(rng.standard_normal((rows, cols)).astype(np.float32) / np.float32(7)))

    rope = Rope(RopeSpec(theta=10000.0, dim=D, interleave=interleave))
    qn = kn = None
    if norms:
        qn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        kn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    attn = GQAttention(lin(H * D), lin(KV * D), lin(KV * D), lin(E, H * D), H, KV, D, rope, qn, kn, 1e-6, window)
    return attn, rng


def filled_cache(attn: GQAttention, rng: np.random.Generator, length: int) -> KVCache:
    cache = attn.new_cache()
    cache.reserve(length + 1)
    cache.k[:, :length] = rng.standard_normal((attn.kv_heads, length, attn.head_dim))
    cache.v[:, :length] = rng.standard_normal((attn.kv_heads, length, attn.head_dim))
    cache.length = length
    return cache


def numpy_decode(attn: GQAttention, q, k, v, keys, values, pos):
    """The numpy steps of GQAttention for one token at pos: (new key [KV, D], its value, output [H*D] in
    float64). keys, values [KV, pos, D] are the cache before it."""
    H, KV, D = attn.heads, attn.kv_heads, attn.head_dim
    q, k = q.reshape(1, H, D), k.reshape(1, KV, D)
    if attn.q_norm is not None and attn.k_norm is not None:
        q = numpy_rms_norm(q, attn.q_norm, attn.norm_eps)
        k = numpy_rms_norm(k, attn.k_norm, attn.norm_eps)
    cos, sin = attn.rope.cos_sin(pos, 1)
    interleave = attn.rope.spec.interleave
    q, k = numpy_rope(q, cos, sin, interleave)[0], numpy_rope(k, cos, sin, interleave)[0]  # [H, D], [KV, D]
    K = np.concatenate([keys, k[:, None]], axis=1).astype(np.float64)  # [KV, S, D]
    V = np.concatenate([values, v.reshape(KV, 1, D)], axis=1).astype(np.float64)
    lo = 0 if attn.sliding_window is None else max(0, pos - attn.sliding_window + 1)
    out = np.empty((H, D))
    for h in range(H):
        s = K[h // (H // KV), lo:] @ q[h].astype(np.float64) * float(attn.scaling)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ V[h // (H // KV), lo:]
    return k, v.reshape(KV, D), out.reshape(-1)


@pytest.mark.parametrize(
    "H,KV,D,norms,interleave,window",
    [
        (8, 2, 128, True, False, None),
        (4, 4, 64, False, True, None),
        (6, 3, 80, True, False, 5),
        (2, 1, 36, True, True, 1),
    ],
)
@pytest.mark.parametrize("pos", [37, 700])  # 700: several blocks of positions (64 at D = 128)
def test_decode_matches_numpy_steps(H, KV, D, norms, interleave, window, pos):
    attn, rng = make_attention(H, KV, D, norms, interleave, window)
    cache = filled_cache(attn, rng, pos)
    keys, values = cache.k[:, :pos].copy(), cache.v[:, :pos].copy()
    x = rng.standard_normal((1, 48)).astype(np.float32)
    q, k, v = attn.q(x, Ctx()), attn.k(x, Ctx()), attn.v(x, Ctx())
    out = attn._decode(q, k, v, cache, Ctx(threads=2))
    new_k, new_v, ref = numpy_decode(attn, q, k, v, keys, values, pos)
    assert cache.length == pos + 1
    assert cache.k[:, pos].tobytes() == new_k.tobytes()  # the bits of the numpy norm and rope
    assert cache.v[:, pos].tobytes() == new_v.tobytes()
    assert np.array_equal(cache.k[:, :pos], keys)  # nothing else written
    assert np.abs(out[0] - ref).max() <= 2e-6 * np.abs(ref).max()


def test_window_attends_only_to_the_last_positions():
    attn, rng = make_attention(4, 2, 64, True, window=3)
    cache = filled_cache(attn, rng, 20)
    x = rng.standard_normal((1, 48)).astype(np.float32)
    q, k, v = attn.q(x, Ctx()), attn.k(x, Ctx()), attn.v(x, Ctx())
    before = attn._decode(q, k, v, cache, Ctx())
    cache.length = 20
    cache.k[:, :17] = 1e3  # positions out of the window: changing them changes nothing
    cache.v[:, :17] = -1e3
    assert attn._decode(q, k, v, cache, Ctx()).tobytes() == before.tobytes()


def unaligned(a: np.ndarray) -> np.ndarray:
    """a's float32 values at an odd byte address, as a tensor of a mapped checkpoint can lie."""
    raw = np.zeros(a.nbytes + 1, np.uint8)
    out = raw[1:].view(np.float32)
    out[:] = a
    assert not out.flags.aligned
    return out


def test_unaligned_weights_are_taken():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    assert rms_norm(x, unaligned(w), 1e-6).tobytes() == rms_norm(x, w, 1e-6).tobytes()
    attn, rng = make_attention(4, 2, 64, True)
    twin = GQAttention(
        attn.q, attn.k, attn.v, attn.o, 4, 2, 64, attn.rope, unaligned(attn.q_norm), unaligned(attn.k_norm)
    )
    x = rng.standard_normal((1, 48)).astype(np.float32)
    assert twin(x, twin.new_cache(), Ctx()).tobytes() == attn(x, attn.new_cache(), Ctx()).tobytes()


@pytest.mark.parametrize("D", [36, 64, 80, 128, 256])
@pytest.mark.parametrize("H,KV", [(8, 2), (6, 2)])  # 6 / 2: a pair of heads and one alone in each group (AVX2)
def test_same_bits_on_every_isa_and_thread_count(D, H, KV):
    attn, rng = make_attention(H, KV, D, True)
    x = rng.standard_normal((1, 48)).astype(np.float32)
    q, k, v = attn.q(x, Ctx()), attn.k(x, Ctx()), attn.v(x, Ctx())
    results = {}
    before = _C.get_isa()
    try:
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            for threads in (1, 2):
                cache = filled_cache(attn, np.random.default_rng(1), 300)  # enough work for two threads
                results[isa, threads] = attn._decode(q, k, v, cache, Ctx(threads=threads)).tobytes()
    finally:
        _C.set_isa(before)
    assert len(set(results.values())) == 1, list(results)


def test_incremental_decode_matches_prefill():
    """Token by token through the C path == all tokens at once through the numpy path, to rounding."""
    attn, rng = make_attention(8, 4, 64, True)
    x = rng.standard_normal((9, 48)).astype(np.float32)
    whole = attn(x, attn.new_cache(), Ctx())
    cache = attn.new_cache()
    steps = np.concatenate([attn(x[t : t + 1], cache, Ctx()) for t in range(9)])
    assert np.abs(steps - whole).max() <= 1e-5 * np.abs(whole).max()


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def test_bad_arguments_raise():
    H, KV, D = 4, 2, 8
    q, k = np.zeros(H * D, np.float32), np.zeros(KV * D, np.float32)
    kc, vc = np.zeros((KV, 4, D), np.float32), np.zeros((KV, 4, D), np.float32)
    cs, out = np.zeros(D // 2, np.float32), np.zeros(H * D, np.float32)

    def call(**change):
        a = dict(q=q, k=k, v=k, kc=kc, vc=vc, pos=0, H=H, KV=KV, D=D, cos=cs, out=out)
        a.update(change)
        _C.gqa_decode(a["q"], a["k"], a["v"], a["kc"], a["vc"], a["pos"], a["H"], a["KV"], a["D"], None, None,
                      1e-6, a["cos"], a["cos"], False, 1.0, 0, a["out"], 1)  # fmt: skip

    call()
    for change in (
        dict(q=q[:-1]),
        dict(KV=3),
        dict(D=7),
        dict(pos=4),
        dict(pos=-1),
        dict(vc=vc[:, :3].copy()),
        dict(cos=cs[:-1]),
        dict(out=np.zeros(H * D, np.float64)),
        dict(q=np.zeros(H * D // 2, np.float64)),  # the same bytes, not float32
        dict(kc=read_only(kc)),
        dict(q=np.zeros(2 * H * D, np.float32)[::2]),  # not contiguous
    ):
        with pytest.raises(ValueError):
            call(**change)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_over_heads_takes_every_head_once(n, threads):
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def fn(part: slice) -> None:
        with lock:
            seen.append((part.start, part.stop, threading.get_ident()))

    over_heads(fn, n, threads)
    seen.sort()
    assert [h for a, b, _ in seen for h in range(a, b)] == list(range(n))  # contiguous, each head once
    assert all(b > a for a, b, _ in seen)
    assert len(seen) == min(n, threads)
    idents = {ident for _, _, ident in seen}
    # the caller takes the first part, pool threads the others (an idle one may take two short parts)
    assert threading.get_ident() in idents and (len(idents) > 1) == (min(n, threads) > 1)


@pytest.mark.parametrize("failing", [0, 2])
def test_over_heads_raises_what_a_part_raises(failing):
    """Whichever part raises (the caller's or a pool thread's), every part has finished when it does."""
    finished: list[int] = []

    def fn(part: slice) -> None:
        if part.start == failing:
            raise ValueError("part")
        time.sleep(0.05)
        finished.append(part.start)

    with pytest.raises(ValueError, match="part"):
        over_heads(fn, 4, 4)
    assert sorted(finished) == [h for h in range(4) if h != failing]


def check_prefill_after_prefix(attn, rng: np.random.Generator, n_prefix: int, n: int) -> None:
    """n positions prefilled after a cached prefix of n_prefix, the heads split among 1..4 threads: the same
    bytes at every thread count, and to rounding what one-token decode gives position by position."""
    prefix = rng.standard_normal((n_prefix, 48)).astype(np.float32)
    x = rng.standard_normal((n, 48)).astype(np.float32)
    outs = []
    for threads in (1, 2, 3, 4):
        cache = attn.new_cache()
        attn(prefix, cache, Ctx(threads))
        outs.append(attn(x, cache, Ctx(threads)).tobytes())
    assert len(set(outs)) == 1
    cache = attn.new_cache()
    attn(prefix, cache, Ctx())
    steps = np.concatenate([attn(x[t : t + 1], cache, Ctx()) for t in range(len(x))])
    whole = np.frombuffer(outs[0], np.float32).reshape(steps.shape)
    assert np.abs(steps - whole).max() <= 1e-5 * np.abs(whole).max()


@pytest.mark.parametrize(
    "H,KV,window,n_prefix,n",
    [(8, 4, None, 5, 11), (6, 3, 4, 5, 11), (4, 1, None, 5, 11), (4, 2, None, 70, 150), (4, 2, 40, 70, 150)],
)
def test_prefill_same_bits_at_every_thread_count(H, KV, window, n_prefix, n):
    """A prompt after a cached prefix, its heads split among 1..4 threads: the same bytes, and softmax
    attention to rounding (the whole prompt token by token through the C decode). 150 positions take
    three blocks of queries (PREFILL_QUERIES), and a window of 40 leaves keys before the blocks'."""
    attn, rng = make_attention(H, KV, 32, True, window=window)
    check_prefill_after_prefix(attn, rng, n_prefix, n)


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_is_the_plain_formula(interleave):
    """Rope.apply, written into place, has the bits of [x1 c - x2 s, x2 c + x1 s] computed the plain way."""
    rng = np.random.default_rng(11)
    rope = Rope(RopeSpec(theta=10000.0, dim=64, interleave=interleave))
    x = rng.standard_normal((7, 3, 64)).astype(np.float32)  # [T, heads, dim]
    cos, sin = rope.cos_sin(5, 7)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :32], x[..., 32:])
    c, s = cos[:, None, :], sin[:, None, :]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    got = rope.apply(x, cos, sin)
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()


def make_mla(H: int = 4, nope: int = 16, rope_dim: int = 8, v_dim: int = 16, rank: int = 24):
    rng = np.random.default_rng(17)
    E = 48

    def lin(rows: int, cols: int = E) -> Linear:
        return Linear(Weight(rng.standard_normal((rows, cols)).astype(np.float32) / np.float32(7)))

    return MLAttention(
        q_proj=lin(H * (nope + rope_dim)),
        q_a_proj=None,
        q_a_norm=None,
        q_b_proj=None,
        kv_a_proj=lin(rank + rope_dim),
        kv_a_norm=(1 + 0.1 * rng.standard_normal(rank)).astype(np.float32),
        kv_b_proj=lin(H * (nope + v_dim), rank),
        o_proj=lin(E, H * v_dim),
        heads=H,
        nope_dim=nope,
        rope_dim=rope_dim,
        v_dim=v_dim,
        kv_lora_rank=rank,
        rope=Rope(RopeSpec(theta=10000.0, dim=rope_dim, interleave=True)),
        scaling=(nope + rope_dim) ** -0.5,
        norm_eps=1e-6,
    ), rng


def test_mla_prefill_same_bits_at_every_thread_count():
    """MLA prefill of 150 positions after a cached prefix of 70: the same bytes on 1..4 threads, and to
    rounding what the absorbed one-token decode gives position by position."""
    attn, rng = make_mla()
    check_prefill_after_prefix(attn, rng, 70, 150)


def on_every_isa(fn):
    before = _C.get_isa()
    try:
        out = {}
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            out[isa] = fn()
        return out
    finally:
        _C.set_isa(before)


@pytest.mark.parametrize(
    "m,k,n", [(1, 1, 1), (7, 13, 37), (6, 128, 32), (13, 64, 33), (512, 128, 70), (5, 0, 3), (0, 4, 4)]
)
@pytest.mark.parametrize("b_transposed", [False, True])
def test_gemm_f32_same_bits_on_every_isa_and_within_rounding(m, k, n, b_transposed):
    """Every row tile (6 and its tails) and column panel (16 / 32 and their tails), both layouts of b: the
    same bytes on every instruction set, and the float64 product to within a k-step chain's rounding."""
    rng = np.random.default_rng(m * 1000 + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if b_transposed else (k, n)).astype(np.float32)
    results = on_every_isa(lambda: matmul_f32(a, b, b_transposed).tobytes())
    assert len(set(results.values())) == 1, list(results)
    out = np.frombuffer(results["scalar"], np.float32).reshape(m, n)
    bt = b.T if b_transposed else b
    exact = a.astype(np.float64) @ bt.astype(np.float64)
    bound = (k + 1) * 2.0**-24 * (np.abs(a).astype(np.float64) @ np.abs(bt).astype(np.float64))
    assert np.all(np.abs(out - exact) <= bound)


def test_gemm_f32_is_one_fused_chain_in_order():
    """(-1) * 1 first, then fma((1 + 2^-12)^2, -1) = 2^-11 + 2^-24 exactly: a rounded product (2^-11) or the
    other order (1 + 2^-11, then - 1) gives 2^-11."""
    e = np.float32(1 + 2.0**-12)
    a = np.array([[-1.0, e]] * 7, np.float32)  # 7 rows: a tile of 6 and a tail
    b = np.tile(np.array([[1.0], [e]], np.float32), (1, 40))  # [2, 40]: a panel and a tail
    want = np.float32(2.0**-11 + 2.0**-24)
    for out in on_every_isa(lambda: matmul_f32(a, b)).values():
        assert np.all(out == want)
    for out in on_every_isa(lambda: matmul_f32(a, np.ascontiguousarray(b.T), b_transposed=True)).values():
        assert np.all(out == want)


def test_gemm_f32_bad_arguments_raise():
    a, b, out = np.zeros((3, 4), np.float32), np.zeros((4, 5), np.float32), np.zeros((3, 5), np.float32)
    _C.gemm_f32(a, b, out, 3, 4, 5, False)
    for args in (
        (a, b, out, 3, 4, 6, False),  # sizes that do not add up
        (a, b, out, -3, 4, 5, False),
        (a.astype(np.float64), b, out, 3, 4, 5, False),
        (a, b, read_only(out), 3, 4, 5, False),
        (np.zeros((3, 8), np.float32)[:, ::2], b, out, 3, 4, 5, False),  # not contiguous
    ):
        with pytest.raises(ValueError):
            _C.gemm_f32(*args)


def test_prefill_same_bits_on_every_isa():
    attn, rng = make_attention(8, 2, 32, True)
    x = rng.standard_normal((70, 48)).astype(np.float32)
    results = on_every_isa(lambda: attn(x, attn.new_cache(), Ctx(2)).tobytes())
    assert len(set(results.values())) == 1, list(results)


@pytest.mark.parametrize("nope,v_dim", [(16, 16), (128, 128)])
def test_mla_decode_with_fp8_kv_b_proj(nope, v_dim, monkeypatch):
    """An fp8 kv_b_proj whose head blocks start at multiples of 128 rows is multiplied by its own bytes
    (direct), any other through f32 copies of its absorbed halves, which the planner counts
    (derived_bytes); either way one-token decode gives prefill's attention to rounding, and the direct
    path gives what the copies give, to rounding."""
    attn, rng = make_mla(H=2, nope=nope, v_dim=v_dim)
    w = attn.kv_b_proj.weight.dequantize()
    attn.kv_b_proj = Linear(Weight(*quantize_fp8_reference(w)))
    assert attn.direct == (nope % 128 == 0)
    layers = [dataclasses.make_dataclass("Layer", ["attn"])(attn)]
    want = 0 if attn.direct else 2 * 2 * (nope + v_dim) * attn.rank * 4  # the copies, and one made at a time
    assert derived_bytes(dataclasses.make_dataclass("Decoder", ["layers"])(layers)) == want
    check_prefill_after_prefix(attn, rng, 5, 11)
    if attn.direct:
        cache = attn.new_cache()
        attn(rng.standard_normal((6, 48)).astype(np.float32), cache, Ctx())
        x = rng.standard_normal((1, 48)).astype(np.float32)
        direct = attn(x, cache, Ctx())
        cache.length -= 1  # the same position again
        monkeypatch.setattr(MLAttention, "direct", property(lambda self: False))  # the f32 copies instead
        copies = attn(x, cache, Ctx())
        assert np.abs(direct - copies).max() <= 1e-5 * np.abs(copies).max()


def test_softmax_exp_within_an_ulp_with_the_same_bits_on_every_isa():
    """The decode softmax's exp (csrc/exp_f32.h) against float64, on a sweep of its range, with the limits
    it states; every instruction set gives the scalar path's bits."""
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [np.linspace(-87.3, 88.3, 1_000_001, dtype=np.float32), -30 * rng.random(200_000, dtype=np.float32)]
    )
    special = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, -87.31, -100.0, 88.31, 1e3, -1e-30], np.float32)
    results = {}
    before = _C.get_isa()
    try:
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            p, q = x.copy(), special.copy()
            _C.exp_shifted(p, 0.0)
            _C.exp_shifted(q, 0.0)
            results[isa] = p.tobytes() + q.tobytes()
    finally:
        _C.set_isa(before)
    assert len(set(results.values())) == 1, list(results)
    p = x.copy()
    _C.exp_shifted(p, 0.0)
    ref = np.exp(x.astype(np.float64))
    ulp = np.abs(p - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert ulp.max() <= 1.0
    q = special.copy()
    _C.exp_shifted(q, 0.0)
    assert q[:2].tolist() == [1.0, 1.0] and q[2] == 0.0 and q[3] == np.inf and np.isnan(q[4])
    assert q[5:7].tolist() == [0.0, 0.0] and q[7:9].tolist() == [np.inf, np.inf] and q[9] == 1.0
    shifted = x[:1000] + np.float32(3.0)  # exp(p - m): the shift taken off in float32 first
    _C.exp_shifted(shifted, 3.0)
    expect = (x[:1000] + np.float32(3.0)) - np.float32(3.0)
    _C.exp_shifted(expect, 0.0)
    assert shifted.tobytes() == expect.tobytes()
