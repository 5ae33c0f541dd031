"""Shared helpers of the benchmark scripts: machine description, commit, timing, table printing."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The 8-layer Qwen3-30B-A3B-width Q4_K_M pack that decode.py --llama-cpp writes: token_time.py's and
# model_ab.py's default model.
DEFAULT_PACK = Path("/tmp/moestream-bench/qwen3-30b-a3b-L8-q4_k_m")


def require_model(path: Path) -> None:
    """One line and exit 1 when there is no model at path."""
    if not (path / "config.json").exists():
        raise SystemExit(f"{path}: no model there (benchmarks/decode.py --llama-cpp SRC writes the default)")


def kernel_path() -> str:
    """The kernel path in use, with "+gfni" where the nibbles are split with GFNI."""
    from moestream import _C

    return _C.get_isa() + ("+gfni" if _C.uses_gfni() else "")


def machine() -> str:
    from moestream.doctor import blas_facts, cpu_model

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    blas = blas_facts()
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, kernels: {kernel_path()}, "
        f"numpy BLAS: {blas['library']} {blas['architecture']}"
        + (f" (OPENBLAS_CORETYPE={blas['coretype_env']})" if blas["coretype_env"] else "")
    )


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


# Plain reads as one sequential stream per thread and as several interleaved 256 bytes at a time: which is
# faster depends on the CPU's prefetchers (Zen 5 reads fastest in one stream; a Xeon Sapphire Rapids reads
# 11.8 / 22.7 GB/s in one stream at 1 / 2 threads, 18.6 / 32.7 in four), so the baseline is the best of them.
READ_STREAMS = (1, 4, 8)


def read_gbs(buf: object, threads: int, seconds: float, repeat: int = 1) -> float:
    """GB/s of the fastest plain read of buf (a numpy array) at this thread count, over READ_STREAMS."""
    from moestream import _C

    nbytes = buf.nbytes  # type: ignore[attr-defined]
    return max(nbytes / best_time(lambda s=s: _C.memread(buf, threads, s), repeat, seconds) / 1e9 for s in READ_STREAMS)


def best_time(fn: Callable[[], object], repeat: int = 5, min_seconds: float = 0.2) -> float:
    """Best wall time of fn over repeats (each repeat runs fn at least once and min_seconds)."""
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_seconds:
                break
        best = min(best, dt / n)
    return best


def evict(paths: list[Path]) -> None:
    """Drops the files' pages from the page cache, so that the next reader reads them from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
