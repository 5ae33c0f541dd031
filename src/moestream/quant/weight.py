"""A weight matrix [rows, cols] in its stored format, multiplied by the C kernels straight from the
stored bytes (a memory map of the checkpoint, or a buffer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from .. import _C
from .blocks import LAYOUTS as BLOCK_FORMATS
from .formats import FORMATS, FP8_BLOCK, MXFP4_BLOCK, Format, dequantize_reference, fp8_scale_shape

_NP_TO_FORMAT = {
    np.dtype(np.float32): "f32",
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(np.float16): "f16",
    np.dtype(ml_dtypes.float8_e4m3fn): "fp8",
}


class Weight:
    """W [rows, cols]; y = W @ x computed as matmul(x [T, cols]) -> [T, rows]."""

    __slots__ = ("_check", "_validate", "cols", "data", "fmt", "rows", "scales")

    def __init__(self, data: np.ndarray, scales: np.ndarray | None = None, fmt: str | None = None):
        """data [rows, cols] of a float dtype (the format follows the dtype), or with fmt="mxfp4" the packed
        uint8 [rows, cols/2] and its E8M0 scales uint8 [rows, cols/32]."""
        if data.ndim != 2:
            raise ValueError(f"a weight matrix must be 2-D, got shape {data.shape}")
        name = fmt or _NP_TO_FORMAT.get(data.dtype)
        if name is None:
            raise ValueError(f"no kernel for weights of dtype {data.dtype}")
        self.fmt: Format = FORMATS[name]
        self.rows, self.cols = int(data.shape[0]), int(data.shape[1])
        if name == "int4":
            if scales is None or data.dtype not in (np.int32, np.uint8):
                raise ValueError("int4 weights are int32 (or uint8) packed nibbles with per-32 scales")
            data = np.ascontiguousarray(data).view(np.uint8)
            self.cols = 2 * int(data.shape[1])
            if tuple(scales.shape) != (self.rows, self.cols // 32):
                raise ValueError(
                    f"int4 scales have shape {list(scales.shape)}, expected {[self.rows, self.cols // 32]}"
                )
            scales = np.ascontiguousarray(scales, dtype=np.float32)
        if name in BLOCK_FORMATS:
            if data.dtype != np.uint8 or data.shape[1] % self.fmt.block_bytes:
                raise ValueError(f"{name} rows must be whole {self.fmt.block_bytes}-byte blocks of uint8")
            self.cols = data.shape[1] // self.fmt.block_bytes * self.fmt.block
        if name == "mxfp4":
            if data.dtype != np.uint8 or scales is None or scales.dtype != np.uint8:
                raise ValueError("mxfp4 weights are uint8 packed nibbles with uint8 E8M0 scales")
            self.cols = 2 * int(data.shape[1])
            if tuple(scales.shape) != (self.rows, self.cols // MXFP4_BLOCK):
                raise ValueError(
                    f"mxfp4 scales have shape {list(scales.shape)}, expected {[self.rows, self.cols // MXFP4_BLOCK]}"
                )

        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        self.data = data
        if self.fmt.name == "fp8":
            if scales is None:
                raise ValueError("fp8 weights need block scales")
            want = fp8_scale_shape(self.rows, self.cols)
            if tuple(scales.shape) != want:
                raise ValueError(f"fp8 block scales have shape {list(scales.shape)}, expected {list(want)}")
            scales = np.ascontiguousarray(scales, dtype=np.float32)
        elif name == "mxfp4":
            assert scales is not None
            scales = np.ascontiguousarray(scales)
        self.scales = scales
        self._validate: Callable[[Weight], None] | None = None
        self._check: Callable[[Weight], None] | None = None

    def validate_lazily(self, check: Callable[[Weight], None]) -> None:
        """check(weight) runs once, before the first product (to defer reading a large mapped tensor);
        a copy of the weight over other bytes (an expert cache slot) is checked again."""
        self._validate = self._check = check

    def _ready(self) -> None:
        if self._validate is not None:
            check, self._validate = self._validate, None
            check(self)

    @property
    def row_align(self) -> int:
        """Row slices must start at a multiple of this (fp8 scales cover 128 rows)."""
        return FP8_BLOCK if self.fmt.name == "fp8" else 1

    def row_slice(self, r0: int, r1: int) -> Weight:
        """Rows [r0, r1) as a Weight over the same bytes (no copy); each output row is computed the same
        way as in the whole matrix, so a product by slices equals the product by the whole."""
        if r0 % self.row_align or not 0 <= r0 < r1 <= self.rows:
            raise ValueError(f"bad row slice [{r0}, {r1}) of {self.rows} rows (aligned to {self.row_align})")
        w = Weight.__new__(Weight)
        w.fmt, w.rows, w.cols = self.fmt, r1 - r0, self.cols
        w.data = self.data[r0:r1]
        if self.scales is None:
            w.scales = None
        elif self.fmt.name == "fp8":
            w.scales = self.scales[r0 // FP8_BLOCK : -(-r1 // FP8_BLOCK)]
        else:
            w.scales = self.scales[r0:r1]
        w._check = self._check
        w._validate = self._check if self._validate is not None else None
        return w

    def kernel_args(self) -> tuple[int, np.ndarray, np.ndarray | None, int, int]:
        """(format id, data, scales, rows, cols): the matrix as the C kernels take it, checked first if it is
        checked lazily."""
        if self._validate is not None:
            self._ready()
        return (self.fmt.id, self.data, self.scales, self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (int(self.scales.nbytes) if self.scales is not None else 0)

    def matmul(self, x: np.ndarray, threads: int = 1) -> np.ndarray:
        """x [T, cols] f32 -> [T, rows] f32."""
        self._ready()
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x[None]
        out = np.empty((x.shape[0], self.rows), np.float32)
        _C.matmul(self.fmt.id, self.data, self.scales, self.rows, self.cols, x, out, threads)
        return out

    def combine_rows(self, coef: np.ndarray, first: int, stride: int, threads: int = 1) -> np.ndarray:
        """coef [H, N] -> [H, cols]: out[h] = sum over n of coef[h, n] * W[first + h * stride + n], each row
        dequantized by the C kernels and added in n order with fused multiply-adds (x^T W per block of rows,
        without a dequantized copy of the matrix; MLA's absorbed decode)."""
        self._ready()
        coef = np.ascontiguousarray(coef, dtype=np.float32)
        H, N = coef.shape
        out = np.empty((H, self.cols), np.float32)
        _C.combine_rows(
            self.fmt.id, self.data, self.scales, self.rows, self.cols, coef, out, first, stride, H, N, threads
        )
        return out

    def block_rows_matmul(self, x: np.ndarray, first: int, stride: int, count: int, threads: int = 1) -> np.ndarray:
        """x [H, cols] -> [H, count]: out[h] = x[h] @ W[first + h * stride : ... + count].T, in one pass of
        the kernels, each row with the bits of the whole matrix's product. fp8 blocks of rows must start at
        multiples of 128 (row_align)."""
        self._ready()
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], count), np.float32)
        _C.block_rows_matmul(
            self.fmt.id, self.data, self.scales, self.rows, self.cols, x, out, first, stride, x.shape[0], count, threads
        )
        return out

    def dequantize(self, threads: int = 1) -> np.ndarray:
        self._ready()
        out = np.empty((self.rows, self.cols), np.float32)
        _C.dequant(self.fmt.id, self.data, self.scales, self.rows, self.cols, out, threads)
        return out

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """Selected rows as f32 (embedding lookups): the rows' bytes gathered and dequantized by the C
        kernels (bit for bit the numpy reference), without the whole-tensor check of a first product."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.fmt.name in ("mxfp4", "int4") or self.fmt.name in BLOCK_FORMATS:
            out = np.empty((len(rows), self.cols), np.float32)
            if len(rows):
                scales = None if self.scales is None else np.ascontiguousarray(self.scales[rows])
                _C.dequant(self.fmt.id, np.ascontiguousarray(self.data[rows]), scales, len(rows), self.cols, out, 1)
            return out
        if self.fmt.name == "fp8":
            assert self.scales is not None
            s = np.repeat(self.scales[rows // FP8_BLOCK], FP8_BLOCK, axis=1)[:, : self.cols]  # [n, cols]
            return (self.data[rows].astype(np.float32) * s).astype(np.float32)
        return self.data[rows].astype(np.float32)

    def reference(self) -> np.ndarray:
        return dequantize_reference(self.fmt, self.data, self.scales, self.rows, self.cols)


def matmul_many(products: Sequence[tuple[Weight, np.ndarray, np.ndarray]], threads: int = 1) -> None:
    """out = x @ W.T for each (W, x [T, cols] f32, out [T, rows] f32 C-contiguous) in one parallel pass of the
    kernels: one hand-off to the threads instead of one per product, and the activations prepared once for
    the products that share x. Each out holds the same bits as W.matmul(x)."""
    # the C side checks that x and out are C-contiguous float32 and that every size adds up
    _C.matmul_many([(*w.kernel_args(), x, out) for w, x, out in products], threads)
