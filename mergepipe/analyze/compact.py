"""The compiled compact encoder (numba): one pass over a block's raw bytes writes its compact record
(storage/compact.py defines it) and the exact error norm of every level. ANALYZE and the analysis on the
way call :func:`encode_block` with the arrays they already hold, so compacts cost no extra read."""

from __future__ import annotations

import math

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit

from mergepipe.analyze.kernels import _delta
from mergepipe.storage.compact import groups, level_bytes, plane_bytes

_C = dict(nogil=True, cache=True)


@njit(**_C)
def _bf16(x):
    """float32 -> (bfloat16 bits, the float32 value they stand for), round to nearest even."""
    u = np.uint64(np.float32(x).view(np.uint32))
    r = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    bits = np.uint16(r)
    return bits, np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(**_C)
def _layout(n, group):
    """(groups, offsets of the sign plane, the a_g scales, and the three magnitude planes) of a record."""
    ng = (n + group - 1) // group
    p = (n + 7) // 8
    return ng, 2 * ng, 2 * ng + p, 4 * ng + p, 4 * ng + 2 * p, 4 * ng + 3 * p


PACK = np.uint64(0x0102040810204080)  # (8 bytes of 0/1, as a little-endian uint64 * PACK) >> 56: their bits


@njit(nogil=True, cache=True, fastmath=True)
def _encode(e, b, n, group, out, errs):
    """fastmath: the sums may be reassociated (their float64 rounding, far below the bf16 of the mean and the
    float32 of the errors' use); every value that is stored is computed exactly as storage/compact.py defines."""
    ng, sign_at, a_at, hi_at, mid_at, lo_at = _layout(n, group)
    buf = np.empty(group, np.float32)
    planes = np.zeros((4, group), np.uint8)
    words = planes.view(np.uint64)  # 8 entries per word
    e1 = e2 = e4 = 0.0
    for g in range(ng):
        start = g * group
        k = min(n, start + group) - start
        total = 0.0
        mx = np.float32(0)
        for i in range(k):
            d = _delta(e, b, start + i)
            buf[i] = d
            ad = abs(d)
            total += ad
            mx = max(mx, ad)
        m_bits, m = _bf16(np.float32(total / k))
        a_bits, a = _bf16(mx)
        out[2 * g] = m_bits & 0xFF
        out[2 * g + 1] = m_bits >> 8
        out[a_at + 2 * g] = a_bits & 0xFF
        out[a_at + 2 * g + 1] = a_bits >> 8
        inv = np.float32(8) / a if a > 0 else np.float32(0)
        v2 = np.float64(a * np.float32(0.75))
        step = a * np.float32(0.125)
        m64 = np.float64(m)
        for i in range(k):
            d = buf[i]
            ad = abs(d)
            q = min(7, int(ad * inv))
            planes[0, i] = d < 0
            planes[1, i] = q >> 2
            planes[2, i] = (q >> 1) & 1
            planes[3, i] = q & 1
            x = np.float64(ad)
            r1 = x - m64
            r2 = x - v2 if q >= 4 else x
            r4 = x - np.float64((np.float32(q) + np.float32(0.5)) * step)
            e1 += r1 * r1
            e2 += r2 * r2
            e4 += r4 * r4
        nb = (k + 7) // 8
        for i in range(k, nb * 8):
            planes[0, i] = planes[1, i] = planes[2, i] = planes[3, i] = 0
        byte = start >> 3
        for j in range(nb):
            out[sign_at + byte + j] = (words[0, j] * PACK) >> np.uint64(56)
            out[hi_at + byte + j] = (words[1, j] * PACK) >> np.uint64(56)
            out[mid_at + byte + j] = (words[2, j] * PACK) >> np.uint64(56)
            out[lo_at + byte + j] = (words[3, j] * PACK) >> np.uint64(56)
    errs[0] = math.sqrt(e1)
    errs[1] = math.sqrt(e2)
    errs[2] = math.sqrt(e4)


def encode_block(e: np.ndarray, b: np.ndarray | None, group: int, level: int) -> tuple[bytes, list[float]]:
    """(record up to ``level`` bits, [error norm at each level <= ``level``]) of the block whose raw expert
    array is ``e`` and base array ``b`` (None: ``e`` is the delta), as analyze/kernels.py views them."""
    n = e.size
    out = np.zeros(level_bytes(n, group, 4), dtype=np.uint8)
    errs = np.zeros(3, dtype=np.float64)
    _encode(e, b, n, group, out, errs)
    levels = [lv for lv in (1, 2, 4) if lv <= level]
    return out[:level_bytes(n, group, level)].tobytes(), [float(errs[(1, 2, 4).index(lv)]) for lv in levels]


__all__ = ["encode_block", "groups", "plane_bytes"]


@njit(**_C)
def _bf16_at(rec, at):
    bits = np.uint32(rec[at]) | (np.uint32(rec[at + 1]) << np.uint32(8))
    return np.uint32(bits << np.uint32(16)).view(np.float32)


@njit(**_C)
def _decode(rec, n, group, level, out):
    ng, sign_at, a_at, hi_at, mid_at, lo_at = _layout(n, group)
    for g in range(ng):
        start = g * group
        stop = min(n, start + group)
        if level == 1:
            m = _bf16_at(rec, 2 * g)
            for i in range(start, stop):
                neg = (rec[sign_at + (i >> 3)] >> (i & 7)) & 1
                out[i] = -m if neg else m
            continue
        a = _bf16_at(rec, a_at + 2 * g)
        v2 = a * np.float32(0.75)
        step = a * np.float32(0.125)
        for i in range(start, stop):
            byte, bit = i >> 3, i & 7
            neg = (rec[sign_at + byte] >> bit) & 1
            hi = (rec[hi_at + byte] >> bit) & 1
            if level == 2:
                val = v2 if hi else np.float32(0)
            else:
                q = (hi << 2) | (((rec[mid_at + byte] >> bit) & 1) << 1) | ((rec[lo_at + byte] >> bit) & 1)
                val = (np.float32(q) + np.float32(0.5)) * step
            out[i] = -val if neg else val


def decode_block(record, n: int, group: int, level: int) -> np.ndarray:
    """The compiled decoder: the same float32 values as storage/compact.decode (the written definition)."""
    out = np.empty(n, dtype=np.float32)
    _decode(np.frombuffer(record, dtype=np.uint8), n, group, level, out)
    return out
