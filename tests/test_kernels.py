"""C kernels against the numpy reference, on every instruction set this CPU has: dequantization is
bit-exact, matmul is within the format's stated bound of dequantize-then-multiply, and the result does
not depend on the thread count, the batch size or the code path."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from moestream import _C
from moestream.quant import FORMATS, Weight, blocks, dequantize_reference, matmul_many
from moestream.quant.formats import quantize_fp8_reference, quantize_int4_reference, quantize_mxfp4_reference

# avx512: integer kernels without VNNI (Skylake-X); amx: avx512vbmi's, and q4_k's and q6_k's gemms of many
# tokens with AMX
ISAS = ["scalar", "avx2", "avx512", "avx512vnni", "avx512vbmi", "amx"]
SHAPES = [(1, 1), (5, 17), (37, 53), (130, 300), (64, 2048)]
MX_SHAPES = [(1, 32), (5, 64), (37, 96), (130, 320), (64, 2048)]  # mxfp4: cols divisible by 32


@pytest.fixture(params=ISAS)
def isa(request):
    if request.param not in _C.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    before = _C.get_isa()
    _C.set_isa(request.param)
    yield request.param
    _C.set_isa(before)


def make_weight(fmt: str, rows: int, cols: int, seed: int = 0) -> Weight:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if fmt == "f32":
        return Weight(w)
    if fmt == "bf16":
        return Weight(w.astype(ml_dtypes.bfloat16))
    if fmt == "f16":
        return Weight(w.astype(np.float16))
    if fmt == "fp8":
        # vary the block scales so a wrong block index shows
        w *= np.exp(rng.standard_normal((rows, 1))).astype(np.float32)
        q, s = quantize_fp8_reference(w)
        return Weight(q, s)
    if fmt == "mxfp4":
        w *= np.exp(rng.standard_normal((rows, 1))).astype(np.float32)
        packed, s8 = quantize_mxfp4_reference(w)
        return Weight(packed, s8, fmt="mxfp4")
    if fmt == "int4":
        w *= np.exp(rng.standard_normal((rows, 1))).astype(np.float32)
        packed, scale = quantize_int4_reference(w)
        return Weight(packed, scale, fmt="int4")
    if fmt in blocks.LAYOUTS:
        w *= np.exp(rng.standard_normal((rows, 1))).astype(np.float32)
        return Weight(blocks.quantize(fmt, w), fmt=fmt)
    raise AssertionError(fmt)


def shape_for(fmt: str, shape: tuple[int, int]) -> tuple[int, int]:
    """Block formats hold whole blocks per row: round the column count up."""
    block = FORMATS[fmt].block
    return (shape[0], -(-shape[1] // block) * block)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_bit_exact(isa, fmt, shape):
    w = make_weight(fmt, *shape_for(fmt, shape))
    ref = dequantize_reference(w.fmt, w.data, w.scales, w.rows, w.cols)
    got = w.dequantize(threads=2)
    assert got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_within_bound(isa, fmt, shape):
    w = make_weight(fmt, *shape_for(fmt, shape))
    x = np.random.default_rng(1).standard_normal((3, w.cols)).astype(np.float32)
    deq = dequantize_reference(w.fmt, w.data, w.scales, w.rows, w.cols).astype(np.float64)
    exact = x.astype(np.float64) @ deq.T
    bound = w.fmt.matmul_rel_bound * (np.abs(x.astype(np.float64)) @ np.abs(deq).T)
    if w.fmt.act_block:  # integer activations: half a step of each block's scale per weight
        ab = w.fmt.act_block
        amax = np.abs(x.reshape(x.shape[0], -1, ab)).max(axis=2).astype(np.float64)  # [T, blocks]
        wsum = np.abs(deq).reshape(w.rows, -1, ab).sum(axis=2)  # [rows, blocks]
        bound += (amax / (2 * w.fmt.act_levels)) @ wsum.T * (1 + 1e-3)
    got = w.matmul(x, threads=2)
    assert np.all(np.abs(got - exact) <= bound + 1e-30)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_matmul_independent_of_threads_and_batch(isa, fmt):
    w = make_weight(fmt, *shape_for(fmt, (203, 517)))
    x = np.random.default_rng(2).standard_normal((9, w.cols)).astype(np.float32)
    base = w.matmul(x, threads=1)
    for threads in (2, 3, 8):
        assert w.matmul(x, threads=threads).tobytes() == base.tobytes()
    for t in range(9):  # one token at a time (decode) == the same row of the batch (prefill)
        assert w.matmul(x[t : t + 1], threads=2).tobytes() == base[t : t + 1].tobytes()
    for n in (2, 3, 6, 7):  # batches that end in a group of 2, 3, 2 and 3 tokens (9: 4 + 4 + 1)
        assert w.matmul(x[:n], threads=2).tobytes() == base[:n].tobytes()


def test_q4_k_gemm_same_bits_with_one_or_two_sub_block_pairs_per_vpdpwssd():
    """q4_k's VNNI gemm gives every batch the scalar kernel's bits whether each vpdpwssd takes the lane sums of
    one vpdpbusd (Intel's default) or of two paired by a word blend (elsewhere), over token groups of 4, 3, 2
    and 1 and a last odd row; the setting refuses other values and reports what is in use."""
    w = make_weight("q4_k", 37, 768)
    x = np.random.default_rng(4).standard_normal((11, w.cols)).astype(np.float32)
    before_isa, before = _C.get_isa(), _C.get_q4k_pairs()[0]
    try:
        _C.set_isa("scalar")
        ref = w.matmul(x, threads=1)
        vnni = [i for i in _C.supported_isas() if i in ("avx512vnni", "avx512vbmi")]
        for isa in vnni:
            _C.set_isa(isa)
            for n in (1, 2):
                _C.set_q4k_pairs(n)
                assert _C.get_q4k_pairs() == (n, n)
                for T in (2, 3, 5, 8, 11):
                    for threads in (1, 3):
                        assert w.matmul(x[:T], threads=threads).tobytes() == ref[:T].tobytes(), (isa, n, T)
        _C.set_q4k_pairs(0)
        with open("/proc/cpuinfo") as f:
            intel = "GenuineIntel" in f.read()
        assert _C.get_q4k_pairs() == (0, 1 if intel else 2)
        for n in (-1, 3):
            with pytest.raises(ValueError, match="0 \\(automatic\\), 1 or 2"):
                _C.set_q4k_pairs(n)
    finally:
        _C.set_isa(before_isa)
        _C.set_q4k_pairs(before)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_q4_k_and_q6_k_gemms_in_tiles_of_16_8_or_4_rows_give_the_scalar_bits(fmt):
    """The q4_k and q6_k gemms take a thread's run of rows in tiles of 16 rows up to 2048 columns, 8 up to
    4096 and 4 beyond (ms_gemm_by_tiles), two rows a pass on AVX-512 and a last odd row alone: on every path,
    at 1 and 3 threads (runs of 37 and of 12-13 rows), every batch gets the scalar kernel's bits."""
    before = _C.get_isa()
    try:
        for cols in (768, 2048, 3072, 4608):
            w = make_weight(fmt, 37, cols, seed=cols)
            x = np.random.default_rng(cols).standard_normal((9, cols)).astype(np.float32)
            _C.set_isa("scalar")
            ref = w.matmul(x, threads=1)
            for isa in _C.supported_isas()[1:]:
                _C.set_isa(isa)
                for T in (2, 5, 9):
                    for threads in (1, 3):
                        assert w.matmul(x[:T], threads=threads).tobytes() == ref[:T].tobytes(), (cols, isa, T)
    finally:
        _C.set_isa(before)


@pytest.fixture
def weight_streams():
    before = _C.get_weight_streams(), _C.get_prefetch_level()
    yield _C.set_weight_streams
    _C.set_weight_streams(before[0])
    _C.set_prefetch_level(before[1])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [3, 17, 64, 203])
