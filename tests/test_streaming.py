"""Running within a RAM budget (runtime/): a packed model at least 4x the budget gives byte-identical
ids and logits at every budget (the minimum included) and at 1 and 2 threads, equal to the resident
run; peak RSS stays within the budget plus the stated overhead; a failed expert read ends the run with
exit code 4 and no token after the fault; the planner refuses a budget below its minimum."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moestream.errors import InputError
from moestream.formats.packed import pack
from moestream.runtime.planner import parse_size
from moestream.runtime.policies import LRU, LFUAging, belady_hits, replay
from moestream.synth import synth

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
PROMPT = "3,14,15,92,65,35,89,79,32,38"
GEN = 8

MODELS = {
    # MXFP4 experts kept as the checkpoint has them; experts dominate the store
    "kimi_k3": dict(
        num_hidden_layers=4,
        num_experts=128,
        num_experts_per_token=4,
        routed_expert_hidden_size=256,
        moe_intermediate_size=512,
    ),
    # bf16 experts requantized to q8_0 by the pack
    "deepseek_v3": dict(num_hidden_layers=4, n_routed_experts=128, moe_intermediate_size=512, hidden_size=256),
}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream", *args], capture_output=True, text=True, env=env or ENV, timeout=600
    )


_sources: dict[str, Path] = {}


def checkpoint_of(arch: str, tmp_path_factory) -> Path:
    if arch not in _sources:
        root = tmp_path_factory.mktemp(f"stream-{arch}")
        _sources[arch] = synth(arch, root / "src", MODELS[arch], seed=11, progress=False)
    return _sources[arch]


def packed_of(arch: str, tmp_path_factory) -> Path:
    key = f"{arch}-packed"
    if key not in _sources:
        src = checkpoint_of(arch, tmp_path_factory)
        experts = "keep" if arch == "kimi_k3" else "q8_0"
        _sources[key] = pack(src, src.parent / "packed", experts=experts, trunk="keep", progress=False)
    return _sources[key]


@pytest.fixture(scope="module", params=sorted(MODELS))
def packed(request, tmp_path_factory) -> Path:
    return packed_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory) -> Path:
    """The synthetic checkpoint as it is (safetensors shards): --ram reads its experts from the shards."""
    return checkpoint_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[(a, k) for a in sorted(MODELS) for k in ("packed", "checkpoint")], ids=str)
def store(request, tmp_path_factory) -> Path:
    arch, kind = request.param
    return packed_of(arch, tmp_path_factory) if kind == "packed" else checkpoint_of(arch, tmp_path_factory)


def run(path: Path, tmp: Path, tag: str, *extra: str) -> tuple[list[int], bytes, dict]:
    logits, report = tmp / f"{tag}.npy", tmp / f"{tag}.json"
    p = cli(
        "run", str(path), "--ids", PROMPT, "--gen", str(GEN), "--json", "--ignore-eos",
        "--dump-logits", str(logits), "--report", str(report), *extra,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["generated_ids"], logits.read_bytes(), json.loads(report.read_text())


_memo: dict[tuple[Path, str], object] = {}


def resident(path: Path, tmp: Path) -> tuple[list[int], bytes, dict]:
    key = (path, "resident")
    if key not in _memo:
        _memo[key] = run(path, tmp, "resident", "--threads", "2")
    return _memo[key]  # type: ignore[return-value]


def minimum_budget(path: Path) -> int:
    key = (path, "minimum")
    if key not in _memo:
        _memo[key] = _minimum_budget(path)
    return _memo[key]  # type: ignore[return-value]


def _minimum_budget(path: Path) -> int:
    p = cli("run", str(path), "--ids", PROMPT, "--gen", str(GEN), "--json", "--ram", "1M")
    assert p.returncode == 2 and p.stdout == ""
    m = re.search(r"needs at least (\d+) MB", p.stderr)
    assert m, p.stderr
    return int(m.group(1)) + 1


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in [*path.glob("*.bin"), *path.glob("*.safetensors")])


def test_budgets_and_threads_give_identical_output(store, tmp_path):
    packed = store
    ids, logits, _ = resident(packed, tmp_path)
    low = minimum_budget(packed)
    size = store_bytes(packed)
    budgets = [low, (low + size // (4 << 20)) // 2 + 1, 4 * size >> 20]
    assert budgets[0] << 20 <= size // 4 and budgets[1] << 20 <= size // 4, (budgets, size)
    hit_rates = []
    for mb in budgets:
        for threads in ("1", "2") if mb == low else ("2",):
            got_ids, got_logits, rep = run(packed, tmp_path, f"{mb}-{threads}", "--ram", f"{mb}M", "--threads", threads)
            assert got_ids == ids, (mb, threads)
            assert got_logits == logits, (mb, threads)
            plan = rep["plan"]
            assert plan["used"] <= plan["budget"] == mb << 20
            assert plan["derived_bytes"] == 0  # MLA decode multiplies by kv_b_proj itself: no f32 copies
            assert rep["peak_rss"] <= plan["overhead"] + plan["budget"], (rep["peak_rss"], plan)
            assert rep["streaming"]["expert_requests"] > 0
            assert 0 <= rep["streaming"]["read_seconds_hidden"] <= rep["streaming"]["read_seconds"]
        hit_rates.append(rep["streaming"]["hit_rate"])
    assert hit_rates[0] < hit_rates[-1]  # more memory, more hits (the largest budget holds every expert)
    assert rep["streaming"]["bytes_read"] <= size


def test_no_prefetch_and_lru_change_nothing_but_speed(packed, tmp_path):
    ids, logits, _ = resident(packed, tmp_path)
    low = minimum_budget(packed)
    for extra in (["--no-prefetch"], ["--cache-policy", "lru"]):
        got_ids, got_logits, rep = run(packed, tmp_path, extra[-1], "--ram", f"{low + 2}M", *extra)
        assert (got_ids, got_logits) == (ids, logits)
    assert rep["streaming"]["prefetch_issued"] > 0


def test_failed_read_exits_4_without_a_token_after_it(store, tmp_path):
    packed = store
    low = minimum_budget(packed)
    _, _, rep = run(packed, tmp_path, "ok", "--ram", f"{low}M")
    reads = rep["streaming"]["expert_reads"]
    base = ["run", str(packed), "--ids", PROMPT, "--gen", str(GEN), "--ignore-eos", "--ram", f"{low}M"]
    fault = cli(*base, "--json", env={**ENV, "MOESTREAM_FAIL_READ": str(reads - 2)})
    assert fault.returncode == 4, fault.stderr
    assert fault.stdout == ""  # --json prints all or nothing
    line = fault.stderr.strip().splitlines()[-1]
    read_from = "experts.bin" if packed.name == "packed" else ".safetensors"
    assert line.startswith("moestream: error:") and read_from in line and "offset" in line
    assert "Traceback" not in fault.stderr
    # streamed text: what was printed is the start of the good run, and stops before the failed token
    text_ok = cli(*base)
    text_fault = cli(*base, env={**ENV, "MOESTREAM_FAIL_READ": str(reads - 2)})
    assert text_fault.returncode == 4
    assert text_ok.stdout.startswith(text_fault.stdout) and len(text_fault.stdout) < len(text_ok.stdout)


def test_budget_below_minimum_is_refused(packed):
    p = cli("run", str(packed), "--ids", PROMPT, "--ram", "2M")
    assert p.returncode == 2 and p.stdout == ""
    assert "needs at least" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_checkpoint_experts_are_read_from_their_own_tensors(checkpoint, tmp_path):
    """Each expert of the checkpoint is one read of the enclosing aligned range of its shard (its matrices
    lie together there), placed in the slot so that each matrix sits inside the bytes read for it."""
    import moestream
    from moestream.runtime.streaming import layout

    model = moestream.load(checkpoint, preload=False)
    lay = layout(model, model.store)
    n_experts = sum(len(moe.experts) for _, moe in lay.layers)
    assert len(lay.templates) == n_experts
    assert {len(t.ranges) for t in lay.templates.values()} == {1}
    assert all(p.suffix == ".safetensors" for p in lay.expert_files)
    for t in lay.templates.values():
        r = t.ranges[0]
        assert r.offset % 4096 == 0 and r.nbytes <= t.nbytes <= lay.slot_bytes
        for parts in t.parts.values():
            assert all(r.slot_offset <= p.offset and p.offset + p.nbytes <= r.slot_offset + r.nbytes for p in parts)


def test_load_with_ram_is_the_run_with_ram(store, tmp_path):
    """moestream.load(X, ram=B) is --ram B: the same plan, the same bytes out as the resident run, and the
    same report fields; a budget below the minimum is the same refusal."""
    import moestream

    ids, logits, _ = resident(store, tmp_path)
    budget = minimum_budget(store) + 2
    prompt = [int(x) for x in PROMPT.split(",")]
    with moestream.load(str(store), ram=f"{budget}M", context=len(prompt) + GEN, threads=1) as model:
        assert model.streaming is not None
        out: list[np.ndarray] = []
        got = list(model.generate(prompt, GEN, stop_at_eos=False, logits_out=out))
        report = model.report()
    assert got == ids
    assert np.stack(out).astype(np.float32).tobytes() == np.load(io.BytesIO(logits)).tobytes()
    _, _, cli_report = run(store, tmp_path, "budget", "--ram", f"{budget}M", "--threads", "1")
    assert set(report["streaming"]) == set(cli_report["streaming"]) and set(report["plan"]) == set(cli_report["plan"])
    assert report["streaming"]["expert_requests"] > 0 and report["streaming"]["bytes_read"] > 0
    with pytest.raises(InputError, match="needs at least"):
        moestream.load(str(store), ram="1M")


def test_the_demo_within_a_budget_is_the_demo():
    import moestream

    ids = list(range(5, 40, 3))
    with moestream.load("demo", threads=2) as model:
        want = model.logits(ids).tobytes()
    for ram in ("24M", "40M"):
        with moestream.load("demo", ram=ram, context=len(ids), threads=1) as model:
            assert model.streaming is not None and model.logits(ids).tobytes() == want, ram


def test_generation_after_generation_in_a_small_cache():
    """Wrong prefetches left at the end of one generation must not keep their slots: with a handful of
    slots, every later generation (a server's next request) runs, with the resident run's tokens."""
    import moestream

    with moestream.load("demo", threads=1) as model:
        prompts = [model.tokenize(t) for t in ("import os", "def f(x):", "class A:", "import os")]
        want = [list(model.generate(p, 8)) for p in prompts]
    with moestream.load("demo", ram="40M", context=256, threads=1) as model:
        assert model.streaming is not None and model.streaming.plan.expert_slots < 8
        assert [list(model.generate(p, 8)) for p in prompts] == want


def test_trace_replays_and_lfu_beats_lru(packed, tmp_path):
    trace_file = tmp_path / "trace.jsonl"
    p = cli("run", str(packed), "--ids", PROMPT, "--gen", "24", "--json", "--ignore-eos", "--trace", str(trace_file))
    assert p.returncode == 0, p.stderr
    records = [json.loads(x) for x in trace_file.read_text().splitlines()]
    assert records and all(set(r) == {"layer", "experts"} for r in records)
    keys = [(r["layer"], e) for r in records for e in r["experts"]]
    slots = len(set(keys)) // 3
    lru, lfu, opt = replay(LRU(), keys, slots), replay(LFUAging(), keys, slots), belady_hits(keys, slots)
    assert lru <= opt and lfu <= opt


def test_policies_on_a_skewed_cyclic_trace():
    """Four layers of 16 experts, a few popular per layer: LRU thrashes on the cycle, LFU keeps the
    popular ones; Belady bounds both."""
    rng = np.random.default_rng(0)
    p = np.array([8.0] * 3 + [1.0] * 13)
    p /= p.sum()
    keys = [(layer, int(e)) for _ in range(300) for layer in range(4) for e in rng.choice(16, 2, replace=False, p=p)]
    slots = 16
    lru, lfu, opt = replay(LRU(), keys, slots), replay(LFUAging(), keys, slots), belady_hits(keys, slots)
    assert lru < lfu <= opt


def test_parse_size():
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    with pytest.raises(Exception, match="cannot read"):
        parse_size("lots")
    for huge in ("9" * 400, "2000T"):  # 400 digits overflowed int(float) before
        with pytest.raises(InputError, match="more than 1 PiB"):
            parse_size(huge)


def test_a_large_lm_head_streams_in_chunks_with_identical_output(tmp_path):
    """A vocabulary much larger than a layer: at the minimum budget the head is not pinned and is read
    in row chunks no larger than a layer, and nothing the model computes changes."""
    cfg = dict(num_hidden_layers=2, hidden_size=128, vocab_size=32768, num_experts=16, moe_intermediate_size=64,
               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
    src = synth("qwen3_moe", tmp_path / "src", cfg, seed=5, progress=False)
    packed = pack(src, tmp_path / "packed", experts="q8_0", trunk="keep", progress=False)
    ids, logits, _ = run(packed, tmp_path, "resident", "--threads", "2")
    low = _minimum_budget(packed)
    got_ids, got_logits, rep = run(packed, tmp_path, "low", "--ram", f"{low}M", "--threads", "2")
    assert (got_ids, got_logits) == (ids, logits)
    plan = rep["plan"]
    assert "head" not in plan["pinned"]
    notes = [n for n in plan["notes"] if n.startswith("lm_head streamed in")]
    assert notes and int(notes[0].split()[3]) >= 4, plan["notes"]
    head_bytes = 32768 * 128 * 2
    assert plan["stream_bytes"] < head_bytes / 2  # the whole head is never needed at once
    assert rep["peak_rss"] <= plan["overhead"] + plan["budget"]
