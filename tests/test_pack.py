"""`moestream pack`: a packed store runs byte-identically to its checkpoint when formats are kept,
requantized matrices are exactly the numpy quantizers' output, the layout is aligned as designed, and
corruption, truncation, a full disk and an existing output are refused."""

from __future__ import annotations

import json
import shutil
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import moestream
from moestream.errors import CheckpointError, InputError
from moestream.formats import packed
from moestream.formats.checkpoint import Checkpoint
from moestream.formats.packed import ALIGN, PackedStore, pack, verify
from moestream.ordered_map import ordered_map
from moestream.quant import blocks
from moestream.synth import synth


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    # experts of width 256 so that every format fits them
    return synth(
        "kimi_k3",
        tmp_path_factory.mktemp("k3") / "m",
        {"routed_expert_hidden_size": 256, "moe_intermediate_size": 256, "hidden_size": 256},
        seed=5,
    )


def logits(path: Path, ids: list[int]) -> np.ndarray:
    return moestream.load(path, threads=2).logits(ids)


def test_keep_is_byte_identical(k3, small_case, tmp_path):
    for src in (k3, small_case.path):
        dst = pack(src, tmp_path / src.name, progress=False)
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        assert logits(dst, ids).tobytes() == logits(src, ids).tobytes()
        gen = moestream.load(dst).generate(ids, 6, stop_at_eos=False)
        assert list(gen) == list(moestream.load(src).generate(ids, 6, stop_at_eos=False))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "fp8", "q8_0", "q4_k", "q6_k", "tq1_0", "int4", "mxfp4"])
def test_requantized_matrices_are_the_quantizers_output(k3, tmp_path, fmt):
    dst = pack(k3, tmp_path / fmt, experts=fmt, trunk="q8_0", progress=False)
    store, src = PackedStore(dst), Checkpoint(k3)
    matrices, _ = packed.find_matrices(src)
    n_experts = 0
    for name, e in store.manifest["matrices"].items():
        want = e["format"]
        assert want == (fmt if packed.is_routed_expert(name) else "q8_0")
        assert not packed.is_router(name)
        ref_data, ref_scales = packed.quantize(want, packed.source_weight(src, matrices[name]).dequantize())
        w = store.matrix(name, e["rows"], e["cols"])
        assert w is not None and w.data.tobytes() == np.ascontiguousarray(ref_data).view(np.uint8).tobytes()
        if ref_scales is not None:
            assert w.scales is not None and w.scales.tobytes() == ref_scales.tobytes()
        n_experts += packed.is_routed_expert(name)
    assert n_experts == 3 * 16 * 3  # gate, up, down of 16 experts in 3 MoE layers
    out = logits(dst, [1, 2, 3])
    assert np.isfinite(out).all()


def test_layout_is_aligned_and_experts_are_one_blob(k3, tmp_path):
    dst = pack(k3, tmp_path / "p", experts="q4_k", progress=False)
    m = json.loads((dst / "manifest.json").read_text())
    for key, blob in m["expert_blobs"].items():
        assert blob["offset"] % ALIGN == 0
        layer, expert = key.split(".")
        parts = [(n, e) for n, e in m["matrices"].items() if f"layers.{layer}." in n and f".experts.{expert}." in n]
        assert sorted(n.rsplit(".", 1)[-1] for n, _ in parts) == ["w1", "w2", "w3"]
        for _, e in parts:
            end = e["scales"]["offset"] + e["scales"]["nbytes"] if e["scales"] else e["offset"] + e["nbytes"]
            assert blob["offset"] <= e["offset"] and end <= blob["offset"] + blob["nbytes"]
    # every layer's trunk tensors start a 4096-aligned group, in layer order
    starts: dict[int, int] = {}
    for n, e in [*m["tensors"].items(), *m["matrices"].items()]:
        if e["file"] == "trunk" and ".layers." in n:
            layer = int(n.split(".layers.")[1].split(".")[0])
            starts[layer] = min(starts.get(layer, 1 << 62), e["offset"])
    assert all(off % ALIGN == 0 for off in starts.values())
    assert [starts[i] for i in sorted(starts)] == sorted(starts.values())


def test_verify_reads_entries_in_place(tmp_path):
    """verify takes each CRC on the mapped bytes: its peak Python allocation stays far below the largest
    entry (copying each entry first peaked at the 8 MB embedding at least)."""
    src = synth(
        "kimi_k3",
        tmp_path / "m",
        {"routed_expert_hidden_size": 256, "moe_intermediate_size": 256, "hidden_size": 256, "vocab_size": 16384},
        seed=6,
    )
    dst = pack(src, tmp_path / "p", progress=False)
    manifest = PackedStore(dst).manifest
    largest = max(e["nbytes"] for e in (*manifest["tensors"].values(), *manifest["matrices"].values()))
    assert largest >= 16384 * 256 * 2
    for threads in (1, 2):
        tracemalloc.start()
        try:
            verify(dst, threads)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < largest / 4