def test_decode_same_bits_in_one_or_four_weight_streams(isa, weight_streams, fmt, rows):
    """A thread's rows read as four interleaved runs (Intel's default, and a small L1's for wide rows) give each row
    the bits it has when read one after another, and when it is one of a batch of tokens; and so do the
    kernels whose far prefetches go into L2 (the default on a small L1) or into L1."""
    w = make_weight(fmt, *shape_for(fmt, (rows, 1100)))
    x = np.random.default_rng(3).standard_normal((5, w.cols)).astype(np.float32)
    base = w.matmul(x, threads=1)
    for n in (1, 4):
        weight_streams(n)
        for level in (1, 2):
            _C.set_prefetch_level(level)
            for threads in (1, 2, 3):
                for t in (0, 4):
                    got = w.matmul(x[t : t + 1], threads=threads)
                    assert got.tobytes() == base[t : t + 1].tobytes(), (n, level, threads)
    for n in (-1, 2, 8):
        with pytest.raises(ValueError, match="1 or 4"):
            weight_streams(n)
    for level in (0, 3):
        with pytest.raises(ValueError, match="1 or 2"):
            _C.set_prefetch_level(level)


def test_weight_streams_and_prefetch_level_follow_the_l1_and_the_cpu(weight_streams, isa):
    """Automatically, four weight streams on Intel, and where the L1 data cache is under 48 KB for the AVX2
    kernels (measured on Zen 3) and for the others for a token's activations of more than 3/8 of it (the
    tuning measured on Zen 4's 32 KB) or a thread's run of LONG_RUN_BYTES or more of a product (an output
    matrix, measured on Zen 3), else one; where the L1 is under 48 KB, prefetches reaching past a quarter of
    it go into L2. A setting of 1 or 4 holds for every product."""
    l1 = _C.l1d_bytes()
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    small = 0 < l1 < 48 * 1024
    avx2 = small and isa == "avx2"
    weight_streams(0)
    for x_bytes in (0, 2048, 3 * l1 // 8, 3 * l1 // 8 + 1, 1 << 20):
        wide = small and 8 * x_bytes > 3 * l1
        assert _C.weight_streams_for(x_bytes) == (4 if intel or avx2 or wide else 1), x_bytes
        for run in (_C.LONG_RUN_BYTES - 1, _C.LONG_RUN_BYTES, 1 << 40):
            long = small and run >= _C.LONG_RUN_BYTES
            expect = 4 if intel or avx2 or wide or long else 1
            assert _C.weight_streams_for(x_bytes, run) == expect, (x_bytes, run)
    assert _C.get_prefetch_level() == (2 if small else 1)
    assert _C.prefetch_into_l2(l1 // 4 + 64) == small and not _C.prefetch_into_l2(l1 // 4)
    _C.set_prefetch_level(1)
    assert not _C.prefetch_into_l2(1 << 20)
    _C.set_prefetch_level(2)
    assert _C.prefetch_into_l2(1 << 20)
    for n in (1, 4):
        weight_streams(n)
        assert {_C.weight_streams_for(b, r) for b in (0, 2048, 1 << 20) for r in (0, 1 << 40)} == {n}


def test_gfni_nibbles_on_the_vbmi_path_of_a_cpu_that_has_gfni(isa):
    """q4_k, q6_k and int4 split their nibbles with GFNI on the avx512vbmi path (and amx's, which runs it)
    where /proc/cpuinfo lists gfni, and with shifts on every other path; the bits are the same either way
    (test_isas_bit_identical compares the paths)."""
    with open("/proc/cpuinfo") as f:
        gfni = "gfni" in f.read().split()
    assert _C.uses_gfni() == (gfni and isa in ("avx512vbmi", "amx"))


def test_matmul_many_equals_each_product_alone(isa):
    """A batch of products over every format, some sharing x (prepared once), some with their own, of
    1 and several tokens, gives each product the bits it gets alone, at any thread count."""
    rng = np.random.default_rng(4)
    shared = {n: rng.standard_normal((n, 512)).astype(np.float32) for n in (1, 5)}
    products = []
    for i, fmt in enumerate(sorted(FORMATS)):
        w = make_weight(fmt, 4 * i + 3, 512, seed=i)
        n = (1, 5)[i % 2]
        x = shared[n] if i % 3 else rng.standard_normal((n, 512)).astype(np.float32)
        products.append((w, x))
    alone = [w.matmul(x, threads=1).tobytes() for w, x in products]
    for threads in (1, 2, 3, 7):
        outs = [np.full((x.shape[0], w.rows), np.nan, np.float32) for w, x in products]
        matmul_many([(w, x, out) for (w, x), out in zip(products, outs, strict=True)], threads)
        assert [out.tobytes() for out in outs] == alone


def test_matmul_many_prefill_batch_taken_in_shares_gives_each_product_its_bits():
    """A batch with products of several tokens (a MoE layer's prefill: many experts, each over its own few
    tokens) is shared out in small runs of tiles that the threads take in turn, so which thread runs a row
    varies from call to call: every product still gets the bits it has alone, every row once (out starts as
    NaN), at 2, 3 and 5 threads, call after call."""
    rng = np.random.default_rng(6)
    products = []
    for i in range(37):
        fmt = ("q4_k", "q6_k", "q8_0", "bf16")[i % 4]
        w = make_weight(fmt, int(rng.integers(1, 70)), 512, seed=100 + i)
        products.append((w, rng.standard_normal((int(rng.integers(1, 10)), 512)).astype(np.float32)))
    alone = [w.matmul(x, threads=1).tobytes() for w, x in products]
    for threads in (2, 3, 5):
        for _ in range(3):
            outs = [np.full((x.shape[0], w.rows), np.nan, np.float32) for w, x in products]
            matmul_many([(w, x, out) for (w, x), out in zip(products, outs, strict=True)], threads)
            assert [out.tobytes() for out in outs] == alone


def test_matmul_many_refuses_bad_products():
    w = make_weight("q8_0", 8, 64)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="out has"):
        matmul_many([(w, x, np.zeros((1, 8), np.float32)), (w, x, np.zeros((2, 8), np.float32))])
    with pytest.raises(ValueError, match="x must be float32"):
        matmul_many([(w, x.astype(np.float64), np.zeros((1, 8), np.float32))])
    with pytest.raises(ValueError, match="out must be float32"):
        matmul_many([(w, x, np.zeros((1, 8), np.int32))])
    with pytest.raises(ValueError, match="contiguous"):
        matmul_many([(w, np.zeros((1, 128), np.float32)[:, ::2], np.zeros((1, 8), np.float32))])
    with pytest.raises((ValueError, TypeError)):  # read-only out
        matmul_many([(w, x, np.frombuffer(bytes(32), np.float32).reshape(1, 8))])
    with pytest.raises(TypeError, match="tuple"):
        _C.matmul_many([[w.fmt.id, w.data, None, 8, 64, x, np.zeros((1, 8), np.float32)]], 1)
    matmul_many([], 2)  # nothing to do


def assert_same_on_every_isa(w: Weight, x: np.ndarray) -> None:
    before = _C.get_isa()
    results = {}
    try:
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            results[isa] = w.matmul(x).tobytes()
    finally:
        _C.set_isa(before)
    assert len(set(results.values())) == 1, results.keys()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape", [(67, 301), (40, 256), (9, 16), (5, 15), (6, 1184), (7, 736), (9, 8224), (5, 9248)])
def test_isas_bit_identical(fmt, shape):
    """Every path follows the same canonical reduction order, so they agree to the bit (with and
    without a tail of columns beyond the last full 16; 37 and 23 blocks of 32 end a group of 16 blocks with
    5 and 7, so that every tail of the int4 and mxfp4 kernels runs; rows wider than 8192 take other row
    groupings, mxfp4 rows wider than 9024 go through its run-of-rows kernel, here a tile of four and one
    row, and int4 rows wider than 7710 make their lane offsets instead of loading them). One token
    (decode) and two (prefill, other kernels), and the one token's bits are its row of the two's."""
    w = make_weight(fmt, *shape_for(fmt, shape))
    x = np.random.default_rng(3).standard_normal((2, w.cols)).astype(np.float32)
    assert_same_on_every_isa(w, x)
    assert_same_on_every_isa(w, x[:1])
    assert w.matmul(x[:1]).tobytes() == w.matmul(x)[:1].tobytes()


def test_mxfp4_wide_rows_eight_at_once():
    """mxfp4 decode takes rows wider than 9024 columns eight at a time where a thread's run of rows allows:
    each row keeps the bits it has in a tile of four, alone, and on every path. 150 rows make 18 runs of
    eight, a tile of four and a last tile of two at one thread; at two threads each thread's 19 tiles end
    with a tile of four or the last two rows. One token at one and two threads, on every path, and as its
    row of a two-token product (prefill takes four rows at a time)."""
    w = make_weight("mxfp4", 150, 14496)
    x = np.random.default_rng(4).standard_normal((2, w.cols)).astype(np.float32)
    one = w.matmul(x[:1])
    assert one.tobytes() == w.matmul(x[:1], threads=2).tobytes()
    assert one.tobytes() == w.matmul(x, threads=2)[:1].tobytes()
    assert_same_on_every_isa(w, x[:1])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k", "int4", "mxfp4"])
def test_activation_quantization_same_on_every_isa(fmt):
    """The int8 activations each ISA prepares are the same bytes, also for an all-zero block, exact
    halves (round to even), and blocks holding inf or NaN."""
    w = make_weight(fmt, 8, 1024)
    x = np.random.default_rng(5).standard_normal((5, 1024)).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :256] = np.arange(256, dtype=np.float32) % 64 - 31.5  # amax 31.5: x * 127 / 31.5 hits halves
    x[1, 256:512] = np.where(np.arange(256) % 2, 127.0, -126.5).astype(np.float32)
    x[2, 300] = np.inf
    x[3, 600] = x[3, 511] = np.nan  # also as the last element of a block
    x[4, 3] = -np.inf
    assert_same_on_every_isa(w, x)


