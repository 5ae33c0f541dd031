"""Seeded mutation fuzzing of the checkpoint loaders: the safetensors header (and a view of every tensor
it admits), the sharded index, and config.json of every architecture (then what `inspect` computes from
it). Every input must end in a value or in one of the project's own errors. The budgets run in
seconds; MOESTREAM_FUZZ_SCALE multiplies them for longer runs (the atheris targets in tests/fuzz/ go
further still)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import fuzzing
import hf_models
from fuzzing import byte_mutations, dump_json, expect_only_own_errors, json_mutations
from moestream import models
from moestream.formats.checkpoint import INDEX, Checkpoint
from moestream.formats.safetensors import MappedFile, read_header, write_file
from moestream.models.inventory import inventory, layer_map
from moestream.synth import make_config

SCALE = fuzzing.SCALE
DEMO = Path(models.__file__).parent.parent / "demo"


def small_shard() -> bytes:
    """A real safetensors file of a few tensors of every kind the header can describe (and an empty
    one), small enough that a mutation often lands in the header."""
    tensors = {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b.bias": np.ones(5, dtype=ml_dtypes.bfloat16),
        "c.int8": np.arange(8, dtype=np.int8).reshape(2, 2, 2),
        "d.empty": np.zeros((0, 3), dtype=np.float16),
        "e.mask": np.array([True, False, True]),
        "f.scale": np.full((2, 1), 0.5, dtype=np.float64),
    }
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        write_file(path, tensors, {"format": "pt"})
        return path.read_bytes()


def read_all_tensors(path: Path) -> int:
    """read_header, then a view of every tensor it admits, read to the last byte."""
    infos = read_header(path)
    mapped = MappedFile(path)
    n = sum(len(np.ascontiguousarray(mapped.view(info)).tobytes()) for info in infos.values())
    del mapped
    return n


def write_replacing(path: Path, data: bytes) -> None:
    """A new inode each time, so a map of the previous mutant never sees its file shrink."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_safetensors_header_mutations(tmp_path):
    seed = small_shard()
    path = tmp_path / "model.safetensors"
    write_replacing(path, seed)
    assert read_all_tensors(path) > 0  # the seed itself is accepted

    def parse(data: bytes) -> int:
        write_replacing(path, data)
        return read_all_tensors(path)

    accepted = expect_only_own_errors(parse, byte_mutations(seed, 6000 * SCALE, seed=1))
    assert 0 < accepted < 6000 * SCALE  # some mutants are refused, some (data bytes) still read


def _index_dir(tmp_path: Path) -> Path:
    """The demo checkpoint's config and shards (as symlinks, as in the Hugging Face cache) beside an
    index the test rewrites."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(DEMO / "config.json", d / "config.json")
    for shard in DEMO.glob("*.safetensors"):
        (d / shard.name).symlink_to(shard)
    return d


def test_index_mutations(tmp_path):
    d = _index_dir(tmp_path)
    seed = json.loads((DEMO / INDEX).read_text())
    (d / INDEX).write_text(json.dumps(seed))
    assert len(Checkpoint(d).tensors) == len(seed["weight_map"])

    def parse(doc: Any) -> int:
        write_replacing(d / INDEX, dump_json(doc))
        return len(Checkpoint(d).tensors)

    accepted = expect_only_own_errors(parse, as_json(json_mutations(seed, 300 * SCALE, seed=2)))
    assert 0 < accepted < 300 * SCALE


def as_json(mutants: Iterator[Any]) -> Iterator[Any]:
    """Each mutant as it reads back from its JSON text: what a loader sees."""
    for m in mutants:
        yield json.loads(dump_json(m))


def real_configs() -> dict[str, dict[str, Any]]:
    """config.json as transformers writes it for each tiny test model, and Kimi K3's as synth writes it."""
    out = {}
    for name, (kind, cfg) in hf_models.CONFIGS.items():
        config = hf_models.CONFIG_CLASSES[kind](**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        out[name] = json.loads(config.to_json_string())
    out["kimi_k3"] = make_config("kimi_k3", {}, "bf16")[0]
    return out


def describe(config: Any) -> str:
    """What `moestream inspect` computes from a config alone."""
    spec = models.read_spec(config)
    inv = inventory(config)
    return f"{layer_map(spec)} {inv.total_params} {inv.active_params}"


@pytest.mark.parametrize("name", sorted(real_configs()))
def test_config_mutations(name):
    seed = real_configs()[name]
    describe(seed)
    n = 300 * SCALE
    accepted = expect_only_own_errors(describe, as_json(json_mutations(seed, n, seed=3)))
    assert 0 < accepted < n
