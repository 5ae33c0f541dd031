"""`moestream serve` under concurrent clients (issue 44): aggregate generated tokens/s, p50/p95 request
latency and p50 time to first token at 1, 4, 8 and 16 concurrent clients, in five modes (--modes):

    resident     moestream serve MODEL --max-batch 8 (continuous batching; --max-batch sets it)
    ram          the same under --ram sized so that its expert cache holds a quarter of the routed experts
    batch1       moestream serve MODEL --max-batch 1: one request at a time, the behaviour before batching
    batch1-ram   --max-batch 1 under --ram holding a quarter of the experts
    llama        llama.cpp's llama-server --parallel C --cont-batching on the same GGUF, the same threads

    python3 benchmarks/serve.py [--model PATH] [--llama-server PATH] [--threads 2] [--clients 1,4,8,16] \\
        [--requests 4] [--max-tokens 32] [--max-batch 8] [--ctx 512] [--modes resident,ram,...] [--json FILE]
    python3 benchmarks/serve.py --quick      # smoke run: the demo model, 1 and 2 clients, 2 requests, 8 tokens

The default model is gguf_source.py's: decode.py's synthetic Qwen3-30B-A3B-width qwen3_moe at 8 layers as
llama.cpp's Q4_K_M GGUF, made once under /tmp/moestream-bench by gguf_source.ensure_models (it needs
llama-cpp-python and the llama.cpp tree of its sdist, --llama-cpp; default: the tree unpacked under
/work/llama-build/src); moestream serves that GGUF itself, so both servers read the same file. When
`moestream serve --help` has no --max-batch (before continuous batching), the batch1 modes are left out
and the others run one request at a time.

The --ram budget is planned as the server plans it (runtime.streaming.plan_budget for --ctx tokens and
--max-batch sequences): the whole trunk pinned, KV for every sequence, scratch, and a quarter of the
experts as cache slots; so the batched and the one-at-a-time rows get different --ram (KV for 8 sequences
or for 1) and the same expert cache. The header prints each budget.

llama-server, built from llama-cpp-python's sdist outside the repo (nothing else needs it):

    tar xzf llama_cpp_python-0.3.36.tar.gz -C /work/llama-build/src     # pip download --no-binary :all:
    cmake -S /work/llama-build/src/llama_cpp_python-0.3.36/vendor/llama.cpp -B /work/llama-build/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
    nice -n 19 cmake --build /work/llama-build/build --target llama-server -j2     # 10 min, 2 cores

found there (build/bin) or on PATH, or given as --llama-server; without it, or for a model llama.cpp cannot
read (the demo), its rows are left out with a note. It runs with --no-repack (weights left in the mmap) as
llama.cpp runs in gguf_source.py: its default repacked Q4_K layout died of SIGSEGV on a CPU with AMX, as this
one has (on Ice Lake it decoded ~10% faster and prefilled ~30% slower: NOTES.md); --llama-repack runs the
default instead. It gets --parallel C slots of --ctx tokens each (--ctx-size C x --ctx), and is started anew for
each C (its slots are fixed at start); its prompt cache stays on, as a user would run it.

Load: for each concurrency C, C clients (each its own openai.AsyncOpenAI) send --requests requests each,
back to back: fixed distinct prompts (new to the server at each C, the same at that C in every mode),
alternately chat completions and completions, greedy (temperature 0), max_tokens fixed, all streamed
(stream_options include_usage: the usage chunk counts the tokens). A request's latency runs from sending
it to the end of its stream, its time to first token (TTFT) to the first chunk carrying text. Aggregate
tokens/s is every generated token of the C run over the run's wall time. A moestream server is started
once per mode and serves every C. Each server first answers one short request, not measured, so that its
weights are mapped and warm. The same prompt gets the same greedy answer in every moestream mode (batching
does not change outputs): the check is printed. The clients run on the machine's cores too: their CPU share
is a column.

A full run (5 modes, 4 concurrencies, 4 requests a client: 116 requests a mode, 32 tokens, 2 threads) should
take 25-35 minutes on a 2-core machine (an estimate from the prefill and decode speeds in NOTES.md, not yet
measured: most of it is the --ram and --max-batch 1 rows, whose every request prefills ~150-200 tokens
alone), plus about 20 minutes the first time to make the model (gguf_source.py: synth, convert, quantize,
pack); run it alone (neighbours slow every row several-fold: NOTES.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, machine, table

LLAMA_BUILD = Path("/work/llama-build")
STARTUP_SECONDS = 900.0  # a model loaded from a cold disk, or a GGUF dequantized at load, takes minutes
REQUEST_TIMEOUT = 1800.0
WARM_UP_PROMPT = 10**6  # the warm-up request's prompt index: beyond any measured request's
MODES = ("resident", "ram", "batch1", "batch1-ram", "llama")

# ---- prompts ----------------------------------------------------------------------------------------------

WORDS = (
    "river mountain engine lantern harbor garden signal meadow copper winter orchard compass shadow "
    "thunder violet marble canyon beacon feather glacier velvet anchor prism willow ember falcon cedar "
    "harvest comet silver quarry ribbon tunnel meadowlark summit ocean island crystal forest desert"
).split()


def prompt(i: int) -> str:
    """The i-th prompt: fixed, distinct from every other, 20-odd words."""
    rng = np.random.default_rng(1000 + i)
    words = " ".join(WORDS[int(k)] for k in rng.integers(0, len(WORDS), 16))
    return f"Request {i}. Write a short story about {words}."


# ---- servers ----------------------------------------------------------------------------------------------


@dataclass
class Server:
    """A server process, its URL (…/v1) and the model id its clients name."""

    proc: subprocess.Popen
    url: str
    model: str
    log: Path
    lines: list[str] = field(default_factory=list)

    def peak_rss(self) -> int:
        """VmHWM of the server process, bytes (0 once it is gone)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
        except (OSError, StopIteration):
            return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _tail(server_log: Path, lines: list[str]) -> str:
    """The server's last line of output, and where the rest is."""
    text = server_log.read_text(errors="replace").strip().splitlines() if server_log.exists() else []
    last = (text or lines or ["(no output)"])[-1]
    return f"{last[-300:]} (log: {server_log})"


