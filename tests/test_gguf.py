"""GGUF models (formats/gguf.py, gguf_tokenizer.py): GGUFs written as llama.cpp's converter writes them
(tests/gguf_files.py) from the tiny transformers models give the ids and logits of the same model's
safetensors checkpoint, bit for bit; quantized experts give the bits of the same quantized weights
packed by moestream; the block layouts decode as gguf's own dequantizers do; the tokenizer gives the
checkpoint tokenizer's ids; a split GGUF and a budget below the file size change nothing; bad files are
one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import fuzzing
import gguf_files
import hf_models
import moestream
from moestream.chat import load_template
from moestream.errors import CheckpointError, InputError
from moestream.formats.checkpoint import Checkpoint
from moestream.formats.gguf import FLOAT_DTYPES, GGML_FORMATS, GGUFStore, GGUFTensor, is_gguf, read_gguf
from moestream.formats.packed import pack
from moestream.quant import Weight, blocks

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
TEXTS = [
    "hello world",
    "def fibonacci(n):\n    return n\n\n\n",
    "It's   42 o'clock, isn't it?\t\tTabs\r\nand CRLF",
    "汉字和中文 日本語のテキスト Ünïcödé façade 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>",
    "a<|endoftext|>b<|im_end|><|im_end|>c",
    "",
    " ",
    "1234567890 3.14159",
]

_built: dict[str, Path] = {}


def built(key: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints and GGUFs, made once per session: "ckpt:KIND", "gguf:KIND[:kv_b][:experts]"."""
    if key in _built:
        return _built[key]
    parts = key.split(":")
    if parts[0] == "ckpt":
        kind = parts[1]
        arch, cfg = gguf_files.GGUF_CONFIGS[kind]
        out = tmp_path_factory.mktemp(kind) / "ckpt"
        hf_models.save(hf_models.make_model(arch, cfg, seed=5), out)
        gguf_files.tokenizer_files(out)
        _built[key] = out
    else:
        kind, kv_b, experts = parts[1], parts[2], parts[3]
        ckpt = built(f"ckpt:{kind}", tmp_path_factory)
        out = ckpt.parent / f"{kind}-{kv_b}-{experts}.gguf"
        _built[key] = gguf_files.write_gguf(ckpt, out, ckpt, experts=experts, kv_b=kv_b)
    return _built[key]


def run(path: Path, prompt: list[int], n: int = 5, **kw: object) -> tuple[list[int], np.ndarray]:
    with moestream.load(str(path), threads=kw.pop("threads", 1), progress=False, **kw) as m:  # type: ignore[arg-type]
        logits: list[np.ndarray] = []
        ids = list(m.generate(prompt, n, logits_out=logits, stop_at_eos=False))
        return ids, np.stack(logits)


@pytest.mark.parametrize(
    "kind, kv_b", [("qwen3_moe", "split"), ("mixtral", "split"), ("deepseek_v3", "split"), ("deepseek_v3", "joined")]
)
def test_f32_gguf_equals_the_checkpoint(kind, kv_b, tmp_path_factory):
    ckpt = built(f"ckpt:{kind}", tmp_path_factory)
    g = built(f"gguf:{kind}:{kv_b}:f32", tmp_path_factory)
    prompt = hf_models.prompt_ids(gguf_files.VOCAB, 9, seed=2)
    ids_c, logits_c = run(ckpt, prompt)
    ids_g, logits_g = run(g, prompt)
    assert ids_g == ids_c
    assert np.array_equal(logits_g, logits_c)
    store = GGUFStore(g)
    last = store.config["num_hidden_layers"] - 1  # DeepSeek's first layer is dense
    moe = "block_sparse_moe.experts.1.w1" if kind == "mixtral" else "mlp.experts.1.gate_proj"
    expert = store.tensors[f"model.layers.{last}.{moe}.weight"]
    stacked = store.gguf_tensors[f"blk.{last}.ffn_gate_exps.weight"]
    assert expert.offset == stacked.offset + stacked.nbytes // stacked.shape[0]  # a view at its own offset


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k", "mxfp4"])
def test_quantized_experts_equal_the_same_weights_packed(fmt, tmp_path_factory):
    """Experts quantized by our reference quantizers into a GGUF run with the bits of the checkpoint packed
    by moestream into the same format (same bytes, same kernels)."""
    ckpt = built("ckpt:qwen3_moe-wide", tmp_path_factory)
    g = built(f"gguf:qwen3_moe-wide:split:{fmt}", tmp_path_factory)
    packed = ckpt.parent / f"packed-{fmt}"
    if not packed.exists():
        pack(ckpt, packed, experts=fmt, trunk="keep", progress=False)
    prompt = hf_models.prompt_ids(gguf_files.VOCAB, 7, seed=3)
    ids_p, logits_p = run(packed, prompt, 3)
    ids_g, logits_g = run(g, prompt, 3)
    assert ids_g == ids_p
    assert np.array_equal(logits_g, logits_p)
    store = GGUFStore(g)
    w = store.matrix("model.layers.1.mlp.experts.2.down_proj.weight", 256, 256)
    assert w.fmt.name == fmt
    if fmt != "mxfp4":  # the bytes are the quantizer's, read in place
        src = np.asarray(Checkpoint(ckpt).array("model.layers.1.mlp.experts.2.down_proj.weight"), np.float32)
        assert np.array_equal(np.asarray(w.data), blocks.quantize(fmt, src))
        assert any(np.shares_memory(w.data, m) for _, m in store.mapped_files())


