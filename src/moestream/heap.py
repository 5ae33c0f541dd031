"""glibc's malloc tuned for a forward pass's arrays.

Every layer of a prefill makes and drops arrays of megabytes (its activations, the experts' gate, up and
down outputs, the kernels' prepared inputs). By default glibc serves the largest from fresh mappings and
hands freed heap back to the system soon after, so the next layer's arrays arrive as fresh pages and
every first write to each 4 KiB page is a page fault: on the 8-layer Qwen3-30B-A3B-width benchmark model,
about 16,000 faults (64 MB of zeroed pages) per 128-token prefill, a tenth of its time. With arrays up to
32 MiB taken from the heap and up to 256 MiB of freed heap kept for the next layer, the pages are reused.
The heap still never holds more than the largest forward pass needed at once (the activation scratch the
memory planner counts); it only stops shrinking between passes.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 256 << 20

_done = False


def reuse_freed_heap() -> bool:
    """Sets the two thresholds once per process; False where the C library is not glibc (no mallopt) or
    refuses them (the defaults stay, which is only slower)."""
    global _done
    if _done:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
