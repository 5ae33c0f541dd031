"""atheris target for the tokenizer files: the fuzzer's bytes become, in turn, tiktoken.model,
tokenization_*.py, tokenizer_config.json or tokenizer.json next to the demo's other files; each is
loaded and used. Only the project's own errors may come out.

    python3 tests/fuzz/fuzz_tokenizer.py [atheris/libFuzzer options, e.g. -max_total_time=600]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

FILES = ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json", "tokenizer.json")
SAMPLE = "def f(x):\n    return x  # 中文 🙂 <|open|>user<|sep|>[EOS]"


def main() -> None:
    import atheris

    with atheris.instrument_imports():
        from moestream.default_model import default_model_path
        from moestream.errors import MoeStreamError
        from moestream.tokenizer import load_tokenizer

    root = Path(tempfile.mkdtemp(prefix="fuzz_tokenizer_"))
    demo = root / "demo"
    demo.mkdir()
    for name in FILES[:3]:
        shutil.copy(default_model_path() / name, demo / name)

    def one_input(data: bytes) -> None:
        if not data:
            return
        name = FILES[data[0] % len(FILES)]
        d = root / "case"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(demo, d)
        (d / name).write_bytes(data[1:])
        try:
            tok = load_tokenizer(d)
            if tok is not None:
                tok.decode(tok.encode(SAMPLE))
                tok.encode_pieces([("<|open|>user<|sep|>", False), (SAMPLE, True)])
        except MoeStreamError:
            pass

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