def test_best_isa_is_default():
    assert _C.get_isa() == _C.supported_isas()[-1]


def test_every_supported_path_can_be_chosen():
    """Each path the CPU supports can be set and read back (avx512 and avx512vnni are two paths of one
    instruction set), and one it lacks is refused."""
    before = _C.get_isa()
    try:
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            assert _C.get_isa() == isa
    finally:
        _C.set_isa(before)
    for isa in set(ISAS) - set(_C.supported_isas()):
        with pytest.raises(ValueError, match="does not support"):
            _C.set_isa(isa)


def memread_reference(buf: np.ndarray, threads: int) -> float:
    """ms_memread's checksum: per thread share, the XOR of its 8-byte words and of its last bytes one by one."""
    total = 0
    for i in range(threads):
        share = buf[len(buf) * i // threads : len(buf) * (i + 1) // threads]
        words = len(share) // 8 * 8
        x = np.bitwise_xor.reduce(share[:words].view("<u8"), initial=np.uint64(0))
        x ^= np.bitwise_xor.reduce(share[words:].astype(np.uint64), initial=np.uint64(0))
        total += int(x) & 0xFFFF
    return float(total)


@pytest.mark.parametrize("n", [0, 7, 255, 4099, 1_000_003])
def test_memread_reads_every_byte_in_any_number_of_streams(isa, n):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    for threads in (1, 2, 3):
        want = memread_reference(buf, threads)
        for streams in (1, 2, 4, 7, 64):
            assert _C.memread(buf, threads, streams) == want, (threads, streams)
    for streams in (0, 65):
        with pytest.raises(ValueError, match="streams"):
            _C.memread(buf, 1, streams)


def test_bad_arguments_raise():
    w = np.zeros((4, 8), np.float32)
    out = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="unknown weight format"):
        _C.matmul(99, w, None, 4, 8, np.zeros((1, 8), np.float32), out, 1)
    with pytest.raises(ValueError, match="weight buffer"):
        _C.matmul(0, w, None, 8, 8, np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32), 1)
    with pytest.raises(ValueError, match="out has"):
        _C.matmul(0, w, None, 4, 8, np.zeros((1, 8), np.float32), np.zeros((2, 4), np.float32), 1)
    with pytest.raises(ValueError, match="block-scale"):
        _C.matmul(3, np.zeros((4, 8), np.uint8), None, 4, 8, np.zeros((1, 8), np.float32), out, 1)
    with pytest.raises(ValueError, match=r"does not support|unknown"):
        _C.set_isa("neon")


