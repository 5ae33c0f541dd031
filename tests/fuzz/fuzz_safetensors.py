"""atheris target: safetensors headers (read_header, then a view of every tensor it admits). Any
exception other than the project's own errors is a finding. Run: python3 tests/fuzz/fuzz_safetensors.py
[atheris/libFuzzer options, e.g. -max_total_time=600]; the seeded suite test is tests/test_fuzz_loaders.py."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris
import ml_dtypes  # noqa: F401  (imported before, so not instrumented)
import numpy  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Only the project's code is instrumented (the helpers' torch and transformers would take minutes).
with atheris.instrument_imports():
    from moestream.errors import MoeStreamError
    from moestream.formats import safetensors  # noqa: F401  (instrumented before the helpers import it)

from test_fuzz_loaders import read_all_tensors, small_shard, write_replacing

WORK = Path(tempfile.mkdtemp(prefix="fuzz_safetensors_"))
PATH = WORK / "model.safetensors"


def one_input(data: bytes) -> None:
    write_replacing(PATH, data)
    try:
        read_all_tensors(PATH)
    except MoeStreamError:
        pass


def main() -> None:
    corpus = WORK / "corpus"
    corpus.mkdir()
    (corpus / "seed").write_bytes(small_shard())
    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
