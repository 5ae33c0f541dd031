"""The quality yardstick: the trained demo Kimi K3 packed in every format `moestream pack` writes, routed
experts and trunk requantized separately, with held-out bits per byte (Python standard library files the
demo never trained on) and the mean KL divergence of the next-token distributions against the demo as
shipped (bf16 trunk, MXFP4 experts).

    python3 benchmarks/quality.py [--windows 24] [--seq 256] [--model DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import moestream
from common import commit, machine, table
from moestream.default_model import default_model_path
from moestream.formats.packed import PACK_FORMATS, pack
from moestream.quality import kl_divergence, log_softmax


def held_out_windows(model: moestream.Model, n: int, seq: int) -> list[list[int]]:
    """The first n windows of seq + 1 tokens of the held-out files, each file as [BOS] + its tokens."""
    import train_demo

    stream: list[int] = []
    for rel, text in train_demo.stdlib_files():
        if train_demo.is_held_out(rel):
            stream += model.tokenize(text)  # adds [BOS]
        if len(stream) > n * seq + 1:
            break
    return [stream[i * seq : i * seq + seq + 1] for i in range(n)]


def evaluate(model: moestream.Model, windows: list[list[int]], bos: int) -> tuple[float, list[np.ndarray]]:
    """Held-out bits per byte (BOS targets excluded) and the logits of every window."""
    assert model.tokenizer is not None
    nll, nbytes, all_logits = 0.0, 0, []
    for w in windows:
        logits = model.logits(w[:-1])
        all_logits.append(logits)
        lp = log_softmax(logits)
        for t, target in enumerate(w[1:]):
            if target == bos:
                continue
            nll -= float(lp[t, target])
            nbytes += len(model.detokenize([target]).encode())
    return nll / math.log(2) / nbytes, all_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the demo model in the package")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = args.model or default_model_path()
    base = moestream.load(src, threads=args.threads)
    bos = base.tokenize("", add_bos=True)[0]
    windows = held_out_windows(base, args.windows, args.seq)
    base_bpb, base_logits = evaluate(base, windows, bos)
    print(f"machine: {machine()}\ncommit: {commit()}")
    print(f"model: {src}\nheld-out: {len(windows)} windows of {args.seq} tokens\n")
    rows: list[list[object]] = [["as shipped (bf16 trunk, mxfp4 experts)", "", f"{base_bpb:.4f}", "0", ""]]
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("experts", "trunk"):
            for fmt in [f for f in PACK_FORMATS if f != "keep"]:
                dst = Path(tmp) / f"{part}-{fmt}"
                kw = {"experts": fmt} if part == "experts" else {"trunk": fmt}
                try:
                    pack(src, dst, progress=False, **kw)
                except Exception as e:  # a format that cannot hold some matrix of this model
                    rows.append([f"{part} {fmt}", "", "", "", f"not packable: {e}"])
                    continue
                size = sum(f.stat().st_size for f in dst.glob("*.bin")) / 1e6
                model = moestream.load(dst, threads=args.threads)
                bpb, logits = evaluate(model, windows, bos)
                kl = float(np.mean([kl_divergence(a, b).mean() for a, b in zip(base_logits, logits, strict=True)]))
                rows.append([f"{part} {fmt}", f"{size:.1f}", f"{bpb:.4f}", f"{kl:.5f}", ""])
                del model
                for f in dst.iterdir():
                    f.unlink()
                dst.rmdir()
    print(table(["packed", "MB", "held-out bits/byte", "mean KL (nats)", "note"], rows))


if __name__ == "__main__":
    main()
