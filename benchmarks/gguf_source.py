"""One model in three forms, run by moestream straight from each, beside llama.cpp: llama.cpp's own Q4_K_M
GGUF, moestream's q4_k_m pack of the same checkpoint, and the bf16 checkpoint itself; each at full RAM and
in a memory cgroup (moestream with --ram sized to fit in it). One table, one run: decode tok/s, GB read
from disk per decoded token, peak RSS, the files on disk; the ratios GGUF / pack (the GGUF path should be
within 10% of the packed one), pack / checkpoint (what `moestream pack` buys) and moestream / llama.cpp.

    python3 benchmarks/gguf_source.py [--llama-cpp /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp] \\
        [--layers 8] [--limit 1G] [--ram 850M] [--prompt 16] [--gen 16] [--threads 2] [--rounds 1] \\
        [--skip-checkpoint] [--json FILE]

The model is decode.py's synthetic Qwen3-30B-A3B-width qwen3_moe (8 layers: 11.2 GB bf16), made once under
/tmp/moestream-bench with its GGUF (llama.cpp's converter, then its quantizer at Q4_K_M) as streaming.py makes
it, and the pack of that GGUF (`moestream pack X.gguf DST`: the same blocks, one blob an expert; the same
weights, so the same routing and tokens, and the GGUF / pack ratio is the layout's alone); llama-cpp-python built
from source, its sdist's llama.cpp tree given as --llama-cpp (only needed while the GGUF is missing). Needs
root for the memory cgroup (v1 or v2).

Every run is a fresh process. Full-RAM runs start with their files read once into the page cache (evicted
first, so that the pages come from disk as large folios: decode.py); cgroup runs start with every model
file evicted, so that nothing is served from pages charged outside the cgroup. moestream runs what
`moestream run SRC [--ram R] --report` runs (load, use_budget planned for this prompt and generation, greedy
generate, Model.report); both engines' disk traffic is the read_bytes of /proc/self/io (page faults, reads
and O_DIRECT alike) between the first generated token and the last, and peak RSS is VmHWM. llama.cpp runs
at full RAM as it does by default (Q4_K weights repacked into its own memory) and with its weights left in
the mmap; in the cgroup only the latter (the repacked copy is killed at load: NOTES.md). On a CPU with AMX,
llama-cpp-python 0.3.36 repacks Q4_K for AMX and dies of SIGSEGV in its first decode: that row says so.
llama.cpp's greedy ids come from its context's logits (Llama.eval leaves llm.scores at zero unless
logits_all); on the same GGUF they match moestream's (4 of 4 on this prompt).

Setup from nothing, 2 shared cores: llama-cpp-python from source 17 min, synth 6 min, pack 3 min, the GGUF
(convert 3 min, quantize 6 min) 9 min; 15 GB under /tmp/moestream-bench (the bf16 GGUF is deleted).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_LLAMA_CPP = Path("/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp")
GOAL = 0.10  # issue 43: the GGUF path within 10% of the packed path


# ---- the child processes: one run each, one JSON line out ---------------------------------------------


def _io_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024


def child_moestream(source: str, threads: int, gen: int, prompt: list[int], ram: str | None) -> dict[str, Any]:
    """What `moestream run SOURCE --ids ... --gen N --ignore-eos [--ram R] --report` does (cli.cmd_run),
    with the disk reads of the decoded tokens counted around it."""
    import moestream
    from moestream.generate import GenerationStats

    t0 = time.perf_counter()
    model = moestream.load(source, threads=threads, preload=False if ram else None, progress=False)
    if ram:
        model.use_budget(ram, context=len(prompt) + gen, prompt_tokens=len(prompt))
    load_s = time.perf_counter() - t0
    stats = GenerationStats()
    ids: list[int] = []
    r1 = 0
    for tok in model.generate(prompt, gen, stop_at_eos=False, stats=stats):
        if not ids:  # the prompt is in: what follows is decode
            if model.streaming is not None:
                model.streaming.mark_prefill_done()
            r1 = _io_read()
        ids.append(tok)
    r2 = _io_read()
    report = model.report(stats)
    model.close()
    return {
        "load_s": load_s,
        "prefill_tok_s": report["prefill_tokens_per_second"],
        "decode_tok_s": report["decode_tokens_per_second"],
        "read_per_token": (r2 - r1) / (gen - 1),
        "peak_rss": report["peak_rss"],
        "ids": ids,
        "report": report,
    }


def child_llama_cpp(gguf: str, threads: int, gen: int, prompt: list[int], repack: bool) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python, greedy, repack False: weights kept in the mmap (Llama() does not
    expose the flag, so the model params are set where it reads them)."""
    import llama_cpp
    import llama_cpp.llama_cpp as C
    import numpy as np

    default_params = C.llama_model_default_params

    def params() -> Any:
        p = default_params()
        p.use_extra_bufts = repack
        return p

    C.llama_model_default_params = params
    t0 = time.perf_counter()
    n_ctx = max(256, len(prompt) + gen)
    llm = llama_cpp.Llama(
        gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx, use_mmap=True, verbose=False
    )
    load_s = time.perf_counter() - t0

    def greedy() -> int:
        # the last token's logits from the context itself: Llama.eval fills llm.scores only with logits_all
        # (0.3.36), and without them every argmax is token 0
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))))

    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    ids = [greedy()]
    r1, t0 = _io_read(), time.perf_counter()
    for _ in range(gen - 1):
        llm.eval([ids[-1]])
        ids.append(greedy())
    decode, r2 = time.perf_counter() - t0, _io_read()
    return {
        "load_s": load_s,
        "prefill_tok_s": len(prompt) / prefill,
        "decode_tok_s": (gen - 1) / decode,
        "read_per_token": (r2 - r1) / (gen - 1),
        "peak_rss": _vm_hwm(),
        "ids": ids,
    }