def test_pack_of_a_gguf_is_the_gguf(tmp_path_factory, tmp_path):
    """`moestream pack X.gguf DST` keeps every matrix in its block format, each expert one blob: the same
    logits and tokens as the GGUF itself; the tokenizer, its special tokens and the chat template go along."""
    from moestream.formats.packed import PackedStore

    g = built("gguf:qwen3_moe-wide:split:q4_k", tmp_path_factory)
    packed = pack(g, tmp_path / "packed", progress=False)
    prompt = hf_models.prompt_ids(gguf_files.VOCAB, 7, seed=3)
    ids_g, logits_g = run(g, prompt, 4)
    ids_p, logits_p = run(packed, prompt, 4)
    assert ids_p == ids_g and logits_p.tobytes() == logits_g.tobytes()
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    w_p, w_g = PackedStore(packed).matrix(name, 256, 256), GGUFStore(g).matrix(name, 256, 256)
    assert w_p is not None and w_p.fmt.name == "q4_k" and np.array_equal(w_p.data, w_g.data)
    gm, pm = moestream.load(str(g), progress=False), moestream.load(str(packed), progress=False)
    assert gm.tokenizer is not None and pm.tokenizer is not None
    for text in [*TEXTS, "".join(gguf_files.SPECIALS)]:
        assert pm.tokenize(text) == gm.tokenize(text), text
    assert pm.tokenizer.special_tokens == gm.tokenizer.special_tokens and pm.eos_ids == gm.eos_ids
    assert load_template(pm).source == gguf_files.CHAT_TEMPLATE
    requantized = pack(g, tmp_path / "q8", experts="q8_0", progress=False)
    w = PackedStore(requantized).matrix(name, 256, 256)
    assert w is not None and w.fmt.name == "q8_0"
    assert np.abs(w.dequantize() - w_g.dequantize()).max() < 0.02 * np.abs(w_g.dequantize()).max()