def _exit_text(code: int) -> str:
    """How a process ended: "killed by SIGSEGV" (llama.cpp's repacked weights on an AMX CPU) or "exited with N"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with {code}"


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path) -> None:
    """Until GET /health answers 200 (llama-server answers 503 while it loads); RuntimeError if the
    process dies or STARTUP_SECONDS pass."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{_exit_text(proc.returncode)}: {_tail(log, [])}")
        if _get(base + "/health")[0] == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"not healthy after {STARTUP_SECONDS:.0f} s")


def _model_id(base: str) -> str:
    status, body = _get(base + "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}")
    return str(json.loads(body)["data"][0]["id"])


def serve_help() -> str:
    p = subprocess.run([sys.executable, "-m", "moestream", "serve", "--help"], capture_output=True, text=True)
    return p.stdout


def start_moestream(model: str, args: argparse.Namespace, ram: str | None, max_batch: int | None, log: Path) -> Server:
    """`moestream serve MODEL --port 0 ...`; the port is the one it prints."""
    cmd = [sys.executable, "-m", "moestream", "serve", model, "--port", "0", "--threads", str(args.threads)]
    cmd += ["--ctx", str(args.ctx), "--max-tokens", str(args.max_tokens)]
    if ram is not None:
        cmd += ["--ram", ram]
    if max_batch is not None:
        cmd += ["--max-batch", str(max_batch)]
    err = open(log, "w")  # the child writes to it until it stops
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    err.close()
    assert proc.stdout is not None
    found: list[str] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # read to the end, so that the server never blocks on a full pipe
            lines.append(line.rstrip())
            m = re.search(r"on (http://\S+)/v1\b", line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while not found:
        if proc.poll() is not None:
            raise RuntimeError(f"{_exit_text(proc.returncode)}: {_tail(log, lines)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"printed no URL in {STARTUP_SECONDS:.0f} s")
        time.sleep(0.2)
    base = found[0]
    _wait_healthy(proc, base, log)
    return Server(proc, base + "/v1", _model_id(base), log, lines)


def free_port() -> int:
    """A port free now (llama-server does not report the one it bound for --port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama(binary: Path, gguf: Path, args: argparse.Namespace, parallel: int, log: Path) -> Server:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--threads", str(args.threads), "--threads-batch", str(args.threads)]
    # --ctx tokens for each slot: llama-server splits --ctx-size among its slots
    cmd += ["--parallel", str(parallel), "--cont-batching", "--ctx-size", str(parallel * args.ctx)]
    cmd += ["--no-webui", "--fit", "off"] + ([] if args.llama_repack else ["--no-repack"])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log)
        return Server(proc, base + "/v1", _model_id(base), log)
    except RuntimeError:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise


def llama_version(binary: Path | None) -> str:
    """The binary and the version line it prints (llama.cpp's build and commit)."""
    if binary is None:
        return "none"
    p = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    line = next((x for x in (p.stdout + p.stderr).splitlines() if x.startswith("version")), "version unknown")
    return f"{binary} ({line})"


def find_llama_server(given: Path | None) -> Path | None:
    if given is not None:
        return given if given.is_file() and os.access(given, os.X_OK) else None
    for p in sorted(LLAMA_BUILD.glob("**/bin/llama-server")):
        if os.access(p, os.X_OK):
            return p
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


# ---- the budget -------------------------------------------------------------------------------------------

QUARTER = """
import json, sys
import moestream
from moestream.runtime.streaming import layout, plan_budget
source, ctx, sequences = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = moestream.load(source, threads=1, preload=False, progress=False)
lay = layout(model, model.store)
n = len(lay.templates)
want = max(lay.top_k + 1, -(-n // 4))
kw = {"sequences": sequences} if sequences > 1 else {}  # a moestream before batching plans for one
# with room for every expert the whole trunk is pinned and nothing streams: the fixed part of the budget
big = plan_budget(model, lay, 1 << 50, ctx, ctx, **kw)
fixed = big.kv_bytes + big.scratch_bytes + big.derived_bytes + big.pinned_bytes + big.stream_bytes
budget = fixed + want * lay.slot_bytes
plan = plan_budget(model, lay, budget, ctx, ctx, **kw)
print(json.dumps({"budget": budget, "slots": plan.expert_slots, "experts": n, "want": want,
                  "describe": plan.describe()}))
"""


def quarter_budget(model: str, ctx: int, sequences: int) -> dict[str, Any]:
    """The --ram (bytes) whose plan, as `serve --ctx ctx --max-batch sequences` makes it, gives the expert
    cache a quarter of the model's routed experts (planner.make_plan: the trunk pinned whole, KV for each
    sequence, scratch; what is left is expert slots)."""
    p = subprocess.run([sys.executable, "-c", QUARTER, model, str(ctx), str(sequences)], capture_output=True, text=True)
    if p.returncode != 0:
        err = p.stderr.strip().splitlines()
        raise RuntimeError(f"planning the quarter budget failed: {err[-1] if err else p.returncode}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


# ---- load ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    index: int  # the prompt's index
    kind: str  # "chat" or "completion"
    start: float
    end: float
    ttft: float | None
    tokens: int
    text: str
    error: str = ""


async def one_request(client: Any, model: str, i: int, max_tokens: int) -> Result:
    kind = "chat" if i % 2 == 0 else "completion"
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    chunks = 0
    usage: int | None = None
    try:
        if kind == "chat":
            messages = [{"role": "user", "content": prompt(i)}]
            stream = await client.chat.completions.create(messages=messages, **common)
        else:
            stream = await client.completions.create(prompt=prompt(i), **common)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text = choice.delta.content if kind == "chat" else choice.text
                if text:
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(text)
                    chunks += 1
    except Exception as e:  # one failed request is a row's note, not the end of the run
        return Result(i, kind, t0, time.perf_counter(), first, 0, "", f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    ttft = None if first is None else first - t0
    return Result(i, kind, t0, end, ttft, usage if usage is not None else chunks, "".join(pieces))


async def drive(url: str, model: str, clients: int, requests: int, max_tokens: int, first: int) -> list[Result]:
    """clients concurrent clients, each sending `requests` requests back to back; client c's r-th request
    uses prompt first + c * requests + r."""
    from openai import AsyncOpenAI

    async def client_loop(c: int) -> list[Result]:
        client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT)
        try:
            return [await one_request(client, model, first + c * requests + r, max_tokens) for r in range(requests)]
        finally:
            await client.close()

    done = await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return [r for rs in done for r in rs]


def summarize(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    out: dict[str, Any] = {"requests": len(results), "failed": len(results) - len(ok)}
    if not ok:
        out["error"] = results[0].error if results else "no requests"
        return out
    wall = max(r.end for r in ok) - min(r.start for r in ok)
    lat = np.array([r.end - r.start for r in ok])
    ttft = np.array([r.ttft for r in ok if r.ttft is not None])
    tokens = sum(r.tokens for r in ok)
    out.update(
        wall_s=wall,
        tokens=tokens,
        tok_s=tokens / wall,
        latency_p50=float(np.percentile(lat, 50)),
        latency_p95=float(np.percentile(lat, 95)),
        ttft_p50=float(np.percentile(ttft, 50)) if len(ttft) else None,
        tokens_per_request=tokens / len(ok),
    )
    if out["failed"]:
        out["first_error"] = next(r.error for r in results if r.error)
    return out


def metrics(url: str) -> dict[str, float]:
    """The moestream_* samples of /metrics (base URL without /v1); {} when the server has none."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(url.removesuffix("/v1") + "/metrics")
    if status != 200:
        return {}
    return {
        s.name: float(s.value)
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
        if s.name.startswith("moestream_") and not s.labels
    }


def run_load(server: Server, clients: int, args: argparse.Namespace) -> tuple[dict[str, Any], list[Result]]:
    """The load of `clients` clients. Their prompts are new to the server at every concurrency (a server
    that caches prompt prefixes, as llama-server does, would otherwise skip a repeated prompt's prefill)
    and the same at that concurrency in every mode."""
    first = args.requests * sum(c for c in args.concurrencies if c < clients)
    before = metrics(server.url)
    cpu = time.process_time()
    results = asyncio.run(drive(server.url, server.model, clients, args.requests, args.max_tokens, first))
    cpu = time.process_time() - cpu
    row = summarize(results)
    if row.get("wall_s"):
        # the clients run on the same cores as the server: what they took is what the server could not use
        row["client_cpu"] = cpu / row["wall_s"]
    after = metrics(server.url)

    def delta(name: str) -> float:
        return after.get(f"moestream_{name}_total", 0.0) - before.get(f"moestream_{name}_total", 0.0)

    requests = delta("expert_cache_requests")
    if requests and row.get("tokens"):
        read = delta("read_bytes")
        row["hit_rate"] = delta("expert_cache_hits") / requests
        # prefill reads included: the expert traffic of the whole run over the tokens it generated
        row["read_per_token"] = read / row["tokens"]
    return row, results


def warm_up(server: Server) -> None:
    """One short request before measuring: the weights' pages mapped, the caches warm (a prompt no
    measured request uses)."""
    asyncio.run(drive(server.url, server.model, 1, 1, 4, WARM_UP_PROMPT))


# ---- models -----------------------------------------------------------------------------------------------


def default_llama_cpp() -> Path:
    """The llama.cpp tree (converter) of llama-cpp-python's sdist: unpacked beside the llama-server build,
    else where gguf_source.py looks."""
    from gguf_source import DEFAULT_LLAMA_CPP

    found = sorted(LLAMA_BUILD.glob("src/llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else DEFAULT_LLAMA_CPP


def default_model(args: argparse.Namespace) -> Path:
    """gguf_source.py's 8-layer Qwen3-30B-A3B-width Q4_K_M GGUF, made once if missing."""
    from gguf_source import ensure_models

    return ensure_models(args)[2]


# ---- main -------------------------------------------------------------------------------------------------


@dataclass
class Mode:
    name: str  # a MODES entry
    label: str
    engine: str  # "moestream" or "llama.cpp"
    ram: str | None = None
    max_batch: int | None = None
    note: str = ""
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # clients -> summary
    answers: dict[int, dict[int, str]] = field(default_factory=dict)  # clients -> prompt index -> text
    peak_rss: int = 0
    error: str = ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="what moestream serves (default: gguf_source.py's GGUF)")
    ap.add_argument("--gguf", type=Path, default=None, help="what llama-server serves (default: --model if a GGUF)")
    ap.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help=f"llama-server binary (default: under {LLAMA_BUILD}, else on PATH)",
    )
    ap.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp source tree, to make the default GGUF")
    ap.add_argument("--llama-repack", action="store_true", help="llama-server with its default repacked weights")
    ap.add_argument("--layers", type=int, default=8, help="layers of the default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,8,16", help="concurrencies, comma-separated")
    ap.add_argument("--requests", type=int, default=4, help="requests each client sends, back to back")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    ap.add_argument("--max-batch", type=int, default=8, help="moestream's --max-batch in the batched modes")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per request (prompt + reply) each server holds")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: demo model, 1 and 2 clients, 2 requests, 8 tokens")
    ap.add_argument("--json", type=Path, default=None, help="write every row's numbers here")
    if "--quick" in sys.argv[1:]:  # the smoke run's values as defaults: what is given still wins
        ap.set_defaults(model="demo", clients="1,2", requests=2, max_tokens=8, max_batch=2)
    args = ap.parse_args()
    try:
        concurrencies = list(dict.fromkeys(int(c) for c in args.clients.split(",") if c.strip()))
    except ValueError:
        ap.error(f"--clients: give numbers like 1,4,8,16, not {args.clients!r}")
    args.concurrencies = concurrencies
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not concurrencies or min(concurrencies) < 1 or args.requests < 1 or args.max_tokens < 1 or args.max_batch < 1:
        ap.error("--clients, --requests, --max-tokens and --max-batch must be positive")
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: directory {args.json.parent} does not exist")

    t_start = time.monotonic()
    if args.model is None:
        args.llama_cpp = args.llama_cpp or default_llama_cpp()
        args.model = str(default_model(args))
    gguf = args.gguf or (Path(args.model) if args.model.endswith(".gguf") else None)
    binary = find_llama_server(args.llama_server)
    batching = "--max-batch" in serve_help()

    plan: list[Mode] = []
    budgets: dict[int, dict[str, Any]] = {}

    def budget(sequences: int) -> dict[str, Any]:
        if sequences not in budgets:
            budgets[sequences] = quarter_budget(args.model, args.ctx, sequences)
        return budgets[sequences]

    batch = args.max_batch if batching else None
    for m in modes:
        if m in ("resident", "ram") and not batching:
            label = f"moestream {m} (serve has no --max-batch: one at a time)"
        else:
            label = {
                "resident": f"moestream resident, --max-batch {args.max_batch}",
                "ram": f"moestream --ram 1/4 experts, --max-batch {args.max_batch}",
                "batch1": "moestream resident, --max-batch 1",
                "batch1-ram": "moestream --ram 1/4 experts, --max-batch 1",
                "llama": "llama-server --parallel C --cont-batching",
            }[m]
        mode = Mode(m, label, "llama.cpp" if m == "llama" else "moestream")
        if m in ("batch1", "batch1-ram"):
            if not batching:
                continue  # the resident and ram rows are already one at a time
            mode.max_batch = 1
        elif m != "llama":
            mode.max_batch = batch
        if m in ("ram", "batch1-ram"):
            try:
                b = budget(mode.max_batch or 1)
                mode.ram = str(b["budget"])
                mode.note = (
                    f"--ram {b['budget'] / 2**20:.0f}M: {b['slots']}/{b['experts']} experts in the cache "
                    f"(--ctx {args.ctx}, KV for {mode.max_batch or 1})"
                )
            except RuntimeError as e:
                mode.error = str(e)
        if m == "llama":
            if binary is None:
                mode.error = "no llama-server (give --llama-server, or build it: see the docstring)"
            elif gguf is None:
                mode.error = f"{args.model} is not a GGUF (give --gguf)"
            else:
                repack = "repacked weights" if args.llama_repack else "--no-repack"
                mode.note = f"{binary} on {gguf}, {repack}, --ctx-size C x {args.ctx}"
        plan.append(mode)

    print(f"model: {args.model}" + (f"; llama-server serves {gguf}" if gguf else ""))
    print(
        f"threads {args.threads}; clients {args.clients}, {args.requests} requests each, back to back; "
        f"max_tokens {args.max_tokens}, greedy, streamed, chat and completions alternately; --ctx {args.ctx}"
    )
    if not batching:
        print("moestream serve has no --max-batch here: its rows serve one request at a time")
    for mode in plan:
        if mode.note:
            print(f"  {mode.label}: {mode.note}")
    print()

    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "moestream-serve-bench"
    logs.mkdir(exist_ok=True)
    for mode in plan:
        if mode.error:
            continue
        if mode.engine == "moestream":
            print(f"  {mode.label} ...", file=sys.stderr, flush=True)
            try:
                server = start_moestream(args.model, args, mode.ram, mode.max_batch, logs / f"{mode.name}.log")
            except RuntimeError as e:
                mode.error = f"did not start: {e}"
                continue
            try:
                warm_up(server)
                for c in concurrencies:
                    print(f"    {c} clients ...", file=sys.stderr, flush=True)
                    mode.rows[c], results = run_load(server, c, args)
                    mode.answers[c] = {r.index: r.text for r in results if not r.error}
                mode.peak_rss = server.peak_rss()
            finally:
                server.stop()
        else:
            assert binary is not None and gguf is not None
            for c in concurrencies:
                print(f"  llama-server --parallel {c} ...", file=sys.stderr, flush=True)
                try:
                    server = start_llama(binary, gguf, args, c, logs / f"llama-{c}.log")
                except RuntimeError as e:
                    mode.rows[c] = {"error": f"did not start: {e}"}
                    continue
                try:
                    warm_up(server)
                    mode.rows[c], _ = run_load(server, c, args)
                    mode.peak_rss = max(mode.peak_rss, server.peak_rss())
                finally:
                    server.stop()

    report(plan, concurrencies, args, batching, time.monotonic() - t_start, binary)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def report(
    plan: list[Mode], concurrencies: list[int], args: argparse.Namespace, batching: bool, seconds: float, binary: Any
) -> None:
    rows: list[list[object]] = []
    notes: list[str] = []  # why a row is missing: below the table, so that the columns stay narrow
    for mode in plan:
        if mode.error:
            notes.append(f"{mode.label}: left out: {mode.error}")
            continue
        for c in concurrencies:
            r = mode.rows.get(c, {"error": "not run"})
            if "error" in r:
                rows.append([mode.label, c, "failed", "", "", "", "", "", "", ""])
                notes.append(f"{mode.label}, {c} clients: {r['error']}")
                continue
            if r.get("failed"):
                notes.append(f"{mode.label}, {c} clients: {r['failed']} requests failed, the first: {r['first_error']}")
            gb = r.get("read_per_token")
            rows.append(
                [
                    mode.label,
                    c,
                    r["tok_s"],
                    r["latency_p50"],
                    r["latency_p95"],
                    _fmt(r["ttft_p50"], ".3f"),
                    f"{r['tokens_per_request']:.1f}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
                    "" if gb is None else f"{gb / 1e6:.1f}",
                    "" if "hit_rate" not in r else f"{r['hit_rate']:.2f}",
                    f"{100 * r.get('client_cpu', 0):.0f}%",
                ]
            )
    headers = ["server", "clients", "tok/s", "p50 latency s", "p95 latency s", "p50 TTFT s", "tokens/req"]
    print(table([*headers, "MB read/token", "hit rate", "client CPU"], rows))
    for note in notes:
        print(f"  {note}")

    by = {m.name: m for m in plan if not m.error}
    ratios: list[list[object]] = []
    for num, den, what in (
        ("resident", "batch1", "batched / one at a time, resident"),
        ("ram", "batch1-ram", "batched / one at a time, --ram 1/4"),
        ("resident", "llama", "moestream resident / llama-server"),
    ):
        if num in by and den in by:
            cells: list[object] = [f"tok/s, {what}"]
            for c in concurrencies:
                a, b = by[num].rows.get(c, {}), by[den].rows.get(c, {})
                cells.append(f"{a['tok_s'] / b['tok_s']:.2f}" if a.get("tok_s") and b.get("tok_s") else "n/a")
            ratios.append(cells)
    if ratios:
        print()
        print(table(["ratio", *[f"{c} clients" for c in concurrencies]], ratios))

    # batching must not change an answer: every moestream mode against the first one, prompt by prompt
    ours = [m for m in plan if m.engine == "moestream" and m.answers]
    if len(ours) > 1:
        ref = ours[0]
        checks = []
        for m in ours[1:]:
            same = total = 0
            for c, answers in m.answers.items():
                for i, text in answers.items():
                    if i in ref.answers.get(c, {}):
                        total += 1
                        same += text == ref.answers[c][i]
            checks.append(f"{m.label}: {same}/{total}")
        print(f"\ngreedy answers equal to {ref.label}'s: " + "; ".join(checks))
    rss = [f"{m.label} {m.peak_rss / 2**30:.2f} GiB" for m in plan if m.peak_rss]
    if rss:
        print("peak RSS (VmHWM) of the server: " + "; ".join(rss))
    print(
        "tok/s: generated tokens of all clients over the run's wall time; latency: request sent to end of stream; "
        "TTFT: to the first chunk with text; MB read/token: expert bytes read (prefill included) per generated token; "
        "client CPU: this process's CPU time (the openai clients) over the wall time, taken from the same cores"
    )
    print(f"machine: {machine()}\ncommit: {commit()}; llama-server: {llama_version(binary)}")
    print(f"took {seconds / 60:.1f} min")
    if args.json is not None:
        out = {
            "machine": machine(),
            "commit": commit(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "max_batch_supported": batching,
            "llama_server": llama_version(binary) if binary else None,
            "modes": [
                {
                    "name": m.name,
                    "label": m.label,
                    "ram": m.ram,
                    "max_batch": m.max_batch,
                    "note": m.note,
                    "error": m.error,
                    "peak_rss": m.peak_rss,
                    "rows": {str(c): r for c, r in m.rows.items()},
                }
                for m in plan
            ],
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
