"""atheris target: config.json of every architecture, parsed as the loader parses it, then read_spec and
what `moestream inspect` computes (the tensor inventory and the layer map). Any exception other than the
project's own errors is a finding. Run: python3 tests/fuzz/fuzz_config.py [atheris/libFuzzer options];
the seeded suite test is tests/test_fuzz_loaders.py."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import atheris
import ml_dtypes  # noqa: F401  (imported before, so not instrumented)
import numpy  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Only the project's code is instrumented (the helpers' torch and transformers would take minutes).
with atheris.instrument_imports():
    from moestream import config, models  # noqa: F401  (instrumented before the helpers import them)
    from moestream.errors import MoeStreamError
    from moestream.formats.checkpoint import read_json
    from moestream.models import inventory  # noqa: F401

from test_fuzz_loaders import describe, real_configs

WORK = Path(tempfile.mkdtemp(prefix="fuzz_config_"))
PATH = WORK / "config.json"


def one_input(data: bytes) -> None:
    PATH.write_bytes(data)
    try:
        describe(read_json(PATH, "config.json"))
    except MoeStreamError:
        pass


def main() -> None:
    corpus = WORK / "corpus"
    corpus.mkdir()
    for name, config in real_configs().items():
        (corpus / name).write_text(json.dumps(config))
    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
