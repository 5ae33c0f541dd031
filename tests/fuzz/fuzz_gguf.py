"""atheris target: GGUF headers (read_gguf: metadata, tensor infos, their bounds). Any exception other
than the project's own errors is a finding. Run: python3 tests/fuzz/fuzz_gguf.py [atheris/libFuzzer
options, e.g. -max_total_time=600]; the seeded suite test is test_header_mutations_give_only_own_errors
in tests/test_gguf.py."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris
import gguf  # noqa: F401  (imported before, so not instrumented)
import numpy  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Only the project's code is instrumented (the helpers' torch and transformers would take minutes).
with atheris.instrument_imports():
    from moestream.errors import MoeStreamError
    from moestream.formats.gguf import read_gguf

from gguf_files import small_gguf

WORK = Path(tempfile.mkdtemp(prefix="fuzz_gguf_"))
PATH = WORK / "model.gguf"


def one_input(data: bytes) -> None:
    tmp = PATH.with_name("model.new")
    tmp.write_bytes(data)
    os.replace(tmp, PATH)  # a new inode each time
    try:
        read_gguf(PATH)
    except MoeStreamError:
        pass


def main() -> None:
    corpus = WORK / "corpus"
    corpus.mkdir()
    (corpus / "seed").write_bytes(small_gguf(WORK / "seed.gguf").read_bytes())
    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
