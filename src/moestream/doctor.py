"""`moestream doctor`: what this machine offers a model and which budget to run it with.

CPU (model, cores, the SIMD paths the kernels can use), memory (total, available, the cgroup limit), the
memory read bandwidth the kernels see, numpy's BLAS and its kernels (MLA decode attention multiplies there),
and the O_DIRECT read bandwidth of the model's disk; then, for a packed store, the plan each preset would
make and an estimate of its seconds per token:

    estimate = bytes read per token / disk bandwidth + active weight bytes per token / memory bandwidth
               + layers x the per-layer cost that is neither (dispatch, attention, norms: ~1 ms measured
                 on the demo model here, 9 ms/token over 8 layers)

where the bytes read per token assume uniform routing (a token's expert is cached with probability
slots / experts) and the unpinned trunk is read once per token. It is an estimate; `moestream bench`
measures."""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Any

from . import _C
from .errors import InputError
from .runtime import planner
from .runtime.reader import aligned_empty, read_bandwidth

PER_LAYER_SECONDS = 1e-3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bandwidth(threads: int) -> float:
    """GB/s of a 256 MiB read by the kernels' own memory-read loop."""
    buf = aligned_empty(256 << 20)
    buf[:] = 1
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        _C.memread(buf, threads)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


# OpenBLAS kernel families that use AVX2 at most (threadpoolctl's "architecture"); on a CPU with AVX-512
# they leave half of its float multiply-add width unused
_AVX2_BLAS_CORES = {"haswell", "zen", "sandybridge", "nehalem", "prescott", "core2", "penryn", "dunnington"}


def blas_facts() -> dict[str, str]:
    """numpy's BLAS as threadpoolctl sees it: library, version, kernel family; and OPENBLAS_CORETYPE.
    Other packages may load BLAS libraries of their own (scipy's wheels bundle another OpenBLAS): numpy's
    is the one under its package directory or the wheel's numpy.libs beside it, else the only one."""
    import numpy
    import threadpoolctl

    home = Path(numpy.__file__).resolve().parent
    libs = [lib for lib in threadpoolctl.threadpool_info() if lib.get("user_api") == "blas"]
    own = [
        lib
        for lib in libs
        if any(Path(lib["filepath"]).resolve().is_relative_to(d) for d in (home, home.with_name(home.name + ".libs")))
    ]
    lib = own[0] if own else libs[0] if len(libs) == 1 else None
    if lib is None:
        return {"library": "unknown" if libs else "none", "version": "", "architecture": "", "coretype_env": ""}
    return {
        "library": str(lib.get("internal_api", "unknown")),
        "version": str(lib.get("version") or "unknown"),
        "architecture": str(lib.get("architecture") or "unknown"),
        "coretype_env": os.environ.get("OPENBLAS_CORETYPE", ""),
    }


def blas_advice(blas: dict[str, str], simd: list[str]) -> str | None:
    """A line for doctor when numpy's OpenBLAS runs AVX2 kernels on a CPU with AVX-512 (MLA decode
    attention's products run there), else None."""
    if blas["library"] != "openblas" or "avx512" not in simd or blas["architecture"].lower() not in _AVX2_BLAS_CORES:
        return None
    why = (
        f"OPENBLAS_CORETYPE={blas['coretype_env']} is set in the environment"
        if blas["coretype_env"]
        else "OpenBLAS did not recognise this CPU (OPENBLAS_CORETYPE=SkylakeX chooses its AVX-512 kernels)"
    )
    return (
        f"note: numpy's OpenBLAS runs its {blas['architecture']} (AVX2) kernels on this AVX-512 CPU: {why}; "
        "MLA decode attention multiplies there (its SkylakeX kernels multiply 1.8x as fast on Zen 5)"
    )


def machine_facts(threads: int) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": threads,
        "simd": _C.supported_isas(),
        "kernel_path": _C.get_isa(),
        "gfni": _C.uses_gfni(),
        "l1d_bytes": _C.l1d_bytes(),
        "narrow_row_streams": _C.weight_streams_for(0),
        "wide_row_streams": _C.weight_streams_for(1 << 20),
        "long_run_streams": _C.weight_streams_for(0, _C.LONG_RUN_BYTES),
        "prefetch_level": _C.get_prefetch_level(),
        "mem_total": planner.meminfo("MemTotal"),
        "mem_available": planner.mem_available(),
        "cgroup_limit": planner.cgroup_limit(),
        "memory_read_gb_s": memory_bandwidth(threads),
        "blas": blas_facts(),
    }


