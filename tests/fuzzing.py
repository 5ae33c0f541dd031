"""Seeded mutation fuzzing for the loaders: every input a parser can be handed must end in a value or in
one of the project's own errors (MoeStreamError, which the CLI prints as one line), never in a raw
exception. The budgets are fixed and the generator is seeded, so a failure replays exactly.

Two mutators: `byte_mutations` (flips, overwrites with interesting values, truncation, insertion,
duplicated or deleted runs) for binary and text files, and `json_mutations` (a value replaced by one
of another type or an extreme one, keys added or removed, nesting changed) for JSON documents, which
byte mutations mostly turn into syntax errors that never reach the validation behind the parser."""

from __future__ import annotations

import copy
import json
import os
import random
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from moestream.errors import MoeStreamError

# Multiplies every fuzz test's budget: the default runs in seconds, a larger scale is for longer runs.
SCALE = int(os.environ.get("MOESTREAM_FUZZ_SCALE", "1"))

INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, ord("{"), ord("}"), ord('"'), ord("\n"), ord("-")]
INTERESTING_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**64, -(2**63), 10**400]
INTERESTING_VALUES: list[Any] = [
    *INTERESTING_INTS,
    0.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    -float("inf"),
    "",
    "abc",
    "../../etc/passwd",
    "/etc/passwd",
    "\x00",
    "\ud800",
    None,
    True,
    False,
    [],
    [1, 2],
    {},
    {"a": 1},
]


def byte_mutations(seed_input: bytes, n: int, seed: int) -> Iterator[bytes]:
    """n mutants of seed_input, each 1-4 mutations deep."""
    rng = random.Random(seed)
    for _ in range(n):
        data = bytearray(seed_input)
        for _ in range(rng.randint(1, 4)):
            _mutate_bytes(data, rng)
        yield bytes(data)


def _mutate_bytes(data: bytearray, rng: random.Random) -> None:
    op = rng.randrange(7)
    if not data:
        data.extend(rng.randbytes(rng.randint(1, 16)))
        return
    i = rng.randrange(len(data))
    if op == 0:  # flip a bit
        data[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # an interesting byte
        data[i] = rng.choice(INTERESTING_BYTES)
    elif op == 2:  # an interesting 8-byte little-endian integer (headers carry u64 lengths)
        v = rng.choice(INTERESTING_INTS) % 2**64
        data[i : i + 8] = v.to_bytes(8, "little")
    elif op == 3:  # truncate
        del data[i:]
    elif op == 4:  # insert random bytes
        data[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 5:  # duplicate a run
        j = rng.randrange(i, min(len(data), i + 64) + 1)
        data[i:i] = data[i:j]
    else:  # delete a run
        del data[i : i + rng.randint(1, 64)]


def json_mutations(doc: Any, n: int, seed: int) -> Iterator[Any]:
    """n mutants of a JSON document (a fresh deep copy each), each 1-3 mutations deep."""
    rng = random.Random(seed)
    text = json.dumps(doc)
    for _ in range(n):
        mutant = json.loads(text)
        for _ in range(rng.randint(1, 3)):
            mutant = _mutate_json(mutant, rng)
        yield mutant


def _containers(doc: Any) -> list[Any]:
    out, stack = [], [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, dict | list):
            out.append(x)
            stack.extend(x.values() if isinstance(x, dict) else x)
    return out


def _mutate_json(doc: Any, rng: random.Random) -> Any:
    places = _containers(doc)
    if not places or rng.random() < 0.02:
        return _fresh_value(rng)  # the whole document replaced
    c = rng.choice(places)
    if not c:
        if isinstance(c, dict):
            c[rng.choice(["x", "", "layers"])] = _fresh_value(rng)
        else:
            c.append(_fresh_value(rng))
        return doc
    key: Any = rng.choice(list(c)) if isinstance(c, dict) else rng.randrange(len(c))
    op = rng.randrange(6)
    if op <= 2:  # a value of another type or an extreme one
        c[key] = _fresh_value(rng)
    elif op == 3:  # removed
        del c[key]
    elif op == 4:  # an unknown key or an extra element
        if isinstance(c, dict):
            c[f"{key}_extra"] = _fresh_value(rng)
        else:
            c.insert(key, _fresh_value(rng))
    else:  # a number nudged: off by one, negated, or scaled
        v = c[key]
        if isinstance(v, int | float) and not isinstance(v, bool):
            c[key] = rng.choice([v + 1, v - 1, -v, v * 1000, v // 2 if isinstance(v, int) else v / 2])
        else:
            c[key] = [v] if rng.random() < 0.5 else {"v": v}
    return doc


def _fresh_value(rng: random.Random) -> Any:
    """A copy of an interesting value: the shared [] and {} must not enter two places of a mutant, or a later
    mutation appends a container into itself and the mutant becomes a cycle."""
    return copy.deepcopy(rng.choice(INTERESTING_VALUES))


def dump_json(doc: Any) -> bytes:
    """JSON bytes for a mutant (NaN and Infinity as Python writes them, lone surrogates escaped)."""
    return json.dumps(doc).encode()


def expect_only_own_errors(
    parse: Callable[[Any], object], inputs: Iterator[Any], allowed: tuple[type[BaseException], ...] = ()
) -> int:
    """Feeds every input to parse; returns how many it accepted. Any exception that is not a
    MoeStreamError (or in `allowed`) fails with the input's index and the traceback, so it replays."""
    accepted = 0
    for i, x in enumerate(inputs):
        try:
            parse(x)
        except (MoeStreamError, *allowed):
            continue
        except Exception as e:  # the finding: shown with its input number and where it was raised
            tb = "".join(traceback.format_exception(e)[-6:])
            raise AssertionError(f"input {i} ({x!r:.200}) raised {type(e).__name__}: {e}\n{tb}") from None
        accepted += 1
    return accepted
