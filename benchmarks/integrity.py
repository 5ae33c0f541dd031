"""The cost of the run-time integrity checks: raw CRC-32C speed beside a plain read, and decode tok/s with
the checks on and off, resident and under --ram (the same run, each setting in its own process, rounds
alternating on and off so that drift of a shared machine hits both alike).

    python3 benchmarks/integrity.py [MODEL] [--ram 2G] [--gen 16] [--threads 2] [--rounds 3] [--crc-mb 256]

MODEL is a packed store (default: decode.py's Qwen3-30B-A3B-width Q4_K_M pack). The checks are turned off
with MOESTREAM_NO_INTEGRITY_CHECKS=1, which exists for this A/B only. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_PACK, best_time, commit, machine, read_gbs, require_model, table
from moestream import _C
from moestream.formats.packed import CHECKS_OFF_ENV


def crc_rows(nbytes: int, threads: int) -> list[list[object]]:
    """GB/s of each checksum over a buffer of nbytes on one thread, and the plain read at 1 and `threads`."""
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    gbs = {
        "crc32c (SSE4.2, three streams)" if _C.crc32c_hardware() else "crc32c": lambda: _C.crc32c(buf),
        "crc32c (portable tables)": lambda: _C.crc32c(buf, portable=True),
        "zlib.crc32 (version-1 stores)": lambda: zlib.crc32(buf),
    }
    rows: list[list[object]] = [[name, nbytes / best_time(fn, 3, 0.5) / 1e9] for name, fn in gbs.items()]
    rows.append(["plain read, 1 thread", read_gbs(buf, 1, 0.5, 3)])
    if threads > 1:
        rows.append([f"plain read, {threads} threads", read_gbs(buf, threads, 0.5, 3)])
    return rows


def decode_tok_s(model: Path, extra: list[str], checks: bool, args: argparse.Namespace, tmp: Path) -> float:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop(CHECKS_OFF_ENV, None)
    if not checks:
        env[CHECKS_OFF_ENV] = "1"
    ids = ",".join(str(3 + i % 97) for i in range(args.prompt))
    report = tmp / "report.json"
    cmd = [sys.executable, "-m", "moestream", "run", str(model), "--ids", ids, "--gen", str(args.gen)]
    cmd += ["--json", "--ignore-eos", "--threads", str(args.threads), "--report", str(report), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return float(json.loads(report.read_text())["decode_tokens_per_second"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path, default=DEFAULT_PACK)
    ap.add_argument("--ram", default="2G", help="the budget of the streamed runs (default 2G)")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--crc-mb", type=int, default=256, help="buffer of the raw checksum speeds (default 256 MB)")
    args = ap.parse_args()
    require_model(args.model)
    print(f"machine: {machine()}\ncommit: {commit()}\n")
    print(table(["checksum", "GB/s"], crc_rows(args.crc_mb << 20, args.threads)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("resident", []), (f"--ram {args.ram}", ["--ram", args.ram])):
            on, off = [], []
            for _ in range(args.rounds):
                off.append(decode_tok_s(args.model, extra, False, args, Path(tmp)))
                on.append(decode_tok_s(args.model, extra, True, args, Path(tmp)))
            a, b = statistics.median(off), statistics.median(on)
            rows.append([label, a, b, f"{100 * (a - b) / a:+.1f}%"])
    print()
    print(table(["run", "decode tok/s, checks off", "checks on", "cost (median of rounds)"], rows))


if __name__ == "__main__":
    main()
