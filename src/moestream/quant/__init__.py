"""Weight formats: the numpy reference of every format (the oracle for the C kernels) and the
Weight object the models multiply with."""

from .formats import FORMATS, Format, dequantize_reference
from .weight import Weight, matmul_many

__all__ = ["FORMATS", "Format", "Weight", "dequantize_reference", "matmul_many"]
