"""The embedded default model: the demo Kimi K3 trained by tools/train_demo.py on the Python standard
library (bf16 trunk, MXFP4 experts, tiktoken tokenizer), shipped inside the package in src/moestream/demo."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

DEMO_DIR = Path(__file__).resolve().parent / "demo"


def cache_dir() -> Path:
    """Where moestream keeps files it makes ($MOESTREAM_HOME, else $XDG_CACHE_HOME/moestream, else
    ~/.cache/moestream)."""
    home = os.environ.get("MOESTREAM_HOME")
    if home:
        return Path(home)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moestream"


def default_model_path() -> Path:
    """The demo model's directory inside the installed package."""
    if not (DEMO_DIR / "config.json").exists():
        raise CheckpointError(f"{DEMO_DIR}: the embedded demo model is missing from this installation")
    return DEMO_DIR
