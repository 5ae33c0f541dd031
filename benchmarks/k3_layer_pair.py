"""Decode and prefill milliseconds per token of one full-width Kimi K3 layer pair (one KDA and one MLA
layer, each with a latent MoE of 64 MXFP4 experts, top-16), at 1 and 2 threads. The checkpoint (~9 GB) is made once with

    moestream synth --arch kimi_k3 --full DIR --set num_hidden_layers=2 --set num_experts=64 \\
        --set first_k_dense_replace=0

    python3 benchmarks/k3_layer_pair.py [--dir /tmp/k3pair] [--prompt 16] [--gen 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import moestream
from common import commit, machine, table
from moestream.generate import GenerationStats
from moestream.synth import k3_full, synth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/k3pair"))
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=8)
    args = ap.parse_args()
    if not (args.dir / "config.json").exists():
        overrides = k3_full({"num_hidden_layers": 2, "num_experts": 64, "first_k_dense_replace": 0})
        synth("kimi_k3", args.dir, overrides, seed=0)
    print(f"machine: {machine()}\ncommit: {commit()}")
    print(f"model: {args.dir}: Kimi K3 widths, layers KDA + MLA, 64 MXFP4 experts each (top-16)")
    print(f"prompt {args.prompt} tokens, {args.gen} generated\n")
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, 256, args.prompt)]
    rows: list[list[object]] = []
    for threads in (1, 2):
        model = moestream.load(args.dir, threads=threads)
        list(model.generate(prompt[:2], 2, stop_at_eos=False))  # warm up
        stats = GenerationStats()
        list(model.generate(prompt, args.gen, stop_at_eos=False, stats=stats))
        ms_per_token = 1e3 * stats.decode_seconds / max(stats.generated_tokens - 1, 1)
        prefill_ms = 1e3 * stats.prefill_seconds / args.prompt
        rows.append([threads, f"{ms_per_token:.1f}", f"{prefill_ms:.1f}", f"{1e3 / prefill_ms:.1f}"])
        del model
    print(table(["threads", "decode ms/token", "prefill ms/token", "prefill tok/s"], rows))


if __name__ == "__main__":
    main()
