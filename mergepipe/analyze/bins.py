"""Compiled helpers over a finished (expert, tensor) histogram of |delta| patterns (analyze/stats.py's finish):
the lanes added up, the L1 sums of the common entries folded in, the walk down from the top bin that
locates every k-th largest. Kernels of the pass over the data are in analyze/kernels.py."""

from __future__ import annotations

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit

from mergepipe.analyze.kernels import _C


@njit(**_C)
def fold_l1(total, lowcnt, l1hist, values, lo, hi):
    """l1hist[j] += (entries of bin j whose low 16 bits are zero: total[j] - lowcnt[j]) * values[j] (the bin's
    value, BIN_VALUES) for j in [lo, hi), after block_stats with ``lowcnt``. The same in every bit as adding
    them one by one: every sum within one bin is exact (its values are multiples of one float32 ulp; fewer
    than 2**29 of them, the caller's condition), and skipping that add spares block_stats a float64 add per
    entry chained on a hot bin."""
    for j in range(lo, hi):
        c = total[j] - lowcnt[j]
        if c > 0:
            l1hist[j] += np.float64(c) * values[j]


# float64 value of the float32 pattern j << 16, for each top-16 bin j
with np.errstate(invalid="ignore"):  # the NaN patterns (their value is never used but as NaN)
    BIN_VALUES = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)





@njit(**_C)
def lane_sums(hist, out, upto):
    """out[j] = sum over the lanes of hist[:, j] (int64) for j < upto, 0 above (no bin at or above ``upto``
    counts anything); lane by lane, so every loop is sequential. Returns (lo, hi): the bins from the first to
    one past the last that count anything ((0, 0): none)."""
    n = min(upto, hist.shape[1])
    out[n:] = 0
    for j in range(n):
        out[j] = hist[0, j]
    for lane in range(1, hist.shape[0]):
        for j in range(n):
            out[j] += hist[lane, j]
    lo = 0
    while lo < n and out[lo] == 0:
        lo += 1
    hi = n
    while hi > lo and out[hi - 1] == 0:
        hi -= 1
    return lo, hi


@njit(**_C)
def walk_bins(hist, l1hist, ks, j, n_hi, s_hi):
    """For sorted ks, from the top bin of ``hist`` (int64 counts per bin) down: j[q] = how many bins from the
    top hold the ks[q]-th largest (np.searchsorted(cumsum(hist[::-1]), k)), n_hi[q] the entries in the bins
    above it and s_hi[q] the sum of ``l1hist`` over those bins, added in the same order as np.cumsum."""
    q = 0
    cum = 0
    s = 0.0
    n = hist.size
    for idx in range(n):
        nxt = cum + hist[n - 1 - idx]
        while q < ks.size and ks[q] <= nxt:
            j[q] = idx
            n_hi[q] = cum
            s_hi[q] = s
            q += 1
        if q == ks.size:
            return
        cum = nxt
        s += l1hist[n - 1 - idx]
    while q < ks.size:
        j[q] = n
        n_hi[q] = cum
        s_hi[q] = s
        q += 1
