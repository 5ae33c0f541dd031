"""Hit rates of the expert cache's replacement policies on recorded routing traces, beside Belady's
optimum (the best any policy could do knowing the future), at several cache sizes.

    moestream run MODEL --prompt-file P --gen 128 --trace trace.jsonl
    python3 benchmarks/cache_policies.py trace.jsonl [more.jsonl ...] [--slots 0.1,0.25,0.5]

Slot counts are fractions of the distinct experts the trace touches (or absolute counts if > 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import commit, machine, table
from moestream.runtime.policies import POLICIES, belady_hits, replay


def load_trace(path: Path) -> list[tuple[int, int]]:
    keys = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        keys += [(int(r["layer"]), int(e)) for e in r["experts"]]
    return keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--slots", default="0.1,0.25,0.5")
    args = ap.parse_args()
    print(f"machine: {machine()}\ncommit: {commit()}\n")
    rows = []
    for path in args.traces:
        keys = load_trace(path)
        distinct = len(set(keys))
        for f in (float(s) for s in args.slots.split(",")):
            slots = int(f) if f > 1 else max(1, round(f * distinct))
            row: list[object] = [path.name, len(keys), distinct, slots]
            for cls in POLICIES.values():
                row.append(f"{100 * replay(cls(), keys, slots) / len(keys):.1f}%")
            row.append(f"{100 * belady_hits(keys, slots) / len(keys):.1f}%")
            rows.append(row)
    print(table(["trace", "requests", "experts", "slots", *POLICIES, "belady"], rows))


if __name__ == "__main__":
    main()