@pytest.mark.parametrize("tokens", [1, 5])
def test_matmul_repeat_gives_matmul_bits_and_a_time(tokens):
    """The benchmarks' timed product (calls repeated in C) computes what matmul computes, and checks what it
    checks."""
    w = make_weight("q4_k", 12, 512)
    x = np.random.default_rng(3).standard_normal((tokens, 512)).astype(np.float32)
    want, got = np.empty((tokens, 12), np.float32), np.full((tokens, 12), np.nan, np.float32)
    _C.matmul(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, want, 2)
    seconds = _C.matmul_repeat(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, got, 2, 3)
    assert got.tobytes() == want.tobytes()
    assert isinstance(seconds, float) and seconds > 0  # the fastest call, in seconds
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        _C.matmul_repeat(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, got, 2, 0)
    with pytest.raises(ValueError, match="out has"):
        _C.matmul_repeat(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, got[:, :6].copy(), 2, 1)
    with pytest.raises(TypeError, match="9 arguments"):
        _C.matmul_repeat(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, got, 2)


def test_fp8_nan_byte_is_nan():
    q = np.array([[0x7F, 0x38]], np.uint8)  # NaN, 1.0
    w = Weight(q.view(ml_dtypes.float8_e4m3fn), np.ones((1, 1), np.float32))
    d = w.dequantize()
    assert np.isnan(d[0, 0]) and d[0, 1] == 1.0


def test_fp8_every_byte_on_every_isa():
    """Every e4m3 byte (subnormals, both zeros, the largest, NaN) in every position of a 16-byte run: the
    same bits on every path, and without the NaN bytes the product of the dequantized matrix (the kernels
    read runs without a NaN through f16 bits, and runs with one through the table)."""
    rng = np.random.default_rng(13)
    q = np.stack([rng.permutation(256) for _ in range(16)]).astype(np.uint8)  # [16, 256]: each byte once a row
    scales = np.array([[0.37, 3e-3]], np.float32)  # [1, 2]: one per 128 x 128 block
    x = rng.standard_normal((3, 256)).astype(np.float32)
    with_nan = Weight(q.view(ml_dtypes.float8_e4m3fn), scales)
    assert_same_on_every_isa(with_nan, x)
    assert np.isnan(with_nan.matmul(x)).all()
    q[(q & 0x7F) == 0x7F] = 0x00
    w = Weight(q.view(ml_dtypes.float8_e4m3fn), scales)
    assert_same_on_every_isa(w, x)
    deq = w.dequantize().astype(np.float64)
    assert np.all(np.abs(w.matmul(x) - x @ deq.T) <= 1e-5 * (np.abs(x) @ np.abs(deq).T))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_rows_matches_reference(fmt):
    w = make_weight(fmt, *shape_for(fmt, (300, 260)))
    rows = np.array([0, 127, 128, 299, 5])
    ref = dequantize_reference(w.fmt, w.data, w.scales, w.rows, w.cols)[rows]
    assert w.dequantize_rows(rows).tobytes() == ref.tobytes()
    assert w.dequantize_rows(np.array([], np.int64)).shape == (0, w.cols)


def test_mxfp4_reference_values():
    """E2M1 nibbles (low nibble = even column, bit 3 the sign) times 2^(s-127)."""
    packed = np.array([[0x21, 0xF7] + [0] * 14], np.uint8)  # columns 0..3: 1 (0x1) 0.5? see below
    s8 = np.array([[128]], np.uint8)  # scale 2
    w = Weight(packed, s8, fmt="mxfp4")
    d = w.dequantize()
    # byte 0x21: low nibble 1 -> 0.5, high nibble 2 -> 1.0; byte 0xF7: low 7 -> 6.0, high 0xF -> -6.0
    assert d[0, :4].tolist() == [1.0, 2.0, 12.0, -12.0]
    assert d.tobytes() == w.reference().tobytes()


