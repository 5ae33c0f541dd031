"""GB/s of weights streamed by the matvec kernels, per format, for three decode shapes at 1 and 2 threads,
beside a plain memory read: the fastest of one sequential stream and several interleaved ones per thread
(common.READ_STREAMS; on a Xeon the interleaved read is up to 1.6x the sequential one). This machine's read
bandwidth moves by half within minutes, so each cell alternates the two: read, kernel, read, kernel, ...,
read (--rounds kernel runs of --seconds each); each kernel run is taken against the mean of the reads on
either side of it, and the cell shows the medians over its rounds. Each run cycles through enough copies
of the matrix (>= 1 GB) that the weights come from memory, as in decode.

    python3 benchmarks/kernels.py [--formats bf16,q4_k,...] [--seconds 0.2] [--rounds 5] [--isa avx2]
                                  [--weight-streams 1] [--prefetch-level 1]

--isa runs the kernels of a lesser instruction set than the CPU's best (scalar, avx2), e.g. to see on an
AVX-512 machine how the AVX2 kernels that AVX2-only CPUs run compare with the read.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import ml_dtypes
import numpy as np

from common import best_time, commit, kernel_path, machine, read_gbs, table
from moestream import _C
from moestream.quant import FORMATS, Weight, blocks
from moestream.quant.formats import quantize_fp8_reference, quantize_int4_reference, quantize_mxfp4_reference

SHAPES = [(4096, 14336), (7168, 2048), (3584, 3072)]  # [rows, cols]: out x in
TARGET = {"q4_k", "mxfp4", "int4", "q8_0"}  # >= 80% of the memory read at 2 threads (issue 4)


def make(fmt: str, w: np.ndarray) -> Weight:
    if fmt == "f32":
        return Weight(w)
    if fmt == "bf16":
        return Weight(w.astype(ml_dtypes.bfloat16))
    if fmt == "f16":
        return Weight(w.astype(np.float16))
    if fmt == "fp8":
        return Weight(*quantize_fp8_reference(w))
    if fmt == "mxfp4":
        return Weight(*quantize_mxfp4_reference(w), fmt="mxfp4")
    if fmt == "int4":
        return Weight(*quantize_int4_reference(w), fmt="int4")
    return Weight(blocks.quantize(fmt, w), fmt=fmt)


def copies(w: Weight, total: float = 1.2e9) -> list[Weight]:
    n = max(2, int(total // w.nbytes))
    out = [w]
    for _ in range(n - 1):
        c = Weight.__new__(Weight)
        for slot in ("fmt", "rows", "cols", "_validate", "_check"):
            setattr(c, slot, getattr(w, slot))
        c.data = w.data.copy()
        c.scales = None if w.scales is None else w.scales.copy()
        out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isa", choices=_C.supported_isas(), default=_C.get_isa())
    ap.add_argument("--weight-streams", type=int, choices=(0, 1, 4), default=0, help="0: chosen per product")
    ap.add_argument("--prefetch-level", type=int, choices=(1, 2), default=_C.get_prefetch_level())
    args = ap.parse_args()
    _C.set_isa(args.isa)
    _C.set_weight_streams(args.weight_streams)
    _C.set_prefetch_level(args.prefetch_level)
    print(f"machine: {machine()}\ncommit: {commit()}")
    streams = args.weight_streams or "chosen per product"
    far = "far ones into L2" if args.prefetch_level == 2 else "all into L1"
    print(f"kernels: {kernel_path()}, weight streams: {streams}, prefetches: {far}")
    print(f"(L1d {_C.l1d_bytes() // 1024} KB: see ms_weight_streams_for in csrc/matmul.c)\n")
    buf = np.ones(1 << 30, np.uint8)

    def read_now(t: int) -> float:
        return read_gbs(buf, t, args.seconds)

    def alternate(step: Callable[[], None], nbytes: int, t: int) -> tuple[float, float, float]:
        """(kernel GB/s, its share of the read, read GB/s): medians over the rounds, each kernel run
        against the mean of the reads just before and just after it."""
        reads, runs = [read_now(t)], []
        for _ in range(args.rounds):
            runs.append(nbytes / best_time(step, 1, args.seconds) / 1e9)
            reads.append(read_now(t))
        shares = [k / ((a + b) / 2) for k, a, b in zip(runs, reads, reads[1:], strict=False)]
        return statistics.median(runs), statistics.median(shares), statistics.median(reads)

    rng = np.random.default_rng(0)
    rows: list[list[object]] = []
    for fmt in args.formats.split(","):
        for r, c in SHAPES:
            ws = copies(make(fmt, rng.standard_normal((r, c)).astype(np.float32)))
            x = rng.standard_normal((1, c)).astype(np.float32)
            cells: list[object] = [fmt + (" *" if fmt in TARGET else ""), f"{r}x{c}"]
            base = []
            for t in (1, 2):
                i = [0]

                def step(t: int = t, ws: list[Weight] = ws, x: np.ndarray = x, i: list[int] = i) -> None:
                    ws[i[0] % len(ws)].matmul(x, t)
                    i[0] += 1

                gbs, share, read = alternate(step, ws[0].nbytes, t)
                base.append(read)
                cells += [f"{gbs:.1f}", f"{100 * share:.0f}%"]
            cells.append(f"{base[0]:.1f} / {base[1]:.1f}")
            rows.append(cells)
            del ws
    header = ["format", "shape", "GB/s 1 thr", "of read", "GB/s 2 thr", "of read", "read 1 / 2 thr"]
    print(table(header, rows))
    print("\n* target: >= 80% of the memory read at 2 threads")


if __name__ == "__main__":
    main()