def test_block_layouts_decode_as_ggufs_own_dequantizers(tmp_path):
    """Every GGML type we read, written by gguf's writer (quantized by gguf where it can, else by ours),
    decodes through our kernels to the values gguf.quants.dequantize gives."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 512)) * 0.3).astype(np.float32)
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "qwen3moe")
    for t, fmt in GGML_FORMATS.items():
        try:
            data = gguf.quants.quantize(x, t)
        except NotImplementedError:
            data = blocks.quantize(fmt, x)
        w.add_tensor(f"t.{fmt}", data, raw_dtype=t if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = read_gguf(tmp_path / "t.gguf")
    mm = np.memmap(tmp_path / "t.gguf", np.uint8, mode="r")
    store = GGUFStore.__new__(GGUFStore)
    store.path = tmp_path / "t.gguf"
    for t, fmt in GGML_FORMATS.items():
        info = f.tensors[f"t.{fmt}"]
        raw = mm[info.offset : info.offset + info.nbytes]
        ours = store._weight(info, raw, 4, 512).dequantize()
        if t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):  # gguf has no decoder for these
            theirs = raw.view(FLOAT_DTYPES[t]).reshape(4, 512).astype(np.float32)
        else:
            theirs = gguf.quants.dequantize(raw.reshape(4, -1), t)
        assert np.array_equal(ours, np.asarray(theirs, np.float32)), fmt


def test_tokenizer_ids_equal_the_checkpoints(tmp_path_factory):
    ckpt = built("ckpt:qwen3_moe", tmp_path_factory)
    g = built("gguf:qwen3_moe:split:f32", tmp_path_factory)
    hf = moestream.load(str(ckpt), progress=False)
    gm = moestream.load(str(g), progress=False)
    assert hf.tokenizer is not None and gm.tokenizer is not None
    for text in TEXTS:
        assert gm.tokenize(text) == hf.tokenize(text), text
        assert gm.tokenize(text, add_bos=False) == hf.tokenize(text, add_bos=False)
        assert gm.tokenizer.encode(text, special=False) == hf.tokenizer.encode(text, special=False)
        assert gm.detokenize(gm.tokenize(text)) == text
    assert gm.tokenizer.special_tokens == {s: hf.tokenize(s)[0] for s in gguf_files.SPECIALS}
    assert gm.tokenizer.eos_ids == hf.tokenizer.eos_ids
    assert gm.eos_ids == hf.eos_ids
    pieces = [("<|im_start|>user\n", False), ("say <|im_end|> twice", True), ("<|im_end|>\n", False)]
    assert gm.tokenizer.encode_pieces(pieces) == hf.tokenizer.encode_pieces(pieces)
    assert load_template(gm).source == gguf_files.CHAT_TEMPLATE == load_template(hf).source
    assert gm.store.chat_template == gguf_files.CHAT_TEMPLATE


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "deepseek-v3", "kimi-k2", "qwen35"])
def test_other_pre_tokenizers(pre, tmp_path, tmp_path_factory):
    """gpt-2 is compared with a tokenizer trained with GPT-2's own pre-tokenizer; the others (patterns
    written for tokenizers' engine, Kimi's with set operations) must build and round-trip any text."""
    ck = tmp_path / "ckpt"
    hf_tok = gguf_files.tokenizer_files(ck, pre=pre)
    src = built("ckpt:qwen3_moe", tmp_path_factory)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, ck / f)
    g = gguf_files.write_gguf(ck, tmp_path / "m.gguf", ck, pre=pre)
    tok = moestream.load(str(g), progress=False).tokenizer
    assert tok is not None
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if pre == "gpt-2":
            assert ids == hf_tok.encode(text).ids, text


def test_split_gguf_gives_the_same_logits(tmp_path_factory, tmp_path):
    ckpt = built("ckpt:deepseek_v3", tmp_path_factory)
    first = gguf_files.write_gguf(ckpt, tmp_path / "m.gguf", ckpt, split_max_tensors=12)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert first == parts[0] and len(parts) > 2
    prompt = hf_models.prompt_ids(gguf_files.VOCAB, 6, seed=4)
    whole = built("gguf:deepseek_v3:split:f32", tmp_path_factory)
    reference = run(whole, prompt, 3)[1].tobytes()
    assert run(first, prompt, 3)[1].tobytes() == reference
    # within a budget (the smallest the planner takes): experts read from whichever part holds them
    assert run(first, prompt, 3, ram="4M", context=16, threads=2)[1].tobytes() == reference
    assert is_gguf(first) and not is_gguf(tmp_path)
    with pytest.raises(InputError, match="give the first part"):
        GGUFStore(parts[1])
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        GGUFStore(first)


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory) -> Path:
    """A model whose experts dominate (q8_0), large enough for budgets of a fraction of the file."""
    from moestream.synth import synth

    root = tmp_path_factory.mktemp("gguf-budget")
    overrides = dict(hidden_size=256, moe_intermediate_size=256, num_experts=32, num_hidden_layers=4)
    ck = synth("qwen3_moe", root / "ckpt", overrides, seed=3, progress=False)
    return gguf_files.write_gguf(ck, root / "m.gguf", None, experts="q8_0")


def test_budget_below_the_file_size_gives_identical_logits(big_gguf):
    size = big_gguf.stat().st_size
    prompt = list(range(3, 15))
    ids_r, logits_r = run(big_gguf, prompt, 6, threads=2)
    with moestream.load(str(big_gguf), ram=int(size * 0.27), context=32, progress=False) as m:
        list(m.generate(prompt, 2))
        report = m.report()
        assert report["plan"]["budget"] == int(size * 0.27)
        assert 0 < report["streaming"]["bytes_read"]  # the experts were read from the file's own offsets
    for budget in (int(size * 0.27), int(size * 0.4)):
        for threads in (1, 2):
            ids, logits = run(big_gguf, prompt, 6, ram=budget, context=32, threads=threads)
            assert ids == ids_r
            assert logits.tobytes() == logits_r.tobytes(), (budget, threads)


def test_the_commands_take_a_gguf(big_gguf, tmp_path):
    """run --ram below the file's size gives the bytes of the resident run; inspect measures the file."""

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True, timeout=300)

    runs = {}
    for tag, extra in (("resident", ()), ("budget", ("--ram", str(int(big_gguf.stat().st_size * 0.3))))):
        out = tmp_path / f"{tag}.npy"
        p = cli("run", str(big_gguf), "--ids", "3,4,5,6", "--gen", "4", "--json", "--dump-logits", str(out), *extra)
        assert p.returncode == 0, p.stderr
        runs[tag] = (json.loads(p.stdout)["generated_ids"], out.read_bytes())
    assert runs["budget"] == runs["resident"]
    p = cli("inspect", str(big_gguf))
    assert p.returncode == 0, p.stderr
    store = GGUFStore(big_gguf)
    experts = sum(t.nbytes for n, t in store.tensors.items() if ".experts." in n)
    assert "architecture: qwen3_moe, 4 layers" in p.stdout and "bytes: measured" in p.stdout
    assert f"(128 experts of {experts / 128 / 1e3:.2f} kB)" in p.stdout


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray], raw: dict | None = None) -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    for name, arr in tensors.items():
        w.add_tensor(name, arr, raw_dtype=(raw or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bad_files(tmp: Path, good: Path) -> dict[str, tuple[Path, str]]:
    data = good.read_bytes()
    cases: dict[str, tuple[Path, str]] = {}

    def put(name: str, content: bytes, match: str) -> None:
        p = tmp / f"{name}.gguf"
        p.write_bytes(content)
        cases[name] = (p, match)

    put("truncated-data", data[: len(data) * 3 // 5], "lies outside the file")
    put("truncated-header", data[:100], "truncated GGUF")
    put("bad-magic", b"GGML" + data[4:], "not a GGUF file")
    at = data.index(b"output_norm.weight") + len(b"output_norm.weight") + 4 + 8  # n_dims, one dim
    put("unknown-type", data[:at] + (99).to_bytes(4, "little") + data[at + 4 :], "unknown GGML type 99")
    cases["unknown-arch"] = (_write(tmp / "arch.gguf", "mamba9", {"x": np.zeros(4, np.float32)}), "'mamba9'")
    return cases


def test_bad_files_are_one_line_errors(tmp_path_factory, tmp_path):
    ckpt = built("ckpt:qwen3_moe", tmp_path_factory)
    good = built("gguf:qwen3_moe:split:f32", tmp_path_factory)
    cases = _bad_files(tmp_path, good)
    cases["missing-tensor"] = (
        gguf_files.write_gguf(ckpt, tmp_path / "missing.gguf", ckpt, drop=("blk.1.attn_k_norm.weight",)),
        "missing tensor model.layers.1.self_attn.k_norm.weight",
    )
    for name, (path, match) in cases.items():
        with pytest.raises(CheckpointError) as e:
            moestream.load(str(path), progress=False)
        assert match in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    path, _ = cases["truncated-data"]
    p = subprocess.run(
        [sys.executable, "-m", "moestream.cli", "run", str(path), "--prompt", "hi", "--gen", "2"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_unsupported_tensor_type_is_named(tmp_path):
    """A type ggml has but moestream does not multiply (Q5_K) is refused naming the tensor and the type."""
    store = GGUFStore.__new__(GGUFStore)
    store.path = tmp_path / "x.gguf"
    t = GGUFTensor("blk.0.ffn_down_exps.weight", gguf.GGMLQuantizationType.Q5_K, (2, 256), store.path, 0, 352)
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_down_exps\.weight is Q5_K"):
        store._weight(t, np.zeros(352, np.uint8), 2, 256)


def test_header_mutations_give_only_own_errors(tmp_path):
    """Seeded mutation fuzzing of the header walk (tests/fuzz/fuzz_gguf.py goes further)."""
    seed = gguf_files.small_gguf(tmp_path / "seed.gguf").read_bytes()
    path = tmp_path / "m.gguf"

    def parse(data: bytes) -> int:
        tmp = path.with_name("m.new")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return len(read_gguf(path).tensors)

    n = 3000 * fuzzing.SCALE
    accepted = fuzzing.expect_only_own_errors(parse, fuzzing.byte_mutations(seed, n, seed=7))
    assert 0 < accepted < n


def test_weight_views_are_not_copies(tmp_path_factory):
    g = built("gguf:qwen3_moe:split:f32", tmp_path_factory)
    store = GGUFStore(g)
    w = store.matrix("model.layers.0.mlp.experts.3.up_proj.weight", 40, 72)
    assert isinstance(w, Weight) and any(np.shares_memory(w.data, m) for _, m in store.mapped_files())


def test_mutated_model_headers_give_only_own_errors(tmp_path_factory, tmp_path):
    """Mutations of a real model's header (metadata values, tensor infos) through everything a load does
    with them: the store, the config, the tokenizer, the model's weights."""
    from moestream import models
    from moestream.gguf_tokenizer import gguf_tokenizer

    g = built("gguf:deepseek_v3:split:f32", tmp_path_factory)
    good = g.read_bytes()
    head = min(t.offset for t in read_gguf(g).tensors.values())  # the data region's start
    path = tmp_path / "m.gguf"

    def load(header: bytes) -> int:
        tmp = path.with_name("m.new")
        tmp.write_bytes(header + good[head:])
        os.replace(tmp, path)
        store = GGUFStore(path)
        spec = models.read_spec(store.config)
        models.build(store, spec)
        gguf_tokenizer(store)
        return 1

    n = 150 * fuzzing.SCALE
    fuzzing.expect_only_own_errors(load, fuzzing.byte_mutations(good[:head], n, seed=11))
