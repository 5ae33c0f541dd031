"""What a user names as a model, resolved to files: a checkpoint directory, a packed store, a .gguf file
(or the first part of a split one), a Hugging Face repo id (`org/name`, `org/name@revision`,
`org/name:Q4_K_M` for a GGUF repo), or `demo` (the embedded model). Every command and `moestream.load`
take the same source."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

DEMO = "demo"
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class Source:
    kind: str  # "checkpoint", "packed", "gguf"
    path: Path  # the directory, or the .gguf file
    name: str  # as the user gave it (a hub id, a path), for messages and the served model id
    remote: bool = False  # a hub id, fetched into the hub's cache


def _local(path: Path, name: str, remote: bool = False) -> Source:
    from .formats.packed import is_packed

    if path.is_dir():
        return Source("packed" if is_packed(path) else "checkpoint", path, name, remote)
    if path.name.lower().endswith(GGUF_SUFFIX):
        return Source("gguf", path, name, remote)
    raise InputError(f"{path} is not a model: give a checkpoint directory, a packed store or a .gguf file")


def resolve(
    source: str | os.PathLike[str] | None, *, download: bool = True, progress: bool = True, config_only: bool = False
) -> Source:
    """The model files a source names. A path that exists always wins; `demo` or None is the embedded
    model; otherwise the text must be a Hugging Face repo id, fetched into the hub's cache (only the files
    the model needs; config_only: of a checkpoint repo, its config.json) unless download is False."""
    if source is None or str(source) == DEMO:
        from .default_model import default_model_path

        return _local(default_model_path(), DEMO)
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.exists() or path.is_symlink():
        return _local(path, text)
    from . import hub

    hub_id = hub.parse_hub_id(text)
    if hub_id is None:
        raise InputError(
            f"{text} does not exist (a model is a checkpoint directory, a packed store, a .gguf file, a "
            "Hugging Face id such as org/name, or demo)"
        )
    if not download:
        raise InputError(f"{text}: a Hugging Face id; fetch it first with `moestream download {text}`")
    return _local(hub.download(hub_id, progress=progress, config_only=config_only), text, remote=True)