def test_mxfp4_every_scale_and_nibble_same_on_every_isa():
    """Every E8M0 scale (254 and 0, the subnormal 2^-128, included) and every nibble, against
    activations from 2^-90 to 2^90 and with zero blocks: the same bits on every path, within the bound
    (255 is NaN: the row's result is NaN)."""
    rng = np.random.default_rng(11)
    rows, cols = 9, 32 * 37  # an odd number of blocks, more than 16
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    s8 = rng.integers(0, 255, (rows, cols // 32), dtype=np.uint8)
    s8.flat[:255] = np.arange(255)
    w = Weight(packed, s8, fmt="mxfp4")
    x = rng.standard_normal((4, cols)).astype(np.float32)
    x *= np.exp2(rng.integers(-90, 90, (4, cols // 32))).repeat(32, axis=1).astype(np.float32)
    x[1, 64:96] = 0.0
    assert_same_on_every_isa(w, x)
    s8[:] = 127
    s8[3, 5] = 255
    nan_row = Weight(packed, s8, fmt="mxfp4").matmul(x[:, ::-1].copy() / np.abs(x).max())
    assert np.isnan(nan_row[:, 3]).all() and np.isfinite(np.delete(nan_row, 3, axis=1)).all()


def test_mxfp4_each_scale_alone_on_every_isa():
    """Row s has the scale byte s in every block, so that its result is that scale's alone (above, the
    subnormal scales vanish beside their rows' larger ones): every path gives every row the same bits,
    and the rows of the subnormal scales 2^-128 (byte 0) and 2^-127 (byte 1) match the reference."""
    rng = np.random.default_rng(12)
    rows, cols = 255, 32 * 37
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    s8 = np.arange(rows, dtype=np.uint8)[:, None].repeat(cols // 32, axis=1)  # [rows, blocks]: row s, scale s
    w = Weight(packed, s8, fmt="mxfp4")
    x = rng.standard_normal((2, cols)).astype(np.float32)
    x[0] *= np.float32(2.0**100)  # the small scales' rows finite and far from zero
    x[1] *= np.float32(2.0**-100)  # the large ones' rows finite
    assert_same_on_every_isa(w, x)  # prefill
    assert_same_on_every_isa(w, x[:1])  # decode
    y = w.matmul(x)  # [2, rows]
    deq = w.dequantize()[:3].astype(np.float64)  # the rows of scale bytes 0, 1, 2
    ref = deq @ x[0].astype(np.float64)
    bound = np.abs(deq) @ np.abs(x[0]).astype(np.float64)
    for s in (0, 1, 2):
        assert ref[s] != 0 and abs(y[0, s] - ref[s]) <= 1e-5 * bound[s], s


def q8_k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n] float32 -> (int8 values [n / 256, 256], scale d [n / 256]) as the kernels prepare them: d =
    amax / 127, values rint(x * (127 / amax)) in float32."""
    xb = x.reshape(-1, 256)
    amax = np.abs(xb).max(axis=1)
    safe = np.where(amax == 0, np.float32(1), amax)
    q = np.clip(np.rint(xb * (np.float32(127) / safe)[:, None]), -127, 127)
    return np.where(amax[:, None] == 0, 0, q).astype(np.int64), (amax / np.float32(127)).astype(np.float32)


def fma32(a: float, b: float, c: np.float32) -> np.float32:
    """fmaf(a, b, c) for float32 a, b, c whose product is exact in float64 (a an integer below 2^24)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def low_bit_reference(w: Weight, x: np.ndarray) -> np.ndarray:
    """The low-bit formats' canonical product against one token x [cols], from the blocks' bytes: exact
    integer sums per block against q8_k activations, then fused multiply-adds in block order (tq2_0, tq1_0:
    S * (d * d(x)); q3_k: S = sum of scale * sum(value * a) per 16, times d * d(x); q2_k: f with S = sum of
    (scale & 15) * sum(q * a) per 16, g with M = sum of (scale >> 4) * sum(a) per 16 times dmin * d(x), the
    row f - g)."""
    qa, da = q8_k_reference(x)  # [blocks, 256], [blocks]
    raw = w.data.reshape(w.rows, -1, w.fmt.block_bytes)  # [rows, blocks, bytes]
    f16 = raw[:, :, -4:].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 2]: the last two halves
    deq = dequantize_reference(w.fmt, w.data, w.scales, w.rows, w.cols).reshape(w.rows, -1, 256)
    out = np.zeros(w.rows, np.float32)
    for r in range(w.rows):
        f = g = np.float32(0)
        for b in range(qa.shape[0]):
            if w.fmt.name == "q2_k":
                d, dmin = f16[r, b]
                sc, mn = (raw[r, b, :16] & 15).astype(np.int64), (raw[r, b, :16] >> 4).astype(np.int64)
                # q = (value + dmin * mn) / (d * sc), recovered per element where d * sc != 0
                num = deq[r, b].reshape(16, 16) + (dmin * mn)[:, None]
                den = (d * sc)[:, None]
                q = np.where(den == 0, 0, np.rint(num / np.where(den == 0, 1, den))).astype(np.int64)
                s = int((sc * (q * qa[b].reshape(16, 16)).sum(axis=1)).sum())
                m = int((mn * qa[b].reshape(16, 16).sum(axis=1)).sum())
                f = fma32(s, np.float32(d * da[b]), f)
                g = fma32(m, np.float32(dmin * da[b]), g)
            elif w.fmt.name == "q3_k":
                d, sb = f16[r, b, 1], raw[r, b, 96:108].astype(np.int64)
                g16 = np.arange(16)
                sc = (
                    ((sb[g16 % 8] >> (4 * (g16 // 8))) & 15) | (((sb[8 + g16 % 4] >> (2 * (g16 // 4))) & 3) << 4)
                ) - 32
                dl = (d * sc.astype(np.float32))[:, None]  # [16, 1]
                v = np.rint(deq[r, b].reshape(16, 16) / np.where(dl == 0, 1, dl)).astype(np.int64)  # u - 4
                f = fma32(int((sc * (v * qa[b].reshape(16, 16)).sum(axis=1)).sum()), np.float32(d * da[b]), f)
            else:
                d = f16[r, b, 1]
                trits = np.rint(deq[r, b] / (d if d != 0 else 1)).astype(np.int64)  # q - 1
                f = fma32(int(trits @ qa[b]), np.float32(d * da[b]), f)
        out[r] = f - g
    return out


@pytest.mark.parametrize("fmt", ["tq2_0", "tq1_0", "q2_k", "q3_k"])
def test_low_bit_integer_sums_against_int8_activations(isa, fmt):
    """tq2_0, tq1_0, q2_k and q3_k multiply their packed values by int8 activations in exact integer sums, then
    fused multiply-adds block after block: the result is that formula's, computed here from the blocks'
    bytes, to the bit (before, they dequantized to floats and missed it by the activations' rounding)."""
    w = make_weight(fmt, 9, 256 * 5)
    x = np.random.default_rng(4).standard_normal(w.cols).astype(np.float32)
    assert w.matmul(x[None, :])[0].tobytes() == low_bit_reference(w, x).tobytes()


def test_mxfp4_quantization_error_is_small():
    w = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)
    packed, s8 = quantize_mxfp4_reference(w)
    d = dequantize_reference(FORMATS["mxfp4"], packed, s8, 64, 256)
    assert np.sqrt(np.mean((d - w) ** 2)) / np.sqrt(np.mean(w**2)) < 0.2


@pytest.mark.parametrize("fmt", sorted(blocks.LAYOUTS))
def test_block_numpy_matches_gguf_package(fmt):
    """Our numpy dequantizers read GGUF blocks bit for bit as the gguf package's own do, on arbitrary
    bytes (every bit pattern, NaN scales included) and on blocks from our quantizers."""
    from gguf import quants

    _block, nbytes = blocks.LAYOUTS[fmt]
    theirs = getattr(quants, fmt.upper())
    raw = np.random.default_rng(6).integers(0, 256, (200, nbytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
        a, b = blocks.DEQUANT[fmt](raw.copy()), theirs.dequantize_blocks(raw.copy())
    assert ((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all()
    w = np.random.default_rng(7).standard_normal((4, 2 * 256)).astype(np.float32)
    q = blocks.quantize(fmt, w).reshape(-1, nbytes)
    assert blocks.DEQUANT[fmt](q.copy()).tobytes() == theirs.dequantize_blocks(q.copy()).tobytes()


@pytest.mark.parametrize("fmt", sorted(blocks.LAYOUTS))
def test_block_c_dequant_on_arbitrary_bytes(isa, fmt):
    _block, nbytes = blocks.LAYOUTS[fmt]
    raw = np.random.default_rng(8).integers(0, 256, (9, 3 * nbytes), dtype=np.uint8)
    w = Weight(raw, fmt=fmt)
    with np.errstate(all="ignore"):
        ref = w.reference()
    got = w.dequantize(threads=2)
    assert ((got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))).all()


# quantization error bound per format (relative RMS on Gaussian weights, our simple quantizers)
QUANT_RMS = {"q8_0": 0.01, "q6_k": 0.03, "q4_k": 0.1, "q3_k": 0.25, "q2_k": 0.4, "tq2_0": 0.85, "tq1_0": 0.85}


@pytest.mark.parametrize("fmt", sorted(blocks.LAYOUTS))
def test_block_quantizer_error(fmt):
    w = np.random.default_rng(9).standard_normal((32, 1024)).astype(np.float32)
    d = blocks.dequantize(fmt, blocks.quantize(fmt, w), 32, 1024)
    assert np.sqrt(np.mean((d - w) ** 2) / np.mean(w**2)) < QUANT_RMS[fmt]


def test_int4_layout():
    """compressed-tensors packs value + 8 per nibble, element j of an int32 in bits 4j..4j+3."""
    word = np.array([[0x76543210 - (1 << 32)]], np.int64).astype(np.int32)  # nibbles 0..7 -> values -8..-1
    packed = np.concatenate([word, np.full((1, 3), 0x88888888 - (1 << 32), np.int64).astype(np.int32)], axis=1)
    w = Weight(packed, np.array([[0.5]], np.float32), fmt="int4")
    d = w.dequantize()
    assert d[0, :8].tolist() == [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5]
    assert d[0, 8:].tolist() == [0.0] * 24


def make_expert(fmt: str, down_fmt: str, cols: int, inner: int, width: int, seed: int):
    """A SwiGLU expert: gate and up [inner, cols] in fmt, down [width, inner] in down_fmt."""
    from moestream.models.base import Expert

    return Expert(
        make_weight(fmt, inner, cols, seed=seed),
        make_weight(fmt, inner, cols, seed=seed + 9),
        make_weight(down_fmt, width, inner, seed=seed + 99),
    )


def on_every_isa(fn):
    """{isa: fn()} for every instruction set this CPU has, the choice restored afterwards."""
    before, results = _C.get_isa(), {}
    try:
        for name in _C.supported_isas():
            _C.set_isa(name)
            results[name] = fn()
    finally:
        _C.set_isa(before)
    return results


def test_silu_glu_within_three_ulp_with_the_same_bits_on_every_isa_and_thread_count():
    """silu_glu (csrc/activations.c on exp_f32.h's exp) against the float64 formula g / (1 + exp(-g)) * u:
    within 3 ulp of the result (within 1e-30 where it is below that), the limits of the plain float32
    formula (overflow, infinities, NaN), the same bits on every instruction set and at 1 or 2 threads;
    silu alone keeps numpy's plain bits."""
    from moestream.models.base import silu, silu_glu

    rng = np.random.default_rng(5)
    g = (20 * rng.standard_normal((61, 47))).astype(np.float32)  # not a multiple of 8 or 16: the tails
    g[0, :7] = [np.inf, -np.inf, np.nan, 100.0, -100.0, 0.0, -0.0]
    u = rng.standard_normal((61, 47)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        plain = g / (np.float32(1.0) + np.exp(-g))
        assert silu(g).tobytes() == plain.tobytes()
        ref = (g.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64)))) * u
    got = silu_glu(g, u)
    assert got.dtype == np.float32 and got.shape == g.shape
    normal = np.isfinite(ref) & (np.abs(ref) >= 1e-30)  # below: exp(-g) overflows, silu(g) ~ 0
    ulp = np.abs(got[normal] - ref[normal]) / np.spacing(np.abs(ref[normal]).astype(np.float32))
    assert ulp.max() <= 3.0
    tiny = np.isfinite(ref) & ~normal
    assert tiny.any() and np.abs(got[tiny] - ref[tiny]).max() < 1e-30
    assert np.array_equal(np.isnan(got), np.isnan(plain * u)) and got[0, 0] == np.inf * u[0, 0]
    assert got[0, 3] == np.float32(100.0) * u[0, 3] and got[0, 4] == 0.0 and got[0, 5] == 0.0

    def both_thread_counts():
        big_g = np.repeat(g, 40, axis=0).ravel()  # 115 k elements: split over two threads
        big_u = np.repeat(u, 40, axis=0).ravel()
        one, two = np.empty_like(big_g), np.empty_like(big_g)
        _C.silu_mul(big_g, big_u, one, 1)
        _C.silu_mul(big_g, big_u, two, 2)
        assert one.tobytes() == two.tobytes()
        return silu_glu(g, u).tobytes() + one.tobytes()

    assert len(set(on_every_isa(both_thread_counts).values())) == 1
    with pytest.raises(ValueError, match="do not add up"):
        _C.silu_mul(g, u[:3], np.empty_like(g), 1)


def test_softmax_topk_picks_the_largest_probabilities():
    """softmax_topk (the Qwen3 / Mixtral router's choice in C) against float64: the experts of the k largest
    probabilities in order, ties to the lower index, their probabilities (renormalised or not) within a few
    float32 roundings, the same bits on every instruction set; bad sizes refused."""
    rng = np.random.default_rng(12)
    T, n, k = 40, 128, 8
    logits = (3 * rng.standard_normal((T, n))).astype(np.float32)
    logits[1] = 0.5  # all tied: the first k
    logits[2, [7, 3, 90]] = 9.0  # three tied at the top: in index order
    p64 = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    want_idx = np.argsort(-p64, axis=-1, kind="stable")[:, :k]
    for renormalize in (False, True):

        def run(renormalize=renormalize):
            idx, w = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
            _C.softmax_topk(logits, n, k, renormalize, idx, w)
            return idx, w

        results = on_every_isa(run)
        assert len({i.tobytes() + w.tobytes() for i, w in results.values()}) == 1
        idx, w = next(iter(results.values()))
        assert idx.tolist() == want_idx.tolist()
        assert idx[1].tolist() == list(range(k)) and idx[2, :3].tolist() == [3, 7, 90]
        want_w = np.take_along_axis(p64, want_idx, -1)
        if renormalize:
            want_w /= want_w.sum(-1, keepdims=True)
        np.testing.assert_allclose(w, want_w, rtol=2e-6)
    idx, w = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
    with pytest.raises(ValueError, match="do not add up"):
        _C.softmax_topk(logits, n, n + 1, False, np.empty((T, n + 1), np.int64), np.empty((T, n + 1), np.float32))
    with pytest.raises(ValueError, match="do not add up"):
        _C.softmax_topk(logits, n, k, False, idx[:3], w)
    with pytest.raises(ValueError, match="int64"):
        _C.softmax_topk(logits, n, k, False, idx.astype(np.int32), w)


def test_glu_experts_one_call_equals_the_steps():
    """One token through several SwiGLU experts in one C call (csrc/moe_decode.c) gives each expert the bits
    of its own products and activation (glu_many), and with coefficients their sum as moe_combine adds
    them, for mixed formats and at 1 and 2 threads; experts whose sizes disagree are refused."""
    from moestream.models.base import Ctx, combine_slots, glu_many, glu_one_x

    rng = np.random.default_rng(13)
    pairs = [("q4_k", "q6_k"), ("q8_0", "q4_k"), ("bf16", "f32"), ("mxfp4", "q8_0")]
    experts = [make_expert(f, d, 512, 256, 384, seed=i) for i, (f, d) in enumerate(pairs)]
    x = (0.05 * rng.standard_normal((1, 512))).astype(np.float32)
    coef = rng.random(len(experts)).astype(np.float32)
    ys = np.concatenate(glu_many([(e, x) for e in experts], Ctx(threads=2)))  # [n, 384]
    want = combine_slots(ys, np.arange(len(experts), dtype=np.int64)[None, :], coef[None, :], Ctx())
    for threads in (1, 2):
        assert glu_one_x(experts, x, Ctx(threads=threads)).tobytes() == ys.tobytes()
        assert glu_one_x(experts, x, Ctx(threads=threads), coef).tobytes() == want.tobytes()
    args = [w.kernel_args() for e in experts for w in (e.gate, e.up, e.down)]
    out = np.empty((1, 384), np.float32)
    with pytest.raises(ValueError, match="expert 1 is gate"):
        _C.glu_experts([*args[:3], args[3], args[4], args[0]], x, None, np.empty((2, 384), np.float32), 1)
    with pytest.raises(ValueError, match="not \\(gate, up, down\\)"):
        _C.glu_experts(args[:4], x, None, out, 1)
    with pytest.raises(ValueError, match="do not add up"):
        _C.glu_experts(args, x, coef[:2], out, 1)
    with pytest.raises(ValueError, match="do not add up"):
        _C.glu_experts(args, x[:, :256], None, np.empty((4, 384), np.float32), 1)


def test_glu_many_equals_each_mlp_alone():
    """Experts run together (gate/up in one pass, the activation over all at once, down in one pass)
    give each expert the bits of its own three products, for 1 and several tokens and mixed formats."""
    from moestream.models.base import Ctx, glu_many

    rng = np.random.default_rng(6)
    experts = [make_expert(f, f, 256, 256, 128, seed=i) for i, f in enumerate(["q4_k", "q6_k", "q8_0", "bf16", "q4_k"])]
    for n in (1, 3):
        xs = [(0.02 * rng.standard_normal((n, 256))).astype(np.float32) for _ in experts]
        got = glu_many(list(zip(experts, xs, strict=True)), Ctx(threads=2))
        for e, x, y in zip(experts, xs, got, strict=True):
            want = e.down.matmul(e.act(e.gate.matmul(x), e.up.matmul(x)))
            assert y.tobytes() == want.tobytes()
        # into given buffers (rows of one array, as a batched MoE layer passes them), the activations mixed
        experts[2] = dataclasses.replace(experts[2], act=lambda g, u, threads=1: np.maximum(g, 0) * u)
        buf = np.full((len(experts) * n, 128), np.nan, np.float32)
        outs = [buf[i * n : (i + 1) * n] for i in range(len(experts))]
        got = glu_many(list(zip(experts, xs, strict=True)), Ctx(threads=2), outs)
        for e, x, y, out in zip(experts, xs, got, outs, strict=True):
            want = e.down.matmul(e.act(e.gate.matmul(x), e.up.matmul(x)))
            assert y is out and out.tobytes() == want.tobytes()
    assert glu_many([], Ctx()) == []


def test_moe_token_alone_equals_its_row_of_the_batch():
    """A routed MoE layer gives each token the same bits alone (decode: the one-row router, all experts on
    the one x, the slot-ordered sum) as in a batch (prefill: each expert over the tokens that chose it)."""
    from moestream.models.base import Ctx, Expert, MoE, SoftmaxRouter, glu_many, glu_one_x

    rng = np.random.default_rng(8)
    experts = [
        Expert(
            make_weight("q4_k", 256, 256, seed=i),
            make_weight("q4_k", 256, 256, seed=i + 9),
            make_weight("q6_k", 256, 256, seed=i + 99),
        )
        for i in range(6)
    ]
    for renormalize in (True, False):
        moe = MoE(SoftmaxRouter(make_weight("bf16", 6, 256, seed=5), 3, renormalize), experts, None)
        x = (0.05 * rng.standard_normal((7, 256))).astype(np.float32)
        batch = moe(x, Ctx(threads=2))
        for t in range(7):
            assert moe(x[t : t + 1], Ctx(threads=2)).tobytes() == batch[t : t + 1].tobytes()
            idx, w = moe.router(x[t : t + 1], Ctx())
            bidx, bw = moe.router(x, Ctx())
            assert idx.tolist() == bidx[t : t + 1].tolist() and w.tobytes() == bw[t : t + 1].tobytes()
    # experts of different inner sizes (not one MoE's): glu_many's way, the same bits
    odd = [
        experts[0],
        Expert(
            make_weight("q4_k", 512, 256, seed=1),
            make_weight("q4_k", 512, 256, seed=2),
            make_weight("q6_k", 256, 512, seed=3),
        ),
    ]
    want = np.concatenate(glu_many([(e, x[:1]) for e in odd], Ctx()))
    assert glu_one_x(odd, x[:1], Ctx()).tobytes() == want.tobytes()


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_sigmoid_router_row_alone_equals_batch(n_group, topk_group):
    """DeepSeek-V3 / Kimi routing of one token (its own row path) picks the same experts with the same
    weight bits as the same token in a batch, with and without groups, bias and renormalisation."""
    from moestream.models.base import Ctx, SigmoidGroupRouter

    rng = np.random.default_rng(9)
    gate = make_weight("bf16", 16, 64, seed=2)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    for bias in (None, (0.3 * rng.standard_normal(16)).astype(np.float32)):
        for renormalize in (True, False):
            router = SigmoidGroupRouter(gate, bias, 3, n_group, topk_group, renormalize, 2.5)
            bidx, bw = router(x, Ctx())
            for t in range(6):
                idx, w = router(x[t : t + 1], Ctx())
                assert idx.tolist() == bidx[t : t + 1].tolist() and w.tobytes() == bw[t : t + 1].tobytes()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_block_rows_products(fmt):
    """MLA's absorbed decode multiplies by blocks of kv_b_proj's rows, one block per head: combine_rows
    (coef[h] @ W[block h]) to a chain's rounding of the float64 product, block_rows_matmul (x[h] @ W[block
    h]^T) with the bits of the row slices' own products; both the same bytes on every ISA and thread count."""
    H, N, V = 3, (128 if fmt == "fp8" else 16), (128 if fmt == "fp8" else 8)  # fp8: blocks at multiples of 128
    stride = N + V
    w = make_weight(fmt, *shape_for(fmt, (H * stride, 80)))
    rng = np.random.default_rng(7)
    coef = rng.standard_normal((H, N)).astype(np.float32)
    x = rng.standard_normal((H, w.cols)).astype(np.float32)

    def both(threads: int) -> tuple[bytes, bytes]:
        return w.combine_rows(coef, 0, stride, threads).tobytes(), w.block_rows_matmul(
            x, N, stride, V, threads
        ).tobytes()

    results = {}
    before = _C.get_isa()
    try:
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            for threads in (1, 2, 3):
                results[isa, threads] = both(threads)
    finally:
        _C.set_isa(before)
    assert len(set(results.values())) == 1, list(results)
    combined = np.frombuffer(results["scalar", 1][0], np.float32).reshape(H, w.cols)
    W = w.dequantize().astype(np.float64)
    blocks = [W[h * stride : h * stride + N] for h in range(H)]
    exact = np.stack([coef[h] @ blocks[h] for h in range(H)])
    bound = (N + 1) * 2.0**-24 * np.stack([np.abs(coef[h]) @ np.abs(blocks[h]) for h in range(H)])
    assert np.all(np.abs(combined - exact) <= bound)
    sliced = np.stack([w.row_slice(h * stride + N, (h + 1) * stride).matmul(x[h : h + 1])[0] for h in range(H)])
    assert results["scalar", 1][1] == sliced.tobytes()


def test_block_rows_refuse_what_does_not_add_up():
    w = make_weight("f32", 24, 16)
    coef, x = np.ones((3, 4), np.float32), np.ones((3, 16), np.float32)
    w.combine_rows(coef, 0, 8, 1)
    w.block_rows_matmul(x, 4, 8, 4, 1)
    with pytest.raises(ValueError):
        w.combine_rows(np.ones((4, 4), np.float32), 0, 8, 1)  # a fourth block past the last row
    with pytest.raises(ValueError):
        w.combine_rows(coef, 0, 3, 1)  # blocks overlap (stride < N)
    with pytest.raises(ValueError):
        w.block_rows_matmul(x, 4, 8, 8, 1)  # the last block runs past the end
    fp8 = make_weight("fp8", 512, 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8.block_rows_matmul(np.ones((2, 64), np.float32), 16, 256, 128, 1)


def test_moe_combine_has_numpy_bits_and_refuses_bad_input():
    """A MoE layer's weighted sum of its experts' rows in C: bit for bit numpy's float32 gathers, multiplies and
    adds in top-k order (the formulation mix_experts had), for prefill batches, one token (decode) and k = 1, on
    1-3 threads; rows outside ys, a wrong dtype or sizes that do not add up are refused."""
    from moestream.models.base import Ctx, combine_slots

    rng = np.random.default_rng(5)
    for T, k, n, width in ((37, 8, 300, 515), (1, 8, 8, 2048), (5, 1, 9, 64)):
        ys = rng.standard_normal((n, width)).astype(np.float32)
        rows = rng.integers(0, n, size=(T, k))
        w = rng.random((T, k)).astype(np.float32)
        want = ys[rows[:, 0]] * w[:, :1]
        for j in range(1, k):
            want += ys[rows[:, j]] * w[:, j : j + 1]
        for threads in (1, 2, 3):
            assert combine_slots(ys, rows, w, Ctx(threads)).tobytes() == want.tobytes(), (T, k, threads)
    ys, w, out = np.ones((4, 8), np.float32), np.ones((2, 3), np.float32), np.empty((2, 8), np.float32)
    rows = np.zeros((2, 3), np.int64)
    _C.moe_combine(ys, rows, w, out, 8, 2, 3, 1)
    assert np.all(out == 3)
    bad_rows = rows.copy()
    bad_rows[1, 2] = 4
    with pytest.raises(ValueError, match="row 4 outside the 4 rows"):
        _C.moe_combine(ys, bad_rows, w, out, 8, 2, 3, 1)
    with pytest.raises(ValueError, match="int64"):
        _C.moe_combine(ys, rows.astype(np.int32), w, out, 8, 2, 3, 1)
    with pytest.raises(ValueError, match="float32"):
        _C.moe_combine(ys.astype(np.float64), rows, w, out, 8, 2, 3, 1)
    with pytest.raises(ValueError, match="do not add up"):
        _C.moe_combine(ys, rows, w, out, 8, 2, 2, 1)


@pytest.mark.skipif("amx" not in _C.supported_isas(), reason="this CPU (or its kernel) gives no AMX-INT8")
@pytest.mark.parametrize("shape", [(16, 256), (37, 768), (203, 2048), (20, 4096), (19, 8192)])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_amx_gemm_gives_the_scalar_bits(fmt, shape):
    """q4_k's and q6_k's gemms of 24 tokens or more with AMX-INT8 (rows of up to 4096 columns; wider ones
    keep the AVX-512 gemm) give every token the scalar kernel's bits: tile tails of rows (16 at a time) and
    of tokens (8 at a time), tokens laid out in one run or in several (137 tokens: 2 runs of groups at 4096
    columns), 1-3 threads, each token as it is alone."""
    w = make_weight(fmt, *shape)
    x = np.random.default_rng(6).standard_normal((137, w.cols)).astype(np.float32)
    check_amx_gemm(w, x, shape)
    # every byte pattern of the quants and scales (q6_k's scales -128..127 and values 0..63 to their ends, as
    # llama.cpp's quantizer writes them, with negative scales), the block's f16 factors kept finite
    raw = np.random.default_rng(7).integers(0, 256, (shape[0], shape[1] // 256, w.fmt.block_bytes), np.uint8)
    factors = (np.random.default_rng(8).standard_normal((*raw.shape[:2], 2)) / 50).astype(np.float16)
    if fmt == "q6_k":
        raw[..., 208:210] = factors[..., :1].view(np.uint8)
    else:
        raw[..., 0:4] = factors.view(np.uint8)
    check_amx_gemm(Weight(raw.reshape(shape[0], -1), fmt=fmt), x, shape)


@pytest.mark.skipif("amx" not in _C.supported_isas(), reason="this CPU (or its kernel) gives no AMX-INT8")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_amx_batch_gives_each_product_its_own_bits(threads):
    """A thread keeps the AMX token tiles it laid out for its next call in the same batch (another run of rows
    of the product, or a product of the same tokens, as an expert's gate and up): in one batch of q4_k and q6_k
    products, some sharing their tokens and some of as many tokens but others, and in a second batch whose
    tokens sit where the first's did, every product has the scalar bits it has alone."""
    ws = [make_weight("q4_k", 80, 768, 1), make_weight("q4_k", 48, 768, 2), make_weight("q6_k", 64, 768, 3)]
    rng = np.random.default_rng(9)
    xa, xb = (rng.standard_normal((40, 768)).astype(np.float32) for _ in range(2))
    before = _C.get_isa()
    try:
        for x_first in (xa, xb):
            x = np.empty((40, 768), np.float32)
            x[:] = x_first
            for x_now in (x_first, xa + xb):
                x[:] = x_now  # the second batch: other tokens at the same address
                batch = [(ws[0], x), (ws[1], x), (ws[0], xb[:40]), (ws[2], x), (ws[2], xa[:33]), (ws[1], x)]
                _C.set_isa("scalar")
                ref = [w.matmul(t, threads=1) for w, t in batch]
                _C.set_isa("amx")
                outs = [np.empty((t.shape[0], w.rows), np.float32) for w, t in batch]
                matmul_many([(w, t, out) for (w, t), out in zip(batch, outs, strict=True)], threads)
                for i, (out, r) in enumerate(zip(outs, ref, strict=True)):
                    assert out.tobytes() == r.tobytes(), (i, threads)
    finally:
        _C.set_isa(before)


def check_amx_gemm(w: Weight, x: np.ndarray, shape: tuple[int, int]) -> None:
    before = _C.get_isa()
    try:
        _C.set_isa("scalar")
        ref = w.matmul(x, threads=1)
        one = w.matmul(x[:1], threads=1)
        _C.set_isa("amx")
        for T in (24, 25, 31, 33, 47, 137):
            for threads in (1, 2, 3):
                assert w.matmul(x[:T], threads=threads).tobytes() == ref[:T].tobytes(), (shape, T, threads)
        assert ref[:1].tobytes() == one.tobytes()
    finally:
        _C.set_isa(before)
