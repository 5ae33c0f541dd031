"""atheris target: model.safetensors.index.json, loaded with the demo checkpoint's config and shards (as
symlinks) by Checkpoint. Any exception other than the project's own errors is a finding. Run:
python3 tests/fuzz/fuzz_index.py [atheris/libFuzzer options]; the seeded suite test is
tests/test_fuzz_loaders.py."""

from __future__ import annotations

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
    from moestream.formats.checkpoint import INDEX, Checkpoint

from test_fuzz_loaders import DEMO, _index_dir, write_replacing

WORK = Path(tempfile.mkdtemp(prefix="fuzz_index_"))
MODEL = _index_dir(WORK)


def one_input(data: bytes) -> None:
    write_replacing(MODEL / INDEX, data)
    try:
        Checkpoint(MODEL)
    except MoeStreamError:
        pass


def main() -> None:
    corpus = WORK / "corpus"
    corpus.mkdir()
    (corpus / "seed").write_bytes((DEMO / INDEX).read_bytes())
    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