def streams_text(narrow: int, wide: int, long: int) -> str:
    """The weight streams of the decode kernels in words: one number when every product takes it, else what
    a narrow row takes and where wide rows or a long run take another."""
    if narrow == wide == long:
        return f"{narrow}"
    text = f"{narrow} for narrow rows"
    if wide != narrow:
        text += f", {wide} for wide rows"
    if long != narrow:
        text += f", {long} for a run of {_C.LONG_RUN_BYTES >> 20} MB or more"
    return text


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def estimate(model: Any, lay: Any, plan: planner.Plan, disk_gb_s: float, mem_gb_s: float) -> dict[str, float]:
    """Expected bytes read and seconds per decoded token under `plan` (uniform routing)."""
    moe_layers = len(lay.layers)
    miss = 1 - min(1.0, plan.expert_slots / max(1, plan.n_experts))
    expert_read = moe_layers * lay.top_k * lay.slot_bytes * miss
    sizes = {g: sum(b - a for _, a, b in spans) for g, spans in lay.groups.items() if g != "embed"}
    trunk_read = sum(n for g, n in sizes.items() if g not in plan.pinned)
    active = moe_layers * lay.top_k * lay.slot_bytes + sum(sizes.values())
    read = expert_read + trunk_read
    layers = len(getattr(model.decoder, "blocks", None) or getattr(model.decoder, "layers", []))
    seconds = read / (disk_gb_s * 1e9) + active / (mem_gb_s * 1e9) + layers * PER_LAYER_SECONDS
    return {"read_bytes_per_token": read, "active_bytes_per_token": active, "seconds_per_token": seconds}


def cmd_doctor(args: argparse.Namespace) -> int:
    from .formats.packed import PackedStore
    from .generate import default_threads, load
    from .runtime.streaming import layout, plan_budget

    threads = default_threads()
    facts = machine_facts(threads)
    using = facts["kernel_path"] + ("+gfni" if facts["gfni"] else "")
    print(f"cpu: {facts['cpu']}, {threads} cores; kernel paths {', '.join(facts['simd'])} (using {using})")
    l1 = f"L1d {facts['l1d_bytes'] // 1024} KB" if facts["l1d_bytes"] else "L1d size unknown"
    streams = streams_text(facts["narrow_row_streams"], facts["wide_row_streams"], facts["long_run_streams"])
    far = "far ones into L2" if facts["prefetch_level"] == 2 else "all into L1"
    print(f"decode kernels: {l1}; weight streams a thread {streams}; prefetches {far}")
    limit = facts["cgroup_limit"]
    print(
        f"memory: {_gb(facts['mem_total'])} total, {_gb(facts['mem_available'])} available, cgroup limit "
        f"{_gb(limit) if limit else 'none'}; kernels read memory at {facts['memory_read_gb_s']:.1f} GB/s"
    )
    blas = facts["blas"]
    known = blas["library"] not in ("none", "unknown")
    print(f"numpy BLAS: {blas['library']}" + (f" {blas['version']}, {blas['architecture']} kernels" if known else ""))
    advice = blas_advice(blas, facts["simd"])
    if advice:
        print(advice)
    model = load(args.model, preload=False)
    store = model.store
    lay: Any = None
    try:
        lay = layout(model, store)
    except InputError as e:  # no routed experts: nothing streams
        why = str(e)
    block = lay.slot_bytes if lay is not None else 4 << 20
    if isinstance(store, PackedStore):
        target = store.path / store.manifest["files"]["experts"]
    else:  # the largest file the weights are mapped from
        target = max((p for p, _ in store.mapped_files()), key=lambda p: p.stat().st_size)
    gbs, direct = read_bandwidth(target, block, seconds=args.seconds)
    how = "O_DIRECT" if direct else "buffered (O_DIRECT refused: the number includes the page cache)"
    print(f"disk: {gbs:.2f} GB/s random {block / 2**20:.1f} MiB reads of {target.name}, 4 in flight, {how}")
    print(f"model: {model.name} ({model.spec.model_type}), {_gb(store.nbytes)} of weights")
    if lay is None:
        print(f"it runs resident: {why}")
        return 0
    avail = min(x for x in (facts["mem_available"], limit) if x) if (limit or facts["mem_available"]) else 0
    rows: list[tuple[str, int, planner.Plan | None, dict[str, float] | None]] = []
    for name in [*planner.PRESETS, "auto"]:
        budget = planner.resolve_budget(None, name)
        assert budget is not None
        try:
            plan = plan_budget(model, lay, budget, context=4096, prompt_tokens=512)
        except InputError:
            rows.append((name, budget, None, None))
            continue
        rows.append((name, budget, plan, estimate(model, lay, plan, gbs, facts["memory_read_gb_s"])))
    print(f"\n{'preset':<12} {'budget':>11} {'expert slots':>16} {'GB read/token':>14} {'est. s/token':>13}")
    best = None
    for name, budget, maybe_plan, est in rows:
        if maybe_plan is None or est is None:
            print(f"{name:<12} {_gb(budget):>11} {'too small':>16}")
            continue
        fits = budget <= avail * 0.9 or name == "auto"
        slots = f"{maybe_plan.expert_slots}/{maybe_plan.n_experts}"
        print(
            f"{name:<12} {_gb(budget):>11} {slots:>16} {est['read_bytes_per_token'] / 1e9:>14.4f} "
            f"{est['seconds_per_token']:>13.4f}{'' if fits else '  (more than this machine has)'}"
        )
        if fits and (best is None or est["seconds_per_token"] < best[2]["seconds_per_token"]):
            best = (name, budget, est)
    if best is None:
        print("\nrecommendation: none of the presets fits this machine; the model cannot stream here")
        return 1
    name, budget, est = best
    print(
        f"\nrecommendation: --preset {name} ({_gb(budget)}): about {est['seconds_per_token']:.4f} s/token "
        f"({1 / est['seconds_per_token']:.1f} tok/s), estimated"
    )
    return 0
