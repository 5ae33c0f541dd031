"""Greedy continuations of the demo Kimi K3 for 20 Python prompts, and how many of them `ast.parse`
accepts (prompt + continuation, cut at the last complete line).

    python3 benchmarks/demo_samples.py [--gen 96] [--show 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moestream
from common import commit, machine
from moestream.default_model import default_model_path

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\ndef ",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n):\n",
    "import sys\n\n\ndef main():\n",
    "def read_file(path):\n",
    "class Point:\n",
    "for i in range(10):\n",
    "def __repr__(self):\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def parse_args(argv=None):\n",
    "class Error(Exception):\n",
    "if __name__ == '__main__':\n",
    "def _check(value, name):\n",
    "with open(filename) as f:\n",
    "def __init__(self, name, value):\n",
    "import re\n\n_pattern = ",
    "def flatten(items):\n",
    "class Node:\n    def __init__(self, value):\n",
    "def quote(s):\n",
]


def parses(text: str) -> bool:
    cut = text[: text.rfind("\n") + 1] if "\n" in text else text
    try:
        ast.parse(cut)
    except SyntaxError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--show", type=int, default=3)
    args = ap.parse_args()
    model = moestream.load(args.model or default_model_path())
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model.path}, greedy, {args.gen} tokens\n")
    ok = 0
    for i, prompt in enumerate(PROMPTS):
        ids = list(model.generate(prompt, args.gen))
        text = prompt + model.detokenize(ids)
        good = parses(text)
        ok += good
        if i < args.show:
            print(f"--- {prompt!r} ({'parses' if good else 'does not parse'})\n{text}\n")
    print(f"{ok} of {len(PROMPTS)} continuations parse (ast.parse, cut at the last complete line)")


if __name__ == "__main__":
    main()
