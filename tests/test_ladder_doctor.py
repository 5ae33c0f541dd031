"""`moestream bench` (the memory ladder, its table, JSON and PNG) and `moestream doctor` on a synthetic
packed kimi_k3; the prefill progress bar and the live status line change nothing that is computed."""

from __future__ import annotations

import io
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

import moestream
from moestream import _C
from moestream.console import LiveStatus, prefill_progress
from moestream.doctor import blas_advice, blas_facts, streams_text
from moestream.formats.packed import pack
from moestream.synth import synth
from test_cli import assert_user_error, cli

SMALL_K3 = dict(num_hidden_layers=4, num_experts=32, num_experts_per_token=2, routed_expert_hidden_size=128,
                moe_intermediate_size=256)  # fmt: skip


@pytest.fixture(scope="module")
def k3_pack(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ladder")
    src = synth("kimi_k3", root / "src", SMALL_K3, seed=3, progress=False)
    return pack(src, root / "packed", experts="keep", trunk="keep", progress=False)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert data.endswith(b"IEND\xaeB`\x82")  # the closing chunk: the file is complete
    return struct.unpack(">II", data[16:24])


def test_memory_ladder_table_json_and_png(k3_pack, tmp_path):
    refused = cli("bench", str(k3_pack), "--ram", "1M", "--gen", "3", "--prompt-tokens", "4")
    m = re.search(r"needs at least (\d+) MB", refused.stdout)
    assert refused.returncode == 1 and m, refused.stdout + refused.stderr
    low = int(m.group(1)) + 1
    budgets = f"{low}M,{2 * low}M,max"
    png, rows_json = tmp_path / "ladder.png", tmp_path / "ladder.json"
    p = cli("bench", str(k3_pack), "--ram", budgets, "--gen", "6", "--prompt-tokens", "8", "--threads", "1",
            "--plot", str(png), "--json", str(rows_json))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "generated ids identical at every budget: yes" in p.stdout
    rows = json.loads(rows_json.read_text())
    assert [r["budget"] for r in rows] == budgets.split(",")
    assert rows[0]["hit_rate"] <= rows[1]["hit_rate"] <= rows[2]["hit_rate"] == 1.0
    assert rows[0]["gb_read_per_token"] >= rows[1]["gb_read_per_token"] > 0 == rows[2]["gb_read_per_token"]
    w, h = png_size(png)
    assert w > 300 and h > 200
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (h, w) and float(np.std(img)) > 0.01  # not blank


def test_bench_refuses_what_it_cannot_run(tmp_path, k3_pack):
    assert_user_error(cli("bench", str(tmp_path / "none"), "--ram", "1G"), "does not exist")
    assert_user_error(cli("bench", str(k3_pack), "--ram", "lots"), "--ram")
    assert_user_error(cli("bench", str(k3_pack), "--ram", "1G", "--plot", str(tmp_path / "x" / "p.png")), "--plot")


def test_bench_runs_a_checkpoint_as_it_is():
    """The demo is a safetensors checkpoint: its experts stream from their own offsets, no pack needed."""
    p = cli("bench", "demo", "--ram", "12M,max", "--gen", "3", "--prompt-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert "refused" not in p.stdout and "generated ids identical at every budget: yes" in p.stdout


def test_streams_text_names_only_the_cases_that_differ():
    mb = _C.LONG_RUN_BYTES >> 20
    assert streams_text(4, 4, 4) == "4" and streams_text(1, 1, 1) == "1"
    assert streams_text(1, 4, 4) == f"1 for narrow rows, 4 for wide rows, 4 for a run of {mb} MB or more"
    assert streams_text(1, 1, 4) == f"1 for narrow rows, 4 for a run of {mb} MB or more"
    assert streams_text(1, 4, 1) == "1 for narrow rows, 4 for wide rows"


def test_doctor_reports_the_machine_and_recommends_a_preset(k3_pack):
    p = cli("doctor", str(k3_pack), "--seconds", "0.3")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "cores" in out and "scalar" in out
    narrow, wide, level = _C.weight_streams_for(0), _C.weight_streams_for(1 << 20), _C.get_prefetch_level()
    streams = streams_text(narrow, wide, _C.weight_streams_for(0, _C.LONG_RUN_BYTES))
    far = "far ones into L2" if level == 2 else "all into L1"
    assert (
        f"decode kernels: L1d {_C.l1d_bytes() // 1024} KB; weight streams a thread {streams}; prefetches {far}" in out
    )
    assert re.search(r"disk: [0-9.]+ GB/s random", out)
    assert re.search(r"recommendation: --preset \w+ \([0-9.]+ GiB\): about [0-9.]+ s/token", out)
    p = cli("doctor", "--seconds", "0.2")  # the demo, a checkpoint: the ladder of its own files
    assert p.returncode == 0 and "model: demo (kimi_k3)" in p.stdout
    assert re.search(r"disk: [0-9.]+ GB/s random .* reads of model-\d+-of-\d+\.safetensors", p.stdout)
    assert re.search(r"recommendation: --preset \w+", p.stdout)
    blas = blas_facts()  # what this test process loaded: the same numpy as the CLI's
    assert f"numpy BLAS: {blas['library']} {blas['version']}, {blas['architecture']} kernels" in p.stdout


def test_doctor_names_numpys_blas_beside_another_packages_blas(monkeypatch):
    import threadpoolctl

    numpy_home = Path(np.__file__).resolve().parent
    ours = {"user_api": "blas", "internal_api": "openblas", "version": "9.9.ours", "architecture": "SkylakeX"}
    ours["filepath"] = str(numpy_home.with_name("numpy.libs") / "libscipy_openblas64_-x.so")
    other = {"user_api": "blas", "internal_api": "openblas", "version": "0.0.other", "architecture": "Haswell"}
    other["filepath"] = "/elsewhere/scipy.libs/libscipy_openblas-y.so"  # scipy's wheels carry their own
    omp = {"user_api": "openmp", "internal_api": "openmp", "version": None, "filepath": "/elsewhere/libgomp.so"}

    def facts_with(libs):
        monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: libs)
        return blas_facts()

    assert facts_with([omp, other, ours])["version"] == "9.9.ours"  # numpy's, whichever loaded first
    assert facts_with([other])["version"] == "0.0.other"  # the only one (a numpy linked to a system BLAS)
    assert facts_with([other, dict(other, filepath="/x/libmkl_rt.so")])["library"] == "unknown"
    assert facts_with([omp])["library"] == "none"


def test_doctor_advises_on_avx2_blas_kernels_on_an_avx512_cpu():
    avx512 = ["scalar", "avx2", "avx512"]
    forced = {"library": "openblas", "version": "0.3.31", "architecture": "Haswell", "coretype_env": "Haswell"}
    advice = blas_advice(forced, avx512)
    assert advice is not None and "OPENBLAS_CORETYPE=Haswell is set" in advice
    advice = blas_advice({**forced, "coretype_env": ""}, avx512)
    assert advice is not None and "did not recognise" in advice and "OPENBLAS_CORETYPE=SkylakeX" in advice
    assert blas_advice({**forced, "architecture": "SkylakeX"}, avx512) is None
    assert blas_advice({**forced, "architecture": "Cooperlake"}, avx512) is None
    assert blas_advice(forced, ["scalar", "avx2"]) is None  # an AVX2 CPU: Haswell kernels are its best
    assert blas_advice({**forced, "library": "mkl"}, avx512) is None


def test_progress_and_live_status_do_not_change_results(capsys):
    m = moestream.load()
    ids = m.tokenize("def f(x):\n    return x * 2\n" * 4)
    plain = m.decoder.forward(ids, m.new_state(), m.ctx, all_logits=True)
    with prefill_progress(m.decoder, len(ids), show=True):
        shown = m.decoder.forward(ids, m.new_state(), m.ctx, all_logits=True)
    assert m.decoder.hooks is None
    assert np.array_equal(plain, shown)
    assert "prefill" in capsys.readouterr().err
    buf = io.StringIO()
    live = LiveStatus(buf, enabled=True)
    live.update("12.0 tok/s", force=True)
    live.close()
    text = buf.getvalue()
    assert "12.0 tok/s" in text and "\x1b[r" in text  # drawn, then the scroll region reset
    quiet = io.StringIO()
    LiveStatus(quiet).update("x", force=True)  # not a terminal: nothing written
    assert quiet.getvalue() == ""


def test_synth_and_pack_bars_follow_the_progress_flag(tmp_path, capsys):
    src = synth("qwen3_moe", tmp_path / "quiet", {"num_hidden_layers": 1}, progress=False)
    pack(src, tmp_path / "quiet-pack", progress=False)
    assert capsys.readouterr().err == ""
    synth("qwen3_moe", tmp_path / "shown", {"num_hidden_layers": 1}, progress=True)
    pack(src, tmp_path / "shown-pack", progress=True)
    err = capsys.readouterr().err
    assert "synth qwen3_moe" in err and "pack" in err