def child(spec: dict[str, Any]) -> None:
    if spec["engine"] == "moestream":
        out = child_moestream(spec["source"], spec["threads"], spec["gen"], spec["prompt"], spec["ram"])
    else:
        out = child_llama_cpp(spec["source"], spec["threads"], spec["gen"], spec["prompt"], spec["repack"])
    print(json.dumps(out))


# ---- the parent: models, runs, table ----------------------------------------------------------------------


@dataclass
class Run:
    label: str
    engine: str  # "moestream" or "llama.cpp"
    form: str  # "gguf", "pack", "checkpoint"
    source: Path
    files: list[Path]
    cgroup: bool
    repack: bool = False
    result: dict[str, Any] = field(default_factory=dict)  # the fastest round's, or {"error": ...}


def model_files(path: Path) -> list[Path]:
    """The files a source is made of: the .gguf; every file of a pack or checkpoint directory (the GGUF that
    decode.py writes into the checkpoint's directory is not part of it)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix != ".gguf")


def warm(paths: list[Path]) -> None:
    """Reads the files once into the page cache (a full-RAM run's starting point)."""
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def run_once(run: Run, args: argparse.Namespace, prompt: list[int], everything: list[Path], cg: Any) -> dict:
    from common import evict

    evict(everything)
    if not run.cgroup:
        warm(run.files)
    spec = {
        "engine": run.engine,
        "source": str(run.source),
        "threads": args.threads,
        "gen": args.gen,
        "prompt": prompt,
        "ram": args.ram if run.cgroup and run.engine == "moestream" else None,
        "repack": run.repack,
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    p = cg.run(cmd) if run.cgroup else subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        err = p.stderr.strip().splitlines()
        if p.returncode in (-9, 137) and not err:
            return {"error": "killed by the memory cgroup" if run.cgroup else "killed by SIGKILL"}
        if p.returncode < 0:  # llama.cpp repacked for AMX dies of SIGSEGV in its first decode (decode.py)
            return {"error": f"killed by {signal.Signals(-p.returncode).name}"}
        return {"error": (err[-1] if err else f"exit code {p.returncode}")[-200:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def ensure_models(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    from decode import QWEN3_30B_A3B, llama_cpp_gguf
    from moestream.formats.packed import pack
    from moestream.synth import synth

    path = Path(f"/tmp/moestream-bench/qwen3-30b-a3b-L{args.layers}")
    if not (path / "config.json").exists():
        print(f"writing {path} ...", file=sys.stderr)
        synth("qwen3_moe", path, {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}, dtype="bf16", seed=0)
    gguf = path / "ggml-q4_k_m.gguf"
    if not gguf.exists():
        print(f"converting and quantizing {gguf} ...", file=sys.stderr)
        gguf = llama_cpp_gguf(args.llama_cpp, path)
    # the same model packed: the GGUF's own blocks, laid out as one blob an expert (same weights, same
    # routing, so the two runs differ only in how the experts lie on disk)
    packed = path.with_name(path.name + "-gguf-pack")
    if not (packed / "manifest.json").exists():
        print(f"packing {packed} ...", file=sys.stderr)
        pack(gguf, packed, progress=False)
    return path, packed, gguf


def ratio(a: Run, b: Run) -> float | str:
    if "error" in a.result or "error" in b.result or not b.result["decode_tok_s"]:
        return "n/a"
    return float(a.result["decode_tok_s"] / b.result["decode_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP, help="llama.cpp source tree (converter)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--limit", default="1G", help="memory cgroup limit of the cgroup runs")
    ap.add_argument("--ram", default="850M", help="moestream's --ram inside the limit")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=16, help="generated tokens (at least 2; 2 for a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each row, in turn; the fastest is shown")
    ap.add_argument("--skip-checkpoint", action="store_true", help="leave out the bf16 checkpoint's rows")
    ap.add_argument("--json", type=Path, default=None, help="write every row's numbers here")
    args = ap.parse_args()
    if args.gen < 2 or args.prompt < 1 or args.rounds < 1:
        raise SystemExit("--gen must be at least 2, --prompt and --rounds at least 1")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import numpy as np

    from common import commit, evict, machine, table
    from moestream.runtime.planner import parse_size
    from streaming import Cgroup

    path, packed, gguf = ensure_models(args)
    limit = parse_size(args.limit)
    prompt = [int(i) for i in np.random.default_rng(0).integers(300, 150000, size=args.prompt)]
    full, small = "full RAM", f"{args.limit} cgroup"
    runs = [
        Run(f"moestream, GGUF, {full}", "moestream", "gguf", gguf, [gguf], False),
        Run(f"moestream, GGUF, {small}", "moestream", "gguf", gguf, [gguf], True),
        Run(f"moestream, pack, {full}", "moestream", "pack", packed, model_files(packed), False),
        Run(f"moestream, pack, {small}", "moestream", "pack", packed, model_files(packed), True),
    ]
    if not args.skip_checkpoint:
        files = model_files(path)
        runs += [
            Run(f"moestream, checkpoint, {full}", "moestream", "checkpoint", path, files, False),
            Run(f"moestream, checkpoint, {small}", "moestream", "checkpoint", path, files, True),
        ]
    runs += [
        Run(f"llama.cpp, GGUF, {full} (repacked)", "llama.cpp", "gguf", gguf, [gguf], False, repack=True),
        Run(f"llama.cpp, GGUF, {full} (mmap)", "llama.cpp", "gguf", gguf, [gguf], False),
        Run(f"llama.cpp, GGUF, {small} (mmap)", "llama.cpp", "gguf", gguf, [gguf], True),
    ]
    everything = sorted({f for r in runs for f in r.files})

    import llama_cpp

    print(f"model: qwen3_moe Qwen3-30B-A3B width, {args.layers} layers, as three sources:")
    print(f"  GGUF: {gguf} (llama.cpp's converter + quantizer, Q4_K_M)")
    print(f"  pack: {packed} (moestream pack of the GGUF: its blocks kept, one blob an expert)")
    print(f"  checkpoint: {path} (bf16 safetensors)")
    print(f"threads {args.threads}; prompt {args.prompt} tokens, generate {args.gen}; best of {args.rounds} round(s)")
    print(f"cgroup runs: memory limit {args.limit}, moestream --ram {args.ram}, every model file evicted first\n")

    cg = Cgroup("moestream-gguf-bench", limit)
    try:
        for _ in range(args.rounds):
            for run in runs:
                print(f"  {run.label} ...", file=sys.stderr, flush=True)
                res = run_once(run, args, prompt, everything, cg)
                old = run.result
                if not old or "error" in old or ("error" not in res and res["decode_tok_s"] > old["decode_tok_s"]):
                    run.result = res
    finally:
        cg.close()
        evict(everything)

    rows: list[list[object]] = []
    for run in runs:
        on_disk = sum(f.stat().st_size for f in run.files) / 1e9
        r = run.result
        if "error" in r:
            rows.append([run.label, f"failed: {r['error']}", "", "", "", f"{on_disk:.2f}", ""])
            continue
        rows.append(
            [
                run.label,
                r["decode_tok_s"],
                1 / r["decode_tok_s"],
                f"{r['read_per_token'] / 1e9:.3f}",
                r["peak_rss"] / 2**30,
                on_disk,
                r["load_s"],
            ]
        )
    by = {(r.engine, r.form, r.cgroup, r.repack): r for r in runs}
    ratios: list[list[object]] = []
    for cgroup, where in ((False, full), (True, small)):
        g, p = by[("moestream", "gguf", cgroup, False)], by[("moestream", "pack", cgroup, False)]
        x = ratio(g, p)
        if not isinstance(x, str):  # issue 43: the GGUF path within 10% of the packed path
            x = f"{x:.2f} (goal >= {1 - GOAL:.2f}: {'met' if x >= 1 - GOAL else 'NOT met'})"
        ratios.append([f"decode tok/s, moestream GGUF / pack, {where}", x])
        c = by.get(("moestream", "checkpoint", cgroup, False))
        if c is not None:
            ratios.append([f"decode tok/s, moestream pack / checkpoint, {where}", ratio(p, c)])
            if not cgroup:
                size = {r.form: sum(f.stat().st_size for f in r.files) for r in (g, p, c)}
                ratios.append(["bytes on disk, checkpoint / pack", size["checkpoint"] / size["pack"]])
                ratios.append(["bytes on disk, GGUF / pack", size["gguf"] / size["pack"]])
        peers = [r for r in runs if r.engine == "llama.cpp" and r.cgroup == cgroup and "error" not in r.result]
        if peers:
            best = max(peers, key=lambda r: r.result["decode_tok_s"])
            ratios.append([f"decode tok/s, moestream GGUF / {best.label}", ratio(g, best)])
    print(table(["run", "decode tok/s", "s/token", "GB read/token", "peak RSS GiB", "files GB", "load s"], rows))
    print()
    print(table(["ratio", "value"], ratios))
    ref = by[("moestream", "gguf", False, False)].result.get("ids")
    if ref:
        agree = [
            f"{sum(a == b for a, b in zip(ref, r.result['ids'], strict=False))}/{args.gen} {r.label}"
            for r in runs
            if r.result.get("ids") and r is not by[("moestream", "gguf", False, False)]
        ]
        print("\ngreedy ids equal to moestream on the GGUF at full RAM: " + "; ".join(agree))
    print(
        "GB read/token: the process's read_bytes (/proc/self/io) over the decoded tokens; peak RSS: VmHWM "
        "(mapped file pages included); files: the source's files on disk"
    )
    print(f"machine: {machine()}\ncommit: {commit()}; llama-cpp-python {llama_cpp.__version__}")
    if args.json is not None:
        out = {
            "machine": machine(),
            "commit": commit(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": [{"label": r.label, **r.result} for r in runs],
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
