"""Prefill and decode tokens/s on a synthetic Qwen3-30B-A3B-width qwen3_moe beside transformers (bf16,
the same checkpoint), and the GB/s the matvec kernels reach beside a plain memory read.

    python3 benchmarks/decode.py [--threads 2] [--layers 4] [--prompt 128] [--gen 16] [--dir PATH]

With --llama-cpp SRC (the llama.cpp source tree inside the llama-cpp-python sdist, which carries
convert_hf_to_gguf.py; llama-cpp-python itself built from source), the checkpoint is also converted and
quantized to Q4_K_M, packed by moestream with the same mix (q4_k_m), and both engines decode it side by
side (--skip-transformers for the 8-layer model of the formats issue, which does not fit as a torch model):

    python3 benchmarks/decode.py --layers 8 --skip-transformers --llama-cpp /tmp/llsrc/.../vendor/llama.cpp

The checkpoint (about 5 GB at 4 layers) is written once to --dir (default /tmp/moestream-bench/...). The
pack's and the GGUF's files are dropped from the page cache before the engines load them, so that both map
pages read from disk as after a reboot: a file just written sits in the page cache as small pages, which
on Linux 6.18 with ext4 map as 4 KB pages, while pages read ahead from disk come as large folios, mapped
2 MB at a time (Zen 4, one run each: decode 43.2 -> 51.5 tok/s for moestream, 44.7 -> 46.3 for llama.cpp;
a later A/B of a fresh copy against the same files evicted showed no difference, docs/measurements.md), and
either way both engines start alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moestream
from common import best_time, commit, evict, machine, read_gbs, table
from moestream.formats.packed import pack
from moestream.synth import synth

QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)


class Ours:
    def __init__(self, path: Path, threads: int):
        t0 = time.perf_counter()
        self.model = moestream.load(path, threads=threads)
        self.load_seconds = time.perf_counter() - t0

    def run(self, prompt: list[int], gen: int) -> tuple[float, float, list[int]]:
        stats = moestream.generate.GenerationStats()
        ids = list(self.model.generate(prompt, gen, stop_at_eos=False, stats=stats))
        return stats.prefill_tokens_per_second, stats.decode_tokens_per_second, ids


class Transformers:
    def __init__(self, path: Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.load_seconds = time.perf_counter() - t0
        self.model.generation_config.eos_token_id = None
        self.torch = torch

    def _generate(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        inp = self.torch.tensor([prompt])
        t0 = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(
                inp, attention_mask=self.torch.ones_like(inp), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - t0, out[0, len(prompt) :].tolist()

    def run(self, prompt: list[int], gen: int) -> tuple[float, float, list[int]]:
        prefill, _ = self._generate(prompt, 1)  # the prompt's forward pass and one token
        total, ids = self._generate(prompt, gen)
        return len(prompt) / prefill, (gen - 1) / max(total - prefill, 1e-9), ids


CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
import conversion.base as base
# the synthetic checkpoint's byte-level tokenizer is unknown to the converter's hash table: GPT-2 style
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf as c
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "bf16", "--outfile", {out!r}]
c.main()
"""


def llama_cpp_gguf(src: Path, model: Path) -> Path:
    """model converted with llama.cpp's own converter (bf16) and quantized with its quantizer (Q4_K_M)."""
    import subprocess

    import llama_cpp

    bf16, q4 = model / "ggml-bf16.gguf", model / "ggml-q4_k_m.gguf"
    if not q4.exists():
        if not bf16.exists():
            code = CONVERT.format(src=str(src), model=str(model), out=str(bf16))
            subprocess.run([sys.executable, "-c", code], check=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(q4).encode(), params) != 0:
            raise SystemExit("llama_model_quantize failed")
        bf16.unlink()
    return q4


