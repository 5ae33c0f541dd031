"""atheris target for the state-file loader (moestream.state_file.load_state), for runs longer than the
suite's seeded budget: every input must load or end in one of moestream's own errors.

    pip install atheris
    python3 tests/fuzz/fuzz_state.py [-max_total_time=3600] [CORPUS_DIR]

The model is a small synthetic Kimi K3 (KDA and MLA caches) written to a temporary directory; the seed
input is a real state file saved from it. The model digest is computed once and fixed, so the time goes
to the parsing (the zip directory, the .npy headers, meta)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any


def make_target(root: Path) -> tuple[Any, bytes]:
    """(the function atheris calls, a valid state file's bytes)."""
    import moestream
    from moestream import state_file
    from moestream.errors import MoeStreamError
    from moestream.synth import synth

    model = moestream.load(synth("kimi_k3", root / "k3", {"num_hidden_layers": 2}, progress=False))
    state = model.new_state()
    model.decoder.forward(list(range(3, 12)), state, model.ctx)
    seed = root / "seed.npz"
    state_file.save_state(seed, model, state, [4])
    digest = state_file.fingerprint(model)
    state_file.fingerprint = lambda m: digest  # type: ignore[assignment]
    target = root / "input.npz"

    def one_input(data: bytes) -> None:
        target.write_bytes(data)
        try:
            state_file.load_state(target, model)
        except MoeStreamError:
            pass

    return one_input, seed.read_bytes()


def main() -> None:
    import atheris

    with tempfile.TemporaryDirectory() as tmp:
        one_input, seed = make_target(Path(tmp))
        corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
        if corpus:
            Path(corpus[0]).mkdir(parents=True, exist_ok=True)
            (Path(corpus[0]) / "seed.npz").write_bytes(seed)
        atheris.Setup(sys.argv, one_input)
        atheris.Fuzz()


if __name__ == "__main__":
    main()
