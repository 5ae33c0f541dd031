"""atheris target: parse_hub_id on any text. It must return a HubId or None (never raise), and an id it
accepts must write back (str) to text that parses to the same id. The seeded suite test is
test_parse_hub_id_mutations in tests/test_hub.py. Run: python3 tests/fuzz/fuzz_hub_id.py [options]."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from moestream.hub import parse_hub_id

SEEDS = ["org/name", "org/name@refs/pr/1", "unsloth/Qwen3-30B-A3B-GGUF:UD-Q4_K_XL@main", "./org/name"]


def one_input(data: bytes) -> None:
    text = atheris.FuzzedDataProvider(data).ConsumeUnicodeNoSurrogates(len(data))
    hub_id = parse_hub_id(text)
    if hub_id is not None and parse_hub_id(str(hub_id)) != hub_id:
        raise AssertionError(f"{text!r} -> {hub_id!r} does not write back")


def main() -> None:
    corpus = Path(tempfile.mkdtemp(prefix="fuzz_hub_id_"))
    for i, seed in enumerate(SEEDS):
        (corpus / str(i)).write_text(seed)
    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
