"""Chat on kept state against re-prefilling the whole conversation every turn: per turn, the tokens
prefilled and the seconds to the first reply token either way (the replies are the same tokens).

    python3 benchmarks/chat_turns.py [MODEL] [--turns 6] [--gen 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moestream
from common import commit, machine, table
from moestream.chat import ChatSession

QUESTIONS = [
    "Write a function that parses a CSV line.",
    "Now make it handle quoted fields.",
    "Add type hints.",
    "Write a test for it.",
    "Make it a class with a reset method.",
    "Add a docstring.",
    "Explain the edge cases.",
    "Rewrite it with the csv module.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--gen", type=int, default=48)
    args = ap.parse_args()
    model = moestream.load(args.model)
    chat = ChatSession(model, system="You are a helpful Python programmer.", max_new_tokens=args.gen)
    rows = []
    for q in QUESTIONS[: args.turns]:
        stream, turn = chat.send(q)
        stream.run()
        chat.finish()
        full = chat.state.ids[: turn.kept_tokens + turn.prefilled_tokens]
        t0 = time.perf_counter()
        fresh = list(model.generate(full, 1))
        full_s = time.perf_counter() - t0
        assert fresh[0] == stream.tokens[0]
        rows.append([len(rows) + 1, turn.prefilled_tokens, f"{turn.generation.prefill_seconds:.3f}", len(full),
                     f"{full_s:.3f}", f"{full_s / turn.generation.prefill_seconds:.1f}x"])  # fmt: skip
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model.path}, {args.gen} tokens per reply\n")
    print(table(["turn", "kept: prefilled", "kept: s", "re-prefill: tokens", "re-prefill: s", "ratio"], rows))


if __name__ == "__main__":
    main()
