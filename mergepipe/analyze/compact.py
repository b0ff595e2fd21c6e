"""The compiled compact encoder (numba): one pass over a block's raw bytes writes its compact record
(storage/compact.py defines it) and the exact error norm of every level. ANALYZE and the analysis on the
way call :func:`encode_block` with the arrays they already hold, so compacts cost no extra read."""

from __future__ import annotations

import math

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


@njit(nogil=True, cache=True, fastmath=True)
def _group_sums(buf, k):
    """(sum |d|, max |d|) of a group's first ``k`` deltas."""
    total = 0.0
    mx = np.float32(0)
    for i in range(k):
        ad = abs(buf[i])
        total += ad
        mx = max(mx, ad)
    return total, mx


@njit(nogil=True, cache=True, fastmath=True)
def _errors(buf, q, k, m, a):
    """The squared error of each level over one group (codes ``q`` already computed)."""
    v2 = np.float64(a * np.float32(0.75))
    step = a * np.float32(0.125)
    e1 = e2 = e4 = 0.0
    for i in range(k):
        x = np.float64(abs(buf[i]))
        r1 = x - np.float64(m)
        r2 = x - v2 if q[i] >= 4 else x
        r4 = x - np.float64((np.float32(q[i]) + np.float32(0.5)) * step)
        e1 += r1 * r1
        e2 += r2 * r2
        e4 += r4 * r4
    return e1, e2, e4


@njit(**_C)
def _encode(e, b, n, group, out, errs):
    ng = (n + group - 1) // group
    p = (n + 7) // 8
    sign_at = 2 * ng
    a_at = 2 * ng + p
    hi_at = 4 * ng + p
    mid_at = hi_at + p
    lo_at = mid_at + p
    buf = np.empty(group, np.float32)
    q = np.zeros(group, np.uint8)
    e1 = e2 = e4 = 0.0
    for g in range(ng):
        start = g * group
        k = min(n, start + group) - start
        for i in range(k):
            buf[i] = _delta(e, b, start + i)
        total, mx = _group_sums(buf, k)
        m_bits, m = _bf16(np.float32(total / k))
        a_bits, a = _bf16(mx)
        out[2 * g] = m_bits & 0xFF
        out[2 * g + 1] = m_bits >> 8
        out[a_at + 2 * g] = a_bits & 0xFF
        out[a_at + 2 * g + 1] = a_bits >> 8
        if a > 0:
            for i in range(k):
                q[i] = min(7, int(np.float32(np.float32(8) * abs(buf[i])) / a))
        else:
            q[:k] = 0
        r1, r2, r4 = _errors(buf, q, k, m, a)
        e1 += r1
        e2 += r2
        e4 += r4
        for j in range(0, k, 8):  # groups are multiples of 8 entries: whole bytes of every plane
            sb = hb = mb = lb = 0
            for t in range(min(8, k - j)):
                c = q[j + t]
                sb |= (buf[j + t] < 0) << t
                hb |= (c >> 2) << t
                mb |= ((c >> 1) & 1) << t
                lb |= (c & 1) << t
            byte = (start + j) >> 3
            out[sign_at + byte] = sb
            out[hi_at + byte] = hb
            out[mid_at + byte] = mb
            out[lo_at + byte] = lb
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
