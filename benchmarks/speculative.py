"""Speculative decoding against plain decoding: decode tok/s, tokens per pass and bytes read per generated
token with `--speculate off` and `auto` (and a fixed K), on prompts that repeat their context and on
prompts that do not, for the demo model and the 8-layer Qwen3-30B-A3B-width pack, resident and inside a
memory cgroup with --ram. Every run is a fresh `moestream run` process; greedy ids must be identical.

    python3 benchmarks/speculative.py [--pack DIR] [--limit 1G] [--ram 850M] [--gen 96] [--threads 2]

The pack is streaming.py's (made once under /tmp/moestream-bench; --pack '' skips it). Needs root for the
cgroup (--no-cgroup runs only resident). Run it alone: any other process on a 2-core machine moves decode
several-fold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_PACK, commit, evict, machine, table
from moestream.runtime.planner import parse_size
from streaming import Cgroup


def demo_prompts() -> dict[str, str]:
    """Code editing (a function, then the start of it again to rewrite) and summarising a given text (the
    text, then a request to quote it), beside a prompt with nothing to copy."""
    src = Path(__import__("textwrap").__file__).read_text()
    fn = src[src.index("def dedent") :][:1400]
    doc = Path(__import__("json").__file__).read_text()
    doc = doc[doc.index('r"""') + 4 :][:1200]
    return {
        "code editing": fn + "\n\n\n# The same function, with the comments kept:\n" + fn[:160],
        "quoting a text": '"""' + doc + '"""\n\n# Quoted again, unchanged:\n"""' + doc[:120],
        "no repeats": "import os\n\n\ndef main(argv):\n    ",
    }


def pack_prompts(vocab: int) -> dict[str, list[int]]:
    """Random ids: a stretch said twice and begun a third time, beside ids that never repeat."""
    rng = np.random.default_rng(0)
    part = rng.integers(300, vocab - 300, 160).tolist()
    return {
        "repeated context": part + part + part[:16],
        "no repeats": rng.permutation(np.arange(300, vocab - 300))[:336].tolist(),
    }


def run(model: str, prompt: str | list[int], spec: str, args: argparse.Namespace, ram: str | None,
        cg: Cgroup | None) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "moestream", "run", model, "--gen", str(args.gen), "--json", "--ignore-eos"]
        cmd += ["--speculate", spec, "--threads", str(args.threads), "--report", str(rep)]
        if isinstance(prompt, str):
            (Path(tmp) / "prompt.txt").write_text(prompt)
            cmd += ["--prompt-file", str(Path(tmp) / "prompt.txt")]
        else:
            cmd += ["--ids", ",".join(map(str, prompt))]
        if ram is not None:
            cmd += ["--ram", ram]
        p = cg.run(cmd) if cg is not None else subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"moestream failed ({' '.join(cmd[3:6])}): {p.stderr.strip()[-400:]}")
        report = json.loads(rep.read_text())
        report["ids"] = json.loads(p.stdout)["generated_ids"]
        return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", default=str(DEFAULT_PACK), help="the 8-layer pack ('' to skip it)")
    ap.add_argument("--limit", default="1G", help="memory cgroup limit for the budgeted runs")
    ap.add_argument("--ram", default="850M", help="--ram inside the limit")
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specs", default="off,auto,8", help="the --speculate settings to run (off first)")
    ap.add_argument("--no-cgroup", action="store_true", help="only resident runs")
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    args = ap.parse_args()
    specs = args.specs.split(",")
    if specs[0] != "off":
        specs = ["off", *specs]

    cases: list[tuple[str, str, dict[str, Any], list[Path]]] = [("demo", "demo", demo_prompts(), [])]
    if args.pack:
        pack = Path(args.pack)
        if not (pack / "manifest.json").exists():
            raise SystemExit(f"{pack}: no pack (make it with benchmarks/streaming.py, or pass --pack '')")
        vocab = json.loads((pack / "config.json").read_text())["vocab_size"]
        cases.append(("qwen3-30b-a3b L8 q4_k_m", str(pack), pack_prompts(vocab), [pack / "trunk.bin",
                                                                                 pack / "experts.bin"]))  # fmt: skip
    print(f"machine: {machine()}\ncommit: {commit()}")
    print(
        f"threads {args.threads}, {args.gen} greedy tokens per run, --ignore-eos; budgeted runs: --ram {args.ram} "
        f"in a {args.limit} memory cgroup, the model's files evicted first\n"
    )
    rows: list[list[object]] = []
    out: list[dict[str, Any]] = []
    settings = [("resident", None)] + ([] if args.no_cgroup else [(f"--ram {args.ram} in {args.limit}", args.ram)])
    for label, model, prompts, files in cases:
        for where, ram in settings:
            if ram is not None and label == "demo":
                ram = "40M"  # the demo's experts are 40 MB in all: a budget that must stream them
            cg = Cgroup("moestream-spec", parse_size(args.limit)) if ram is not None else None
            try:
                for kind, prompt in prompts.items():
                    base: dict[str, Any] | None = None
                    for spec in specs:
                        if cg is not None:
                            evict(files)
                        r = run(model, prompt, spec, args, ram, cg)
                        sp = r["speculation"]
                        st = r.get("streaming", {})
                        if base is None:
                            base = r
                        same = r["ids"] == base["ids"]
                        speedup = r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
                        where_ram = where if ram is None or label != "demo" else f"--ram {ram} in {args.limit}"
                        rows.append([
                            label, where_ram, kind, spec, r["decode_tokens_per_second"], f"{speedup:.2f}x",
                            sp["tokens_per_pass"] if spec != "off" else 1.0,
                            f"{sp['drafts_accepted']}/{sp['drafts_proposed']}",
                            st.get("decode_bytes_read_per_token", 0) / 1e6 if st else "",
                            "yes" if same else "NO",
                        ])  # fmt: skip
                        out.append({"model": label, "where": where_ram, "prompt": kind, "speculate": spec,
                                    "decode_tok_s": r["decode_tokens_per_second"], "speedup": speedup,
                                    "speculation": sp, "streaming": st, "identical": same})  # fmt: skip
                        print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr)
            finally:
                if cg is not None:
                    cg.close()
    headers = ["model", "where", "prompt", "--speculate", "decode tok/s", "vs off", "tokens/pass", "accepted"]
    print(table([*headers, "MB read/token", "same ids"], rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
