"""atheris target for chat templates: the fuzzer's bytes are a template, rendered and encoded on a small
conversation with the demo's tokenizer under a short time limit. Only the project's own errors may come
out, and no rendering may outlive its bound by much.

    python3 tests/fuzz/fuzz_template.py [atheris/libFuzzer options, e.g. -max_total_time=600]
"""

from __future__ import annotations

import sys
import time

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi <|open|>system<|sep|>"},
    {"role": "assistant", "content": "  hello  "},
]
TIME_LIMIT = 0.05


def main() -> None:
    import atheris

    with atheris.instrument_imports():
        from moestream.chat import ChatTemplate
        from moestream.default_model import default_model_path
        from moestream.errors import MoeStreamError
        from moestream.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    assert tok is not None

    def one_input(data: bytes) -> None:
        source = data.decode("utf-8", errors="replace")
        start = time.monotonic()
        try:
            ChatTemplate(source, bos_token="[BOS]", time_limit=TIME_LIMIT).encode(MESSAGES, tok)
        except MoeStreamError:
            pass
        took = time.monotonic() - start
        if took > 20 * TIME_LIMIT + 1.0:
            raise AssertionError(f"rendering took {took:.2f} s, beyond its bound of {TIME_LIMIT} s")

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
