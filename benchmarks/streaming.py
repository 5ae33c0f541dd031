"""Decode inside a memory cgroup: moestream streaming a q4_k_m pack within --ram beside llama.cpp mmap'ing
the same model at Q4_K_M, both in the same limit, and the disk-bound limit (bytes read per token over the
O_DIRECT read bandwidth measured here).

    python3 benchmarks/streaming.py --llama-cpp /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        [--layers 8] [--limit 1G] [--ram 850M] [--gen 16] [--threads 2]

The model is decode.py's synthetic Qwen3-30B-A3B-width qwen3_moe (8 layers: 11.2 GB bf16, 3.5 GB at
Q4_K_M), made once under /tmp/moestream-bench. Needs root (a cgroup v1 or v2 memory controller); each
engine runs in a fresh cgroup with the model's files evicted from the page cache first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, evict, machine, table
from decode import QWEN3_30B_A3B, llama_cpp_gguf
from moestream.formats.packed import PackedStore, pack
from moestream.runtime.planner import parse_size
from moestream.runtime.reader import read_bandwidth
from moestream.synth import synth

LLAMA = """
import json, sys, time
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as C
path, prompt = sys.argv[1], json.loads(sys.argv[4])
threads, gen, lazy = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
def io():
    return int([l for l in open("/proc/self/io") if l.startswith("read_bytes")][0].split()[1])
# weights stay in the mmap (no repacked copy; Llama() does not expose the flag), lazy: llama.cpp's own
# on-demand reading of the rows of marked tensors
default_params = C.llama_model_default_params
def params():
    p = default_params()
    p.use_extra_bufts = False
    if hasattr(p, "lazy_mode"):
        p.lazy_mode = lazy
    return p
C.llama_model_default_params = params
llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=256, n_batch=256, use_mmap=True,
                      verbose=False)
# the last token's logits from the context: Llama.eval fills llm.scores only with logits_all (0.3.36)
greedy = lambda: int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))))
t0, r0 = time.perf_counter(), io()
llm.eval(prompt)
prefill, r1 = time.perf_counter() - t0, io()
ids = [greedy()]
t0 = time.perf_counter()
for _ in range(gen - 1):
    llm.eval([ids[-1]])
    ids.append(greedy())
decode, r2 = time.perf_counter() - t0, io()
print(json.dumps({"prefill_s": prefill, "decode_tok_s": (gen - 1) / decode,
                  "read_per_token": (r2 - r1) / (gen - 1), "ids": ids}))
