"""In-process A/B of two or more builds of moestream._C on a whole model: prefill and decode tokens/s of
each build, the builds taking turns round after round (A B, then B A) in one process on one loaded model,
so that all of them see the same machine, whose speed moves by a third within minutes here. Each round
prefills the prompt on a fresh state and decodes --gen tokens after it; the table gives each build's median
tokens/s and the median of its per-round ratios to the first build (with their range), and checks that
every build generated the same ids (the builds give the same bits, so they must).

    cp src/moestream/_C.*.so /tmp/before.so          # then change csrc/ and rebuild
    python3 setup.py build_ext --inplace && cp src/moestream/_C.*.so /tmp/after.so
    python3 benchmarks/model_ab.py /tmp/before.so /tmp/after.so [--model PATH] [--prompt 128] [--gen 16]
        [--rounds 30] [--threads 2]

MODEL defaults to the 8-layer pack that benchmarks/decode.py --llama-cpp writes. Every module of the package
that holds the extension as `_C` is pointed at each build in turn; the Python code is the working tree's for
all of them. Single rounds move by a third here: one build given twice (Zen 4, 30 rounds) gave 1.002 at the
median for prefill (0.76-1.38 per round) and 1.016 for decode, but 0.958 over 6 rounds, so count on 30.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import moestream
from common import DEFAULT_PACK, commit, machine, require_model, table
from kernels_ab import load_build
from moestream import _C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="paths of built extension modules (_C.*.so)")
    ap.add_argument("--model", type=Path, default=DEFAULT_PACK)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if len(args.builds) < 2:
        raise SystemExit("model_ab.py: give two or more builds")
    require_model(args.model)
    loaded: set[str] = set()
    builds = [load_build(path, loaded) for path in args.builds]
    model = moestream.load(args.model, threads=args.threads)
    package = [m for name, m in list(sys.modules.items()) if name.startswith("moestream")]
    holders = [m for m in package if m.__dict__.get("_C") is _C]  # the modules that call the extension
    prompt = [int(i) for i in np.random.default_rng(0).integers(300, min(150000, model.vocab_size), size=args.prompt)]
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {args.model}")
    print(f"prompt {args.prompt} tokens, then {args.gen} decode tokens, threads {args.threads}, {args.rounds} rounds\n")
    prefill: list[list[float]] = [[] for _ in builds]  # seconds per round
    decode: list[list[float]] = [[] for _ in builds]
    ids: list[list[int]] = [[] for _ in builds]
    try:
        for r in range(args.rounds + 1):  # round 0 warms every build up and is not counted
            for i in range(len(builds)) if r % 2 == 0 else reversed(range(len(builds))):
                for holder in holders:
                    holder._C = builds[i]
                state = model.new_state()
                t0 = time.perf_counter()
                logits = model.decoder.forward(prompt, state, model.ctx)
                t1 = time.perf_counter()
                out = [int(np.argmax(logits[-1]))]
                for _ in range(args.gen - 1):
                    out.append(int(np.argmax(model.decoder.forward([out[-1]], state, model.ctx)[-1])))
                t2 = time.perf_counter()
                if r == 0:
                    ids[i] = out
                    continue
                prefill[i].append(t1 - t0)
                decode[i].append((t2 - t1) / max(args.gen - 1, 1))
    finally:
        for holder in holders:
            holder._C = _C
    rows: list[list[object]] = []
    for i, path in enumerate(args.builds):
        p_ratio = [a / b for a, b in zip(prefill[0], prefill[i], strict=True)]
        d_ratio = [a / b for a, b in zip(decode[0], decode[i], strict=True)]
        rows.append(
            [
                path,
                f"{args.prompt / statistics.median(prefill[i]):.1f}",
                f"{statistics.median(p_ratio):.3f} ({min(p_ratio):.2f}-{max(p_ratio):.2f})",
                f"{1 / statistics.median(decode[i]):.1f}",
                f"{statistics.median(d_ratio):.3f} ({min(d_ratio):.2f}-{max(d_ratio):.2f})",
            ]
        )
    print(table(["build", "prefill tok/s", "to the first", "decode tok/s", "to the first"], rows))
    same = all(i == ids[0] for i in ids)
    print(f"\nthe same {args.gen} ids from every build: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
