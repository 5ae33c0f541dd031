"""The embedded default model: a small deterministic synthetic Kimi K3 checkpoint (MXFP4 experts, tiktoken
tokenizer), created on first use in the cache directory ($MOESTREAM_HOME, else
$XDG_CACHE_HOME/moestream, else ~/.cache/moestream)."""

from __future__ import annotations

import os
from pathlib import Path

from .synth import synth

DEFAULT_NAME = "default-kimi_k3-v1"
DEFAULT_ARCH = "kimi_k3"
DEFAULT_SEED = 1234


def cache_dir() -> Path:
    home = os.environ.get("MOESTREAM_HOME")
    if home:
        return Path(home)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moestream"


def default_model_path() -> Path:
    """The default model's directory, synthesised (atomically) if it is not there yet."""
    path = cache_dir() / DEFAULT_NAME
    if not (path / "config.json").exists():
        try:
            synth(DEFAULT_ARCH, path, seed=DEFAULT_SEED, force=True, progress=False)
        except FileExistsError:  # another process finished first
            pass
    return path
