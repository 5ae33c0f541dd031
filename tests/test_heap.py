"""heap.py: with glibc's thresholds set, a forward pass's arrays reuse the pages freed by the last one
instead of faulting in fresh ones (each pattern runs in a fresh interpreter, so the default is measured)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PATTERN = """
import resource, sys
import numpy as np
from moestream.heap import reuse_freed_heap
if sys.argv[1] == "tuned":
    assert reuse_freed_heap()
def layer():  # what a prefill layer does: arrays of megabytes made, written and dropped
    a = np.ones(8 << 18, np.float32)  # 8 MB
    b = [np.ones(6 << 18, np.float32) for _ in range(3)]  # 3 x 6 MB
    return float(a[-1] + sum(x[-1] for x in b))
for _ in range(3):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_arrays_are_reused_without_page_faults():
    default, tuned = faults("default"), faults("tuned")
    assert default > 20 * 1000  # 20 layers of 26 MB: the default hands the heap back and faults it in again
    assert tuned < 500