def test_corruption_and_truncation_are_caught(k3, tmp_path):
    dst = pack(k3, tmp_path / "p", progress=False)
    data = bytearray((dst / "trunk.bin").read_bytes())
    data[ALIGN + 7] ^= 0xFF
    (dst / "trunk.bin").write_bytes(bytes(data))
    for threads in (1, 2):
        with pytest.raises(CheckpointError, match="does not read back"):
            verify(dst, threads)
    ex = dst / "experts.bin"
    ex.write_bytes(ex.read_bytes()[: ex.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        moestream.load(dst)


def test_no_room_and_existing_output_are_refused(k3, tmp_path, monkeypatch):
    dst = tmp_path / "p"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(InputError, match="GB free"):
        pack(k3, dst, progress=False)
    assert not dst.exists() and not list(tmp_path.iterdir())
    monkeypatch.undo()
    pack(k3, dst, progress=False)
    with pytest.raises(InputError, match="exists"):
        pack(k3, dst, progress=False)


def test_unknown_format_refused(k3, tmp_path):
    with pytest.raises(InputError, match="not a format"):
        pack(k3, tmp_path / "p", experts="q5_k", progress=False)
    assert "q4_k" in blocks.LAYOUTS


def test_report(k3, tmp_path):
    import subprocess
    import sys

    def run(*extra: str) -> str:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "moestream.cli",
                "pack",
                str(k3),
                str(tmp_path / "r"),
                "--force",
                "--report",
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, p.stderr
        return p.stdout

    kept = run()
    assert "KL(source || packed) over" in kept and "mean 0.00000, max 0.00000" in kept
    q = run("--trunk", "q8_0", "--experts", "q4_k")
    rows = {line.split()[0]: line.split() for line in q.splitlines() if line.startswith(("attention", "routed"))}
    assert rows["attention"][1] == "q8_0" and 0.001 < float(rows["attention"][2]) < 0.01
    assert rows["routed"][2] == "q4_k" and 0.01 < float(rows["routed"][3]) < 0.2
    mean_kl = float(q.split("mean ")[1].split(",")[0])
    assert mean_kl > 0


def test_q4_k_m_mix_follows_llama_cpp(tmp_path):
    """q4_k_m is llama.cpp's Q4_K_M: q4_k, with q6_k for the output matrix and for attention V and FFN
    down (routed experts included) in the first and last eighth of the layers and every third between."""
    cfg = dict(num_hidden_layers=8, hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
               num_experts=4, num_experts_per_tok=2, vocab_size=512)  # fmt: skip
    src = synth("qwen3_moe", tmp_path / "src", cfg, seed=2, progress=False)
    out = pack(src, tmp_path / "m", experts="q4_k_m", trunk="q4_k_m", progress=False)
    mats = json.loads((out / "manifest.json").read_text())["matrices"]
    more = {0, 3, 6, 7}  # llama.cpp's use_more_bits(i, 8)
    for name, e in mats.items():
        if "mlp.gate." in name:
            continue  # routers are kept
        layer = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else -1
        want = "q6_k" if name.startswith("lm_head") else "q4_k"
        if layer in more and ("v_proj" in name or "down_proj" in name):
            want = "q6_k"
        assert e["format"] == want, (name, e["format"])
    assert sum(e["format"] == "q6_k" for e in mats.values()) == 1 + 4 * (1 + 4)
    m = moestream.load(out)
    assert np.isfinite(m.logits([1, 2, 3])).all()


def test_threads_convert_in_parallel_into_the_same_store(k3, tmp_path, monkeypatch):
    """Matrices convert several at a time, and the store (manifest, trunk, experts) and the --report sums
    are byte for byte those of one thread, also when the budget makes the large matrices convert alone."""
    threads_seen: set[int] = set()
    convert = packed._convert

    def spy(*args, **kwargs):
        threads_seen.add(threading.get_ident())
        return convert(*args, **kwargs)

    monkeypatch.setattr(packed, "_convert", spy)
    stores = {}
    for n, budget in ((1, packed.CONVERT_BUDGET), (3, packed.CONVERT_BUDGET), (2, 300_000)):
        monkeypatch.setattr(packed, "CONVERT_BUDGET", budget)
        threads_seen.clear()
        report = packed.Report({}, {}, {})
        dst = pack(k3, tmp_path / f"t{n}", experts="q4_k", trunk="q8_0", progress=False, report=report, threads=n)
        main = threading.get_ident()
        # conversions run off the main thread, which writes (one worker for one thread)
        assert threads_seen and main not in threads_seen and (n > 1 or len(threads_seen) == 1)
        files = {f: (dst / f).read_bytes() for f in ("manifest.json", "trunk.bin", "experts.bin")}
        stores[n] = (files, report.rows())
    assert stores[3] == stores[1] and stores[2] == stores[1]


@pytest.mark.parametrize(("experts", "trunk"), [("mxfp4", "fp8"), ("int4", "q6_k")])
def test_large_matrices_convert_in_row_chunks_into_the_same_bytes(k3, tmp_path, monkeypatch, experts, trunk):
    """Requantized matrices convert in chunks of 128-row multiples (fp8's scale blocks), each on its own,
    so that a large embedding or head never needs its whole f32 copy: the store and the report's sums are
    those of whole-matrix conversion."""
    partial = []
    convert = packed._convert

    def spy(ckpt, m, rows, fmt, measure):
        if rows != (0, m.rows):
            partial.append((m.name, rows))
        return convert(ckpt, m, rows, fmt, measure)

    monkeypatch.setattr(packed, "_convert", spy)
    out = {}
    for chunk in (packed.CHUNK_ELEMENTS, 1):  # 1: every chunk is 128 rows
        monkeypatch.setattr(packed, "CHUNK_ELEMENTS", chunk)
        report = packed.Report({}, {}, {})
        dst = pack(k3, tmp_path / f"c{chunk}", experts=experts, trunk=trunk, progress=False, report=report)
        files = {f: (dst / f).read_bytes() for f in ("manifest.json", "trunk.bin", "experts.bin")}
        out[chunk] = (files, [(c, f, round(e, 12)) for c, f, e in report.rows()])
        verify(dst)
    assert partial and all(r0 % 128 == 0 and r1 - r0 <= 128 for _, (r0, r1) in partial)
    assert out[1] == out[packed.CHUNK_ELEMENTS]


def test_ordered_map_keeps_order_and_budget_and_raises_in_turn():
    cost = {i: (5 if i % 7 == 3 else 1) for i in range(40)}  # some items cost the whole budget
    budget = 5
    live: set[int] = set()  # started, not yet handed back
    lock = threading.Lock()
    over: list[int] = []

    def fn(i: int) -> int:
        with lock:
            live.add(i)
            if len(live) > 1 and sum(cost[j] for j in live) > budget:
                over.append(i)
        return i * i

    out = []
    for i, r in ordered_map(fn, range(40), 3, cost.__getitem__, budget):
        with lock:
            live.discard(i)
        out.append((i, r))
    assert out == [(i, i * i) for i in range(40)] and not over

    def boom(i: int) -> int:
        if i == 5:
            raise ValueError("bad item")
        return i

    got = []
    with pytest.raises(ValueError, match="bad item"):
        for _, r in ordered_map(boom, range(20), 2, lambda i: 1, 100):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]
    assert list(ordered_map(boom, range(5), 1, lambda i: 1, 1)) == [(i, i) for i in range(5)]


@pytest.mark.parametrize("threads,window", [(2, 6), (1, 3)])
def test_ordered_map_runs_ahead_within_its_window(threads, window):
    started: list[int] = []
    live: set[int] = set()  # started, not yet handed back
    peak = 0
    lock = threading.Lock()
    window_started = threading.Event()

    def fn(i: int) -> int:
        nonlocal peak
        with lock:
            started.append(i)
            live.add(i)
            peak = max(peak, len(live))
            if len(started) == window:
                window_started.set()
        return -i

    out = []
    for i, r in ordered_map(fn, range(20), threads, lambda i: 1, 100, window=window):
        if i == 0:  # the consumer holds back on its first item: the map goes on up to the window
            assert window_started.wait(10)
        with lock:
            live.discard(i)
        out.append(r)
    assert out == [-i for i in range(20)] and peak <= window


def test_pack_cli_threads(k3, tmp_path):
    from test_cli import assert_user_error, cli

    assert_user_error(cli("pack", str(k3), str(tmp_path / "z"), "--threads", "0"), "--threads", "at least 1")
    assert not (tmp_path / "z").exists()
    p = cli("pack", str(k3), str(tmp_path / "cli"), "--experts", "q4_k", "--trunk", "q8_0", "--threads", "2")
    assert p.returncode == 0, p.stderr
    api = pack(k3, tmp_path / "api", experts="q4_k", trunk="q8_0", progress=False, threads=1)
    for f in ("manifest.json", "trunk.bin", "experts.bin"):
        assert (tmp_path / "cli" / f).read_bytes() == (api / f).read_bytes()
