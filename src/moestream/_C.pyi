"""Type stubs for the private C extension (csrc/module.c)."""

from collections.abc import Sequence
from typing import Any

Buffer = Any  # anything with the buffer protocol (numpy arrays, memmaps, bytes)

LONG_RUN_BYTES: int  # a thread's run of a product from which a small L1 takes four weight streams

def matmul(
    fmt: int, w: Buffer, scales: Buffer | None, rows: int, cols: int, x: Buffer, out: Buffer, threads: int
) -> None: ...
def matmul_repeat(
    fmt: int, w: Buffer, scales: Buffer | None, rows: int, cols: int, x: Buffer, out: Buffer, threads: int, repeats: int
) -> float: ...
def matmul_many(products: list[tuple[int, Buffer, Buffer | None, int, int, Buffer, Buffer]], threads: int) -> None: ...
def dequant(fmt: int, w: Buffer, scales: Buffer | None, rows: int, cols: int, out: Buffer, threads: int) -> None: ...
def gqa_decode(
    q: Buffer,
    k: Buffer,
    v: Buffer,
    kcache: Buffer,
    vcache: Buffer,
    pos: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_norm: Buffer | None,
    k_norm: Buffer | None,
    eps: float,
    cos: Buffer,
    sin: Buffer,
    interleave: bool,
    scaling: float,
    window: int,
    out: Buffer,
    threads: int,
) -> None: ...
def combine_rows(
    fmt: int,
    w: Buffer,
    scales: Buffer | None,
    rows: int,
    cols: int,
    coef: Buffer,
    out: Buffer,
    first: int,
    stride: int,
    H: int,
    N: int,
    threads: int,
) -> None: ...
def block_rows_matmul(
    fmt: int,
    w: Buffer,
    scales: Buffer | None,
    rows: int,
    cols: int,
    x: Buffer,
    out: Buffer,
    first: int,
    stride: int,
    H: int,
    V: int,
    threads: int,
) -> None: ...
def gemm_f32(a: Buffer, b: Buffer, out: Buffer, m: int, k: int, n: int, transpose_b: bool) -> None: ...
def kda_recurrence(
    S: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    alpha: Buffer,
    beta: Buffer,
    out: Buffer,
    T: int,
    H: int,
    D: int,
    threads: int,
) -> None: ...
def rms_norm(x: Buffer, w: Buffer, eps: float, out: Buffer) -> None: ...
def exp_shifted(p: Buffer, m: float) -> None: ...
def silu_mul(g: Buffer, u: Buffer, h: Buffer, threads: int) -> None: ...
def softmax_topk(logits: Buffer, n: int, k: int, renormalize: bool, idx: Buffer, w: Buffer) -> None: ...
def glu_experts(
    matrices: Sequence[tuple[int, Buffer, Buffer | None, int, int]],
    x: Buffer,
    w: Buffer | None,
    out: Buffer,
    threads: int,
) -> None: ...
def set_weight_streams(n: int) -> None: ...
def get_weight_streams() -> int: ...
def rope(x: Buffer, cos: Buffer, sin: Buffer, T: int, heads: int, D: int, interleave: bool, out: Buffer) -> None: ...
def moe_combine(ys: Buffer, rows: Buffer, w: Buffer, out: Buffer, width: int, T: int, k: int, threads: int) -> None: ...
def set_q4k_pairs(n: int) -> None: ...
def get_q4k_pairs() -> tuple[int, int]: ...
def weight_streams_for(x_bytes: int, run_bytes: int = 0) -> int: ...
def set_prefetch_level(level: int) -> None: ...
def get_prefetch_level() -> int: ...
def prefetch_into_l2(ahead: int) -> bool: ...
def l1d_bytes() -> int: ...
def memread(buf: Buffer, threads: int, streams: int = 1) -> float: ...
def get_isa() -> str: ...
def uses_gfni() -> bool: ...
def set_isa(name: str) -> None: ...
def supported_isas() -> list[str]: ...
def formats() -> list[tuple[str, int, int]]: ...
def pread(fd: int, buf: Buffer, offset: int, n: int) -> int: ...
