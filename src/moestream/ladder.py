"""`moestream bench MODEL --ram A,B,C`: the memory ladder. The same prompt is generated at each budget,
each in a fresh process (so peak RSS is that budget's own), and the table gives seconds per token, the
expert hit rate, GB read per decoded token and peak RSS, with a check that every budget produced the
same tokens. --plot draws the ladder as a PNG (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write
from .errors import InputError
from .runtime.planner import parse_size


def run_budget(model: Path, budget: str, prompt: list[int], gen: int, threads: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "moestream", "run", str(model), "--ids", ",".join(map(str, prompt))]
        cmd += ["--gen", str(gen), "--json", "--ignore-eos", "--report", str(report)]
        # greedy, whatever the model's generation_config.json says: every budget must give the same ids
        cmd += ["--temperature", "0"]
        if budget != "max":
            cmd += ["--ram", budget]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            msg = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
            return {"budget": budget, "error": msg.removeprefix("moestream: error: ")}
        rep = json.loads(report.read_text())
        out = json.loads(p.stdout)
    s = rep.get("streaming", {})
    return {
        "budget": budget,
        "budget_bytes": parse_size(budget) if budget != "max" else None,
        "seconds_per_token": rep["decode_seconds_per_token"],
        "tokens_per_second": rep["decode_tokens_per_second"],
        "hit_rate": s.get("hit_rate", 1.0),
        "gb_read_per_token": s.get("decode_bytes_read_per_token", 0.0) / 1e9,
        "peak_rss": rep["peak_rss"],
        "ids": out["generated_ids"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'budget':>8} {'s/token':>9} {'tok/s':>8} {'hit rate':>9} {'GB read/token':>14} {'peak RSS':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['budget']:>8}  refused: {r['error']}")
            continue
        lines.append(
            f"{r['budget']:>8} {r['seconds_per_token']:>9.4f} {r['tokens_per_second']:>8.2f} "
            f"{100 * r['hit_rate']:>8.1f}% {r['gb_read_per_token']:>14.4f} {r['peak_rss'] / 2**20:>8.0f} MB"
        )
    return "\n".join(lines)


def need_matplotlib() -> Any:
    """matplotlib, set to draw without a display; its absence is an InputError. cmd_bench calls this
    before the first run, so a missing package does not cost the whole ladder."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'moestream[plot]'") from None
    matplotlib.use("Agg")
    return matplotlib


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    need_matplotlib()
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    if not ok:
        raise InputError("--plot: no budget ran")
    labels = [r["budget"] for r in ok]
    x = np.arange(len(ok))
    fig, ax1 = plt.subplots(figsize=(7, 4), dpi=110)
    ax1.bar(x, [r["seconds_per_token"] for r in ok], color="#4878a8", label="s/token")
    ax1.set_ylabel("seconds per token")
    ax1.set_xlabel("RAM budget (--ram)")
    ax1.set_xticks(x, labels)
    ax2 = ax1.twinx()
    ax2.plot(x, [100 * r["hit_rate"] for r in ok], "o-", color="#d0743c", label="expert hit rate")
    ax2.set_ylabel("expert cache hit rate (%)")
    ax2.set_ylim(0, 105)
    for i, r in enumerate(ok):
        gb = r["gb_read_per_token"]
        label = f"{gb:.2f} GB/tok" if gb >= 1 else f"{1000 * gb:.1f} MB/tok"
        ax1.annotate(label, (i, r["seconds_per_token"]), ha="center", va="bottom", fontsize=8)
    ax1.set_title(title, fontsize=10)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="upper center", fontsize=8)
    fig.tight_layout()
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    from .generate import load

    budgets = [b.strip() for b in args.ram.split(",") if b.strip()]
    if not budgets:
        raise InputError("--ram: give budgets like 1G,2G,max")
    for b in budgets:
        if b != "max":
            parse_size(b)
    for flag, target in (("--plot", args.plot), ("--json", args.json)):
        if target is not None and not target.parent.is_dir():
            raise InputError(f"{flag}: directory {target.parent} does not exist")
    if args.plot is not None:
        need_matplotlib()
    loaded = load(args.model, preload=False)  # a hub id is fetched once, here
    assert loaded.source is not None
    model, vocab = loaded.source.path, loaded.vocab_size
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, vocab, args.prompt_tokens)]
    rows = []
    for b in budgets:
        print(f"budget {b} ...", file=sys.stderr, flush=True)
        rows.append(run_budget(model, b, prompt, args.gen, args.threads))
    print(f"model: {model}; prompt {args.prompt_tokens} tokens, {args.gen} generated")
    print(table(rows))
    ran = [r for r in rows if "error" not in r]
    if len(ran) > 1:
        same = all(r["ids"] == ran[0]["ids"] for r in ran)
        print(f"generated ids identical at every budget: {'yes' if same else 'NO'}")
    if args.json is not None:
        text = json.dumps([{k: v for k, v in r.items() if k != "ids"} for r in rows], indent=2) + "\n"
        with atomic_write(args.json, "w") as f:
            f.write(text)
    if args.plot is not None:
        plot(rows, args.plot, f"memory ladder: {model.name}")
        print(f"plot: {args.plot}")
    return 0 if ran else 1
