"""generation_config.json: the sampling defaults a model's authors chose (temperature, top-p, top-k, min-p,
repetition penalty) and the extra end-of-text ids. The CLI and the server use them for every setting the
user (or the request) leaves out; an explicit setting always wins.

Only what the file says is used, not transformers' implicit defaults (its top_k=50 when sampling), as
vLLM does; the one exception is `do_sample`: false means greedy whatever the temperature says, and true
with no temperature means temperature 1, since "sample" must not turn into greedy decoding."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .formats.checkpoint import read_json
from .sampling import MAX_PENALTY, MAX_TEMPERATURE, MAX_TOP_K

FILE = "generation_config.json"
MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class GenerationDefaults:
    """The model's defaults; None: the file does not say (the caller's own default applies)."""

    temperature: float | None = None  # 0: greedy (do_sample false)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()

    def sampling_fields(self) -> dict[str, float | int]:
        """The settings the file gives, by SamplingParams field name."""
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return {k: v for k, v in fields.items() if v is not None}


def read_generation_config(model_dir: Path) -> GenerationDefaults | None:
    """The defaults in model_dir/generation_config.json; None when there is no such file (or model_dir is
    not a directory: a .gguf file has none). A file that is not a JSON object, or a field of the wrong
    type or out of range, is one CheckpointError naming the file and the field."""
    path = Path(model_dir) / FILE
    if not Path(model_dir).is_dir() or not (path.exists() or path.is_symlink()):
        return None
    cfg = read_json(path, FILE)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: corrupt {FILE} (not an object)")
    do_sample = cfg.get("do_sample")
    if do_sample not in (None, True, False):
        raise CheckpointError(f"{path}: do_sample must be true, false or null, got {_show(do_sample)}")
    temperature = _number(cfg, "temperature", path, 0.0, MAX_TEMPERATURE)
    if do_sample is False:
        temperature = 0.0
    elif do_sample is True and temperature is None:
        temperature = 1.0
    return GenerationDefaults(
        temperature=temperature,
        top_p=_number(cfg, "top_p", path, 0.0, 1.0, low_open=True),
        top_k=_integer(cfg, "top_k", path, 0, MAX_TOP_K),
        min_p=_number(cfg, "min_p", path, 0.0, 1.0),
        repetition_penalty=_number(cfg, "repetition_penalty", path, 0.0, MAX_PENALTY, low_open=True),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), path),
    )


def _show(v: Any) -> str:
    return repr(v)[:60]


def _number(cfg: dict[str, Any], key: str, path: Path, low: float, high: float, low_open: bool = False) -> float | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise CheckpointError(f"{path}: {key} must be a number, got {_show(v)}")
    x = float(v)
    if not math.isfinite(x) or x < low or x > high or (low_open and x == low):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise CheckpointError(f"{path}: {key} must be in {bounds}, got {_show(v)}")
    return x


def _integer(cfg: dict[str, Any], key: str, path: Path, low: int, high: int) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"{path}: {key} must be an integer, got {_show(v)}")
    if not low <= v <= high:
        raise CheckpointError(f"{path}: {key} must be in [{low}, {high}], got {_show(v)}")
    return v


def _eos_ids(v: Any, path: Path) -> tuple[int, ...]:
    """eos_token_id: an id, a list of ids, or null."""
    if v is None:
        return ()
    ids = v if isinstance(v, list) else [v]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_TOKEN_ID:
            raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {_show(v)}")
    return tuple(dict.fromkeys(ids))
