"""Where a decode token's time goes: every function of the C extension (moestream._C) is timed while a
model decodes, and the table gives each one's milliseconds and calls a token, beside the time outside all of
them (the Python and numpy glue between the kernels). With --stub-products the matvec products (`matmul`,
`matmul_many`, `glu_experts`) return at once without touching their outputs, so the glue runs with warm caches: the
difference between the two runs is what the streamed weights cost the glue by evicting it.

    python3 benchmarks/token_time.py [MODEL] [--threads 2] [--prompt 128] [--gen 32] [--rounds 3]
                                     [--stub-products]

MODEL defaults to the 8-layer pack that benchmarks/decode.py --llama-cpp writes
(/tmp/moestream-bench/qwen3-30b-a3b-L8-q4_k_m). The timers cost ~1 us a call (about a hundred calls a
token of that model); the figures are the medians over the rounds. With stubbed products the outputs of
those products are whatever their buffers held, so the routing and the numbers are meaningless and only
the times count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import moestream
from common import DEFAULT_PACK, commit, machine, require_model, table
from moestream import _C

PRODUCTS = ("matmul", "matmul_many", "glu_experts")


def instrument(stub: bool) -> tuple[Counter[str], Counter[str]]:
    """Wraps every function of _C in a timer (or, for the products with stub, in a timer around nothing);
    returns the (seconds, calls) counters the wrappers add to."""
    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return None if stub and name in PRODUCTS else fn(*args)
            finally:
                seconds[name] += time.perf_counter() - t0
                calls[name] += 1

        return run

    for name in dir(_C):
        fn = getattr(_C, name)
        if callable(fn) and not name.startswith("_") and not isinstance(fn, type):
            setattr(_C, name, timed(name, fn))
    return seconds, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path, default=DEFAULT_PACK)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stub-products", action="store_true")
    args = ap.parse_args()
    require_model(args.model)
    model = moestream.load(args.model, threads=args.threads)
    seconds, calls = instrument(args.stub_products)
    rng = np.random.default_rng(0)
    prompt = [int(i) for i in rng.integers(300, min(150000, model.vocab_size), size=args.prompt)]
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {args.model}")
    stub = ", the products stubbed out" if args.stub_products else ""
    print(f"prompt {args.prompt} tokens, then {args.gen} decode tokens timed, threads {args.threads}{stub}\n")
    per_round: list[dict[str, float]] = []
    np.seterr(all="ignore")  # stubbed products leave garbage in their outputs
    for _ in range(args.rounds):
        state = model.new_state()
        model.decoder.forward(prompt, state, model.ctx)
        seconds.clear()
        calls.clear()
        t0 = time.perf_counter()
        for i in range(args.gen):
            model.decoder.forward([prompt[i % len(prompt)]], state, model.ctx)
        total = (time.perf_counter() - t0) / args.gen
        row = {name: s / args.gen for name, s in seconds.items()}
        row["(outside the C calls)"] = total - sum(row.values())
        row["(token)"] = total
        per_round.append(row)
    names = sorted({n for r in per_round for n in r}, key=lambda n: -statistics.median(r.get(n, 0) for r in per_round))
    rows = []
    for name in names:
        ms = [1e3 * r.get(name, 0.0) for r in per_round]
        n = f"{calls[name] / args.gen:g}" if name in calls else ""
        rows.append([name, f"{statistics.median(ms):.2f}", f"{min(ms):.2f}-{max(ms):.2f}", n])
    print(table(["function", "ms a token (median)", "range over rounds", "calls a token"], rows))


if __name__ == "__main__":
    main()
