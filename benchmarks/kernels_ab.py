"""In-process A/B of the matvec kernels of two or more builds of moestream._C (or of one build under two
settings), for machines whose memory read moves by half within minutes: every build is loaded into the one
process, and each cell runs them in turn, round after round (A B, then B A), on the same copies of the
matrix, so that all of them see the same machine; the table gives each build's median GB/s (or GOPS, with
--tokens above 1) and the median of its per-round ratios to the first. It also checks that every build
gives the same bits.

    cp src/moestream/_C.*.so /tmp/before.so            # then change csrc/ and rebuild
    python3 setup.py build_ext --inplace && cp src/moestream/_C.*.so /tmp/after.so
    python3 benchmarks/kernels_ab.py /tmp/before.so /tmp/after.so [--formats q4_k,q6_k]
        [--shapes 4096x14336,7168x2048] [--threads 1,2] [--rounds 6] [--tokens 1]
        [--in-cache] [--isa avx2,avx512vbmi] [--weight-streams 1,4] [--prefetch-level 1,2]

--isa, --weight-streams and --prefetch-level take one value for every build or one per build (the same
.so given twice compares two settings of one build). A matrix kept in cache (--in-cache, or --tokens above
1) is timed by the fastest of calls repeated in C (_C.matmul_repeat) when every build has it, else from
Python for all of them.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import shutil
import statistics
import tempfile
from types import ModuleType

import numpy as np

from common import best_time, commit, machine, table
from kernels import SHAPES, copies, make
from moestream.quant import Weight


def load_build(path: str, loaded: set[str]) -> ModuleType:
    """The extension module at path, loaded as moestream._C under its own copy of the library's state. The
    dynamic loader hands out one library per file, so a path given again is loaded from a copy: else the two
    builds would share one state and one build's settings would be the other's."""
    real = os.path.realpath(path)
    if real in loaded:
        fd, copy = tempfile.mkstemp(suffix=".so")
        os.close(fd)
        shutil.copyfile(real, copy)
        atexit.register(os.unlink, copy)
        path = copy
    loaded.add(real)
    spec = importlib.util.spec_from_file_location("moestream._C", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_build(value: str | None, n: int, name: str) -> list[str | None]:
    if value is None:
        return [None] * n
    values = value.split(",")
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SystemExit(f"--{name}: give one value, or one per build ({n})")
    return values


def rate(
    b: ModuleType, ws: list[Weight], x: np.ndarray, out: np.ndarray, threads: int, seconds: float, in_c: bool
) -> float:
    """Products per second of build b, cycling through the copies ws (so that one token reads memory); with
    in_c, the fastest of repeated calls made in C (_C.matmul_repeat) on the one copy, which a matrix kept in
    cache needs: from Python, the call costs about as much as the kernel."""
    if in_c:
        w = ws[0]
        once = b.matmul_repeat(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, out, threads, 3)
        n = max(3, min(1_000_000, int(seconds / max(once, 1e-9))))
        return 1 / b.matmul_repeat(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, out, threads, n)
    i = [0]

    def step() -> None:
        w = ws[i[0] % len(ws)]
        i[0] += 1
        b.matmul(w.fmt.id, w.data, w.scales, w.rows, w.cols, x, out, threads)

    return 1 / best_time(step, 1, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="paths of _C shared objects (the first is the baseline)")
    ap.add_argument("--formats", default="q8_0,q4_k,int4,mxfp4,q6_k")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--tokens", type=int, default=1, help="above 1: prefill products, in GOPS from cache")
    ap.add_argument(
        "--in-cache",
        action="store_true",
        help="one token against one copy (give --shapes that fit the L2, e.g. 512x3072): the compute bound",
    )
    ap.add_argument("--isa")
    ap.add_argument("--weight-streams")
    ap.add_argument("--prefetch-level")
    args = ap.parse_args()
    loaded: set[str] = set()
    builds = [load_build(p, loaded) for p in args.builds]
    n = len(builds)
    settings = zip(
        per_build(args.isa, n, "isa"),
        per_build(args.weight_streams, n, "weight-streams"),
        per_build(args.prefetch_level, n, "prefetch-level"),
        strict=True,
    )
    for b, (isa, streams, level) in zip(builds, settings, strict=True):
        if isa is not None:
            b.set_isa(isa)
        if streams is not None:
            b.set_weight_streams(int(streams))
        if level is not None:
            b.set_prefetch_level(int(level))
    print(f"machine: {machine()}\ncommit: {commit()}")
    for i, (path, b) in enumerate(zip(args.builds, builds, strict=True)):
        print(
            f"build {chr(65 + i)}: {path} ({b.get_isa()}, weight streams {b.get_weight_streams() or 'auto'}, "
            f"prefetch level {b.get_prefetch_level()})"
        )
    print()
    rng = np.random.default_rng(0)
    T = args.tokens
    rows: list[list[object]] = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            r, c = (int(v) for v in shape.split("x"))
            w0 = make(fmt, rng.standard_normal((r, c)).astype(np.float32))
            # one token: from memory (unless --in-cache); several: the tile in cache
            ws = copies(w0) if T == 1 and not args.in_cache else [w0]
            x = rng.standard_normal((T, c)).astype(np.float32)
            out = np.empty((T, r), np.float32)
            work = ws[0].nbytes if T == 1 else 2 * r * c * T
            in_c = len(ws) == 1 and all(hasattr(b, "matmul_repeat") for b in builds)  # the same method for all
            for t in (int(v) for v in args.threads.split(",")):
                runs: list[list[float]] = [[] for _ in builds]
                for k in range(args.rounds):
                    for j in range(n) if k % 2 == 0 else reversed(range(n)):
                        runs[j].append(work * rate(builds[j], ws, x, out, t, args.seconds, in_c) / 1e9)
                bits = set()
                for b in builds:
                    o = np.empty_like(out)
                    b.matmul(w0.fmt.id, w0.data, w0.scales, w0.rows, w0.cols, x, o, t)
                    bits.add(o.tobytes())
                ratios = [statistics.median(v / a for a, v in zip(runs[0], rj, strict=True)) for rj in runs[1:]]
                rows.append(
                    [fmt, shape, t]
                    + [f"{statistics.median(rj):.1f}" for rj in runs]
                    + [f"{q:.2f}" for q in ratios]
                    + ["yes" if len(bits) == 1 else "NO"]
                )
    unit = "GB/s" if T == 1 else "GOPS"
    names = [chr(65 + i) for i in range(n)]
    header = ["format", "shape", "threads", *(f"{a} {unit}" for a in names), *(f"{a}/A" for a in names[1:])]
    print(table([*header, "same bits"], rows))


if __name__ == "__main__":
    main()
