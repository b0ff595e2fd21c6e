"""The output guard: NaN and Inf elements of a raw block, counted on its output bytes in one compiled
pass (numba), and told apart for error messages."""

from __future__ import annotations

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy; before any @njit)
import numpy as np
from numba import njit

# (unsigned view, exponent mask, largest finite value) per output dtype: an element is Inf or NaN exactly
# when its exponent bits are all ones
FLOAT_BITS = {"BF16": (np.uint16, 0x7F80, 3.3895313892515355e38), "F16": (np.uint16, 0x7C00, 65504.0),
               "F32": (np.uint32, 0x7F800000, 3.4028234663852886e38),
               "F64": (np.uint64, 0x7FF0000000000000, 1.7976931348623157e308)}


@njit(nogil=True, cache=True)
def _count_exp_all_ones(bits, mask):
    n = 0
    for i in range(bits.size):
        n += (bits[i] & mask) == mask
    return n


def _bits(raw, dtype: str) -> np.ndarray:
    view, _, _ = FLOAT_BITS[dtype]
    arr = np.frombuffer(raw, dtype=np.uint8)
    if arr.ctypes.data % np.dtype(view).itemsize:
        arr = arr.copy()
    return arr.view(view)


def nonfinite_count(raw, dtype: str) -> int:
    """NaN and Inf elements of a raw block in safetensors dtype ``dtype`` (0 for non-float dtypes): one
    compiled pass over the block's output bytes, so it also sees a finite float32 result that overflowed
    to Inf when it was rounded to bf16 or fp16."""
    spec = FLOAT_BITS.get(dtype)
    if spec is None:
        return 0
    return int(_count_exp_all_ones(_bits(raw, dtype), spec[0](spec[1])))


def nonfinite_kinds(raw, dtype: str) -> tuple[int, int, float]:
    """(NaN count, Inf count, largest finite value of the dtype) of a raw block (for error messages)."""
    view, mask, largest = FLOAT_BITS[dtype]
    bits = _bits(raw, dtype)
    sign = view(1) << view(8 * np.dtype(view).itemsize - 1)
    mag = bits & ~sign
    return int((mag > view(mask)).sum()), int((mag == view(mask)).sum()), largest
