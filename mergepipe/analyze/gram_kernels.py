"""Compiled kernels of ANALYZE's Gram pass (analyze/gram.py): the float64 Gram matrix of the experts' deltas and
ramplus_tl's counts of shared and unique entries. Self-contained (numba's cache keys a kernel by its own file),
moved out of analyze/kernels.py."""

from __future__ import annotations

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit

_C = dict(nogil=True, cache=True)


@njit(nogil=True, cache=True, fastmath=True)
def gram_accumulate(rows, g):
    """g[i, j] += sum_k rows[i, k] * rows[j, k] in float64 (rows: float32 or float64 [m, n]; the Gram
    statistics of analyze/gram.py). fastmath only lets the float64 sums be vectorized (reassociated)."""
    m, n = rows.shape
    for i in range(m):
        for j in range(i, m):
            s = 0.0
            for k in range(n):
                s += np.float64(rows[i, k]) * np.float64(rows[j, k])
            g[i, j] += s
            if j != i:
                g[j, i] += s


@njit(**_C)
def shared_unique_counts(deltas, epsilon, shared, unique):
    """Per expert (row of deltas, float32 [K, n]): entries with |d| > epsilon that another expert also
    changes (shared) or only it changes (unique). Row by row, so every pass is sequential in memory."""
    k, n = deltas.shape
    counts = np.zeros(n, dtype=np.int32)
    for i in range(k):
        for c in range(n):
            counts[c] += abs(deltas[i, c]) > epsilon
    for i in range(k):
        s = 0
        u = 0
        for c in range(n):
            if abs(deltas[i, c]) > epsilon:
                if counts[c] > 1:
                    s += 1
                else:
                    u += 1
        shared[i] += s
        unique[i] += u