class LlamaCpp:
    """repack=True: llama.cpp's default, weights copied into its repacked CPU layout at load; False: the weights
    stay in the mmap and run through the plain block kernels (faster on this kind of machine; Llama() does
    not expose the flag, so the model params are set where it reads them)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, repack: bool = True):
        import llama_cpp
        import llama_cpp.llama_cpp as C

        default_params = C.llama_model_default_params

        def params() -> object:
            p = default_params()
            p.use_extra_bufts = repack
            return p

        C.llama_model_default_params = params
        t0 = time.perf_counter()
        try:
            self.llm = llama_cpp.Llama(
                str(gguf),
                n_threads=threads,
                n_threads_batch=threads,
                n_ctx=n_ctx,
                n_batch=n_ctx,  # its scores array has n_batch rows; the prompt still runs 512 at a time
                n_ubatch=512,
                verbose=False,
            )
        finally:
            C.llama_model_default_params = default_params
        self.load_seconds = time.perf_counter() - t0

    def _greedy(self) -> int:
        """The last token's greedy id, from the context's logits: Llama.eval fills llm.scores only with
        logits_all (0.3.36), and without them every argmax would be token 0."""
        logits = self.llm._ctx.get_logits_ith(-1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def run(self, prompt: list[int], gen: int) -> tuple[float, float, list[int]]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        ids = [self._greedy()]
        t0 = time.perf_counter()
        for _ in range(gen - 1):
            llm.eval([ids[-1]])
            ids.append(self._greedy())
        decode = time.perf_counter() - t0
        return len(prompt) / prefill, (gen - 1) / decode, ids


PROBE = """
import sys
sys.path.insert(0, {here!r})
from pathlib import Path
from decode import LlamaCpp
LlamaCpp(Path({gguf!r}), {threads}, {n_ctx}, repack={repack}).run(list(range(300, 300 + {n})), 2)
"""


def llama_cpp_crashes(gguf: Path, threads: int, n_ctx: int, repack: bool, n: int) -> str | None:
    """How llama.cpp died prefilling and decoding an n-token prompt in a child process, or None if it did not
    (llama-cpp-python 0.3.36 with its weights repacked dies of SIGSEGV in its first llama_decode on a Xeon
    Sapphire Rapids, where it repacks Q4_K for AMX)."""
    import signal
    import subprocess

    here = str(Path(__file__).resolve().parent)
    code = PROBE.format(here=here, gguf=str(gguf), threads=threads, n_ctx=n_ctx, repack=repack, n=n)
    rc = subprocess.run([sys.executable, "-c", code], capture_output=True).returncode
    if rc == 0:
        return None
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


def memory_read(threads: int) -> float:
    """GB/s of a plain read of 2 GiB at this moment (the machines here move between two speeds)."""
    return read_gbs(np.ones(2 << 30, np.uint8), threads, 0.5, repeat=3)


def kernel_bandwidth(threads: int) -> list[list[object]]:
    rng = np.random.default_rng(0)
    rows = []
    base = memory_read(threads)
    import ml_dtypes

    for name, (r, c) in {
        "expert gate/up 768x2048": (768, 2048),
        "expert down 2048x768": (2048, 768),
        "attn q 4096x2048": (4096, 2048),
        "lm_head 151936x2048": (151936, 2048),
    }.items():
        # Many copies so the weights come from memory, not cache, as in decode.
        copies = max(1, int(1.5e9 // (r * c * 2)))
        ws = [moestream.quant.Weight(rng.standard_normal((r, c), np.float32).astype(ml_dtypes.bfloat16))]
        ws += [moestream.quant.Weight(ws[0].data.copy()) for _ in range(copies - 1)]
        x = rng.standard_normal((1, c)).astype(np.float32)
        i = [0]

        def step(ws: list = ws, x: np.ndarray = x, i: list = i) -> None:
            ws[i[0] % len(ws)].matmul(x, threads)
            i[0] += 1

        t = best_time(step, repeat=3, min_seconds=0.3)
        gbs = r * c * 2 / t / 1e9
        rows.append([f"bf16 matvec {name}", gbs, f"{100 * gbs / base:.0f}%"])
    rows.append(["memory read baseline", base, "100%"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    path = args.dir or Path(f"/tmp/moestream-bench/qwen3-30b-a3b-L{args.layers}")
    if not (path / "config.json").exists():
        print(f"writing {path} ...", file=sys.stderr)
        synth("qwen3_moe", path, {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}, dtype="bf16", seed=0)
    prompt = [int(i) for i in np.random.default_rng(0).integers(300, 150000, size=args.prompt)]

    print(f"machine: {machine()}\ncommit: {commit()}")
    print(f"model: qwen3_moe Qwen3-30B-A3B width, {args.layers} layers, bf16, {path}")
    print(f"prompt {args.prompt} tokens, generate {args.gen}, threads {args.threads}, best of {args.rounds} rounds")
    print("(the engines run in turn, round after round, so that both see the same machine noise)\n")
    engines: dict[str, Ours | Transformers | LlamaCpp] = {}
    if not args.skip_transformers:
        engines["moestream (bf16)"] = Ours(path, args.threads)
        engines["transformers (bf16)"] = Transformers(path, args.threads)
    if args.llama_cpp is not None:
        packed = path.with_name(path.name + "-q4_k_m")
        if not (packed / "manifest.json").exists():
            pack(path, packed, experts="q4_k_m", trunk="q4_k_m", progress=False)
        gguf = llama_cpp_gguf(args.llama_cpp, path)
        evict([packed / "trunk.bin", packed / "experts.bin", gguf])
        engines["moestream (q4_k_m pack)"] = Ours(packed, args.threads)
        n_ctx = max(512, args.prompt + args.gen)
        for name, repack in (("llama.cpp (Q4_K_M)", True), ("llama.cpp (Q4_K_M, not repacked)", False)):
            crash = llama_cpp_crashes(gguf, args.threads, n_ctx, repack, args.prompt)
            if crash is None:
                engines[name] = LlamaCpp(gguf, args.threads, n_ctx, repack=repack)
            else:
                print(f"{name}: left out, it crashed on this machine ({crash})")
    best: dict[str, list[float]] = {name: [0.0, 0.0] for name in engines}
    ids: dict[str, list[int]] = {}
    for engine in engines.values():
        engine.run(prompt[:8], 2)  # warm up
    read_before = memory_read(args.threads)
    for _ in range(args.rounds):
        for name, engine in engines.items():
            p, d, ids[name] = engine.run(prompt, args.gen)
            best[name] = [max(best[name][0], p), max(best[name][1], d)]
    rows: list[list[object]] = [[name, *best[name], f"{engines[name].load_seconds:.1f}"] for name in engines]
    for ours_name, peer in (
        ("moestream (bf16)", "transformers (bf16)"),
        ("moestream (q4_k_m pack)", "llama.cpp (Q4_K_M)"),
        ("moestream (q4_k_m pack)", "llama.cpp (Q4_K_M, not repacked)"),
    ):
        if ours_name in best and peer in best:
            pa, pb = best[ours_name], best[peer]
            rows.append([f"ratio {ours_name} / {peer}", pa[0] / pb[0], pa[1] / pb[1], ""])
    print(table(["engine", "prefill tok/s", "decode tok/s", "load s"], rows))
    read_after = memory_read(args.threads)
    print(f"\nmemory read at {args.threads} threads just before / after the rounds: ", end="")
    print(f"{read_before:.1f} / {read_after:.1f} GB/s\n")
    del engines  # free their memory before the kernel measurements
    if not args.skip_kernels:
        print(table(["kernel", "GB/s", "of memory read"], kernel_bandwidth(args.threads)))


if __name__ == "__main__":
    main()
