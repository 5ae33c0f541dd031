"""`moestream pack` speed and memory: a checkpoint packed at 1 .. --threads threads, with the seconds, the
source GB/s, the peak anonymous memory (RssAnon, sampled every 20 ms: mapped checkpoint pages are the page
cache's, not the pack's) and a check that every thread count wrote the same bytes.

    python3 benchmarks/pack.py [SRC] [--experts q4_k_m] [--trunk q4_k_m] [--threads 2] [--rounds 2]

SRC defaults to decode.py's 8-layer Qwen3-30B-A3B-width bf16 checkpoint (written first if missing, about
8 minutes and 11.2 GB); the packed copies go next to it and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, machine, table
from decode import QWEN3_30B_A3B
from moestream.formats.packed import pack
from moestream.synth import synth


class AnonPeak:
    """The largest RssAnon of this process while in the with block (GB)."""

    def __enter__(self) -> AnonPeak:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("manifest.json", "trunk.bin", "experts.bin"):
        with open(path / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, nargs="?", default=Path("/tmp/moestream-bench/qwen3-30b-a3b-L8"))
    ap.add_argument("--experts", default="q4_k_m")
    ap.add_argument("--trunk", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not (args.src / "config.json").exists():
        print(f"writing {args.src} ...", file=sys.stderr)
        synth("qwen3_moe", args.src, {**QWEN3_30B_A3B, "num_hidden_layers": 8}, dtype="bf16", seed=0)
    source_bytes = sum(p.stat().st_size for p in args.src.glob("*.safetensors"))
    print(f"machine: {machine()}\ncommit: {commit()}")
    print(f"source: {args.src} ({source_bytes / 1e9:.1f} GB), --experts {args.experts} --trunk {args.trunk}\n")
    rows: list[list[object]] = []
    digests = set()
    dst = args.src.with_name(args.src.name + "-packbench")
    for r in range(args.rounds):
        for n in range(1, args.threads + 1):
            shutil.rmtree(dst, ignore_errors=True)
            with AnonPeak() as mem:
                t0 = time.perf_counter()
                pack(args.src, dst, experts=args.experts, trunk=args.trunk, progress=False, threads=n)
                seconds = time.perf_counter() - t0
            digests.add(digest(dst))
            out_bytes = sum(p.stat().st_size for p in dst.iterdir())
            rows.append([r + 1, n, seconds, source_bytes / seconds / 1e9, mem.peak / 1e9, out_bytes / 1e9])
    shutil.rmtree(dst, ignore_errors=True)
    print(table(["round", "threads", "seconds", "source GB/s", "peak anon GB", "store GB"], rows))
    print(f"\nevery run wrote the same bytes: {'yes' if len(digests) == 1 else 'NO'}")


if __name__ == "__main__":
    main()
