"""atheris target: the packed-store loader (PackedStore) on arbitrary manifest.json bytes, with a tiny use
that touches every tensor, matrix and checksummed range. Anything but the project's own errors is a
finding. Long runs outside the suite (tests/test_integrity.py runs the seeded budget):

    pip install atheris && python3 tests/fuzz/fuzz_manifest.py [-max_total_time=3600] [corpus_dir]

The store is a small synthetic qwen3_moe pack made once under a temporary directory; its manifest is the
first input of the corpus.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from moestream.errors import MoeStreamError
    from moestream.formats.packed import MANIFEST, PackedStore, pack
    from moestream.synth import synth

WORK = Path(tempfile.mkdtemp(prefix="fuzz-manifest-"))
atexit.register(shutil.rmtree, WORK, True)


def make_store() -> Path:
    src = synth("qwen3_moe", WORK / "src", {"num_hidden_layers": 2}, seed=3, progress=False)
    store = pack(src, WORK / "packed", experts="q8_0", trunk="keep", progress=False)
    shutil.rmtree(src)
    return store


STORE = make_store()
SEED = (STORE / MANIFEST).read_bytes()


def touch_everything(s: PackedStore) -> None:
    for name in s.tensors:
        s.array(name).reshape(-1)[:1].tobytes()
    for name, e in s.manifest["matrices"].items():
        w = s.matrix(name, e["rows"], e["cols"])
        if w is not None:
            w.data.reshape(-1)[:1].tobytes()
    for _, e in s.entries():
        s.crc_ok(e)


def test_one(data: bytes) -> None:
    (STORE / MANIFEST).write_bytes(data)
    try:
        touch_everything(PackedStore(STORE))
    except MoeStreamError:
        pass


def main() -> None:
    corpus = Path(tempfile.mkdtemp(prefix="corpus-", dir=WORK))
    (corpus / "seed.json").write_bytes(SEED)
    atheris.Setup([*sys.argv, str(corpus)], test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