"""


class Cgroup:
    """A memory cgroup (v2 if mounted, else v1) with a hard limit; run() starts a command inside it."""

    def __init__(self, name: str, limit: int):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        self.path = Path("/sys/fs/cgroup") / name if v2 else Path("/sys/fs/cgroup/memory") / name
        self.path.mkdir(exist_ok=True)
        (self.path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        if not v2:
            (self.path / "memory.memsw.limit_in_bytes").exists()

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        wrapper = f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"'
        return subprocess.run(["sh", "-c", wrapper, "sh", *cmd], capture_output=True, text=True)

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def direct_bandwidth(packed: Path, seconds: float = 3.0) -> float:
    """GB/s of random reads of one expert blob's size from the pack's expert file, 4 in flight (as the
    engine reads)."""
    store = PackedStore(packed)
    size = max(b["nbytes"] for b in store.manifest["expert_blobs"].values())
    return read_bandwidth(packed / store.manifest["files"]["experts"], size, seconds)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--limit", default="1G", help="memory cgroup limit for each engine")
    ap.add_argument("--ram", default="850M", help="moestream's --ram inside the limit")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = Path(f"/tmp/moestream-bench/qwen3-30b-a3b-L{args.layers}")
    if not (path / "config.json").exists():
        synth("qwen3_moe", path, {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}, dtype="bf16", seed=0)
    packed = path.with_name(path.name + "-q4_k_m")
    if not (packed / "manifest.json").exists():
        pack(path, packed, experts="q4_k_m", trunk="q4_k_m", progress=False)
    gguf = llama_cpp_gguf(args.llama_cpp, path)
    prompt = [int(i) for i in np.random.default_rng(0).integers(300, 150000, size=args.prompt)]
    limit = parse_size(args.limit)
    print(f"machine: {machine()}\ncommit: {commit()}")
    print(f"model: qwen3_moe Qwen3-30B-A3B width, {args.layers} layers; moestream pack {packed}")
    print("both sides quantized with llama.cpp's Q4_K_M mix (moestream: --experts q4_k_m --trunk q4_k_m)")
    print(f"memory cgroup limit {args.limit} for each engine; moestream --ram {args.ram}; threads {args.threads}")
    print(f"prompt {args.prompt} tokens, generate {args.gen}\n")

    bw_before = direct_bandwidth(packed)
    cg = Cgroup("moestream-bench", limit)
    try:
        evict([packed / "trunk.bin", packed / "experts.bin", gguf])
        with tempfile.TemporaryDirectory() as tmp:
            rep = Path(tmp) / "report.json"
            ids = ",".join(map(str, prompt))
            cmd = [sys.executable, "-m", "moestream", "run", str(packed), "--ids", ids, "--gen", str(args.gen)]
            cmd += ["--json", "--ignore-eos", "--ram", args.ram, "--threads", str(args.threads), "--report", str(rep)]
            p = cg.run(cmd)
            if p.returncode != 0:
                raise SystemExit(f"moestream failed: {p.stderr.strip()}")
            ours = json.loads(rep.read_text())
            ours_ids = json.loads(p.stdout)["generated_ids"]
        peers = {}
        for lazy, label in ((0, "mmap"), (2, "mmap, lazy rows")):
            evict([packed / "trunk.bin", packed / "experts.bin", gguf])
            q = cg.run([sys.executable, "-c", LLAMA, str(gguf), str(args.threads), str(args.gen), json.dumps(prompt),
                        str(lazy)])  # fmt: skip
            if q.returncode != 0:
                killed = "killed by the memory cgroup" if q.returncode in (-9, 137) or not q.stderr.strip() else ""
                peers[label] = {"error": killed or q.stderr.strip()[-300:]}
            else:
                peers[label] = json.loads(q.stdout.strip().splitlines()[-1])
    finally:
        cg.close()
    bw_after = direct_bandwidth(packed)
    bw = max(bw_before, bw_after)  # the disk is noisy: the faster probe gives the tighter bound
    s = ours["streaming"]
    ours_tps = ours["decode_tokens_per_second"]
    bound = s["decode_bytes_read_per_token"] / (bw * 1e9)  # seconds per token if reads were all that mattered
    rows: list[list[object]] = [
        ["moestream (q4_k_m, --ram)", ours_tps, s["decode_bytes_read_per_token"] / 1e6, f"{100 * s['hit_rate']:.1f}%"]
    ]
    ok = {k: v for k, v in peers.items() if "error" not in v}
    for label, peer in peers.items():
        if "error" in peer:
            rows.append([f"llama.cpp (Q4_K_M, {label})", f"failed: {peer['error']}", "", ""])
        else:
            rows.append([f"llama.cpp (Q4_K_M, {label})", peer["decode_tok_s"], peer["read_per_token"] / 1e6, ""])
    if ok:
        best = max(ok.values(), key=lambda v: v["decode_tok_s"])
        rows.append(["ratio moestream / best llama.cpp", ours_tps / best["decode_tok_s"], "", ""])
    print(table(["engine", "decode tok/s", "MB read/token", "expert hit rate"], rows))
    print(
        f"\nO_DIRECT random blob reads: {bw_before:.2f} GB/s before, {bw_after:.2f} after; disk-bound limit "
        f"{1 / bound:.2f} tok/s ({s['decode_bytes_read_per_token'] / 1e6:.0f} MB/decoded token at {bw:.2f} GB/s); "
        f"moestream at {bound * ours_tps:.2f} of it "
        f"(distance {1 / (bound * ours_tps):.2f}x); peak RSS {ours['peak_rss'] / 2**20:.0f} MB; "
        f"prefetch accuracy {100 * s['prefetch_accuracy']:.0f}%; greedy ids agree on "
        + "; ".join(
            f"{sum(a == b for a, b in zip(ours_ids, v['ids'], strict=False))}/{args.gen} ({k})" for k, v in ok.items()
        )
    )


if __name__ == "__main__":
    main()
