"""numpy's BLAS (OpenBLAS, MKL, BLIS) on the calling thread only.

The engine's C kernels split every weight product among their own threads. numpy's BLAS only serves small
products in between (MLA decode attention's; prefill attention's before gemm_f32), and its worker threads keep
spinning for a while after each call, taking the cores from the kernels that follow: beside them a 128-token
prefill of the 8-layer Qwen3-30B-A3B-width benchmark model ran at 87-93 tok/s, without them at 115-131.
"""

from __future__ import annotations

import threadpoolctl

_done = False


def single_threaded_blas() -> None:
    """Limits numpy's BLAS to one thread for the rest of the process (once; later calls do nothing)."""
    global _done
    if not _done:
        threadpoolctl.threadpool_limits(1, user_api="blas")
        _done = True
