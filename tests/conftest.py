"""Shared fixtures: tiny random transformers models saved as checkpoints, made once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import hf_models

# State files cache each checkpoint's weight digests under $XDG_CACHE_HOME: the tests (and the CLI runs
# they start, which inherit the environment) keep theirs in a directory of their own, not the user's home.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="moestream-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


class ModelCase:
    def __init__(self, name: str, kind: str, cfg: dict, root: Path):
        self.name, self.kind, self.cfg = name, kind, cfg
        self.hf = hf_models.make_model(kind, cfg, seed=zlib.crc32(name.encode()) % 1000)
        self.path = hf_models.save(self.hf, root / name)
        self._refs: dict[int, hf_models.Reference] = {}

    def prompt(self, n: int) -> list[int]:
        return hf_models.prompt_ids(self.cfg["vocab_size"], n, seed=n)

    def reference(self, n: int) -> hf_models.Reference:
        if n not in self._refs:
            self._refs[n] = hf_models.hf_generate(self.hf, self.prompt(n), 32)
        return self._refs[n]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


_cases: dict[str, ModelCase] = {}


@pytest.fixture(scope="session", params=sorted(hf_models.CONFIGS))
def case(request: pytest.FixtureRequest, model_root: Path) -> ModelCase:
    name = request.param
    if name not in _cases:
        kind, cfg = hf_models.CONFIGS[name]
        _cases[name] = ModelCase(name, kind, cfg, model_root)
    return _cases[name]


@pytest.fixture(scope="session")
def small_case(model_root: Path) -> ModelCase:
    """One model for tests that need any checkpoint (CLI, bad input)."""
    name = "qwen3_moe-gqa4-k3"
    if name not in _cases:
        kind, cfg = hf_models.CONFIGS[name]
        _cases[name] = ModelCase(name, kind, cfg, model_root)
    return _cases[name]
