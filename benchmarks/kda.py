"""Kimi Delta Attention's recurrence at Kimi K3's width (96 heads of 128) per token: the C kernel
(csrc/kda.c, one call for all tokens, threads splitting heads) beside the numpy loop it replaced, for one
token (decode) and 64 (prefill), at 1 and 2 threads. The state is reset from a copy before every run (the
copy, ~6 MB, is timed too, alike for both).

    python3 benchmarks/kda.py [--heads 96] [--dim 128]
"""

from __future__ import annotations

import argparse

import numpy as np

from common import best_time, commit, machine, table
from moestream.models.kda import KDAState, delta_rule, delta_rule_reference


def measure(T: int, H: int, D: int, rng: np.random.Generator) -> list[object]:
    """One row: T tokens through the numpy loop, then through the C kernel at 1 and 2 threads."""
    q, k = (rng.standard_normal((T, H, D)).astype(np.float32) / np.float32(D) for _ in range(2))
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    alpha = np.full((T, H, D), 0.9, np.float32)
    beta = np.full((T, H), 0.5, np.float32)
    S0 = (0.1 * rng.standard_normal((H, D, D))).astype(np.float32)
    ref = best_time(lambda: delta_rule_reference(S0.copy(), q, k, v, alpha, beta))
    row: list[object] = [T, f"{1e3 * ref / T:.3f}"]
    for threads in (1, 2):
        c = best_time(lambda: delta_rule(KDAState(S0[:0], S0.copy()), q, k, v, alpha, beta, threads))  # noqa: B023
        row += [f"{1e3 * c / T:.3f}", f"{ref / c:.1f}x"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    print(
        f"machine: {machine()}\ncommit: {commit()}\nKDA state: {args.heads} heads x {args.dim} x {args.dim} float32\n"
    )
    rng = np.random.default_rng(0)
    rows = [measure(T, args.heads, args.dim, rng) for T in (1, 64)]
    print(table(["tokens", "numpy ms/token", "C 1 thr", "speed-up", "C 2 thr", "speed-up"], rows))


if __name__ == "__main__":
    main()
