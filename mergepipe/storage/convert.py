"""Raw float blocks converted between safetensors dtypes with numpy, bit for bit as torch's ``.to``
(what mergekit writes): round to nearest, ties to even, at each step torch takes.

bf16 is not a numpy dtype: a bf16 value is the high half of a float32, so widening is a shift and
narrowing float32 to bf16 rounds the low 16 bits away to nearest even (torch's ``round_to_nearest_even``;
NaN becomes a quiet NaN). torch converts float64 to bf16 or fp16 through float32 (two roundings), so
this does too. float32 <-> fp16 and the widenings are numpy's own conversions (IEEE, nearest even).
"""

from __future__ import annotations

import numpy as np

_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_BF16_NAN = np.uint16(0x7FC0)


def _values(raw, code: str) -> np.ndarray:
    """The block's values: float64/float32/float16, bf16 widened (exactly) to float32."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if code == "BF16":
        bits = data.view(np.uint16) if data.ctypes.data % 2 == 0 else data.copy().view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    dtype = np.dtype(_NUMPY[code])
    if data.ctypes.data % dtype.itemsize:
        data = data.copy()
    return data.view(dtype)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) of float32 ``values``: nearest, ties to even; NaN -> 0x7FC0 (as torch)."""
    u = values.view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = _BF16_NAN
    return rounded


def convert(raw, src: str, dst: str) -> np.ndarray:
    """The bytes (a uint8 array) of the raw block ``raw`` of float dtype ``src`` in float dtype ``dst``
    (safetensors codes F64, F32, F16, BF16), rounded as torch's ``.to(dst)``: a value beyond ``dst``'s
    range becomes Inf, as there (the caller's output guard refuses it). NaN stays NaN (its payload bits
    may differ from torch's; a block holding NaN is never published)."""
    values = _values(raw, src)
    with np.errstate(over="ignore", invalid="ignore"):
        if dst == "BF16":
            if values.dtype != np.float32:
                values = values.astype(np.float32)  # float64 and fp16 through float32, as torch
            return float32_to_bf16(values).view(np.uint8)
        if dst == "F16" and values.dtype == np.float64:
            values = values.astype(np.float32)  # torch: float64 -> float32 -> fp16
        return values.astype(_NUMPY[dst]).view(np.uint8)
