"""ANALYZE's statistics for sce with ``select_topk`` < 1 (ops/sce.py), gathered beside the Gram statistics.

mergekit's sce keeps, per tensor, the k = int(count_nonzero(var) * select_topk) entries with the largest
variance across the experts (var = torch.var over the stacked task vectors, unbiased=False, float32; here numpy,
equal bit for bit), then
weighs each expert by the mean of its *masked* task vector squared. Both are whole-tensor statistics, so
ANALYZE gathers them for the experts analyzed together (one row set per expert set and select_topk):

- the exact k-th largest variance T by a radix select on its float32 bit pattern (var >= 0): pass one (the
  ANALYZE pass) histograms the top 16 bits and sums each expert's delta^2 per bin (float64); pass two
  counts the low 16 bits (and sums delta^2) of only the bin that holds the k-th largest;
- where entries tied at T straddle the top k, the exact-k cut (ops/topk.py, the same rule as ties): entries
  ordered by variance descending, then flat index ascending, the first k kept; a third pass over the tensor
  finds the block and rank of the cut and the delta^2 of the tied entries kept. (torch.topk on the CPU keeps
  an unspecified subset of the tied entries: there mergekit and MergePipe may keep different ones.)

Memory: the histograms ([32768 x K] float64 sums, [65536 x K] for the selected bin) plus the tensor's
float32 deltas when they fit in ``CACHE_BYTES``; a larger tensor is re-read block by block for passes two and
three (from the page cache ANALYZE's pass just filled). Rows ``("~sce:<topk>:<set>", expert)`` hold each
expert's sum of squared kept deltas; ``~scethr``/``~scecut``/``~scerank`` (under the set's first expert)
the threshold and the cut.
"""

from __future__ import annotations

import threading

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit

from mergepipe.analyze.thresholds import NO_CUT
from mergepipe.catalog.gram import sce_row_keys as row_keys

TOP_BINS = 1 << 15  # a non-negative float32's top 16 bits
CACHE_BYTES = 64 << 20  # a tensor's float32 deltas kept in memory for passes two and three


def variance(deltas) -> np.ndarray:
    """mergekit's per-entry variance across the experts of a [K, n] float32 array, as torch.var(dim=0,
    unbiased=False) computes it on the CPU (float32 [n], equal bit for bit; tests/analyze/
    test_analyze_no_torch.py): Welford's update over the K rows in float64, m2 / K rounded to float32."""
    d = np.ascontiguousarray(deltas, dtype=np.float32)  # NaN/Inf deltas give NaN/Inf, as in torch
    out = np.empty(d.shape[1], dtype=np.float32)
    _welford_nb(d, np.empty(d.shape[1]), np.empty(d.shape[1]), out)
    return out


@njit(nogil=True, cache=True)
def _welford_nb(d, mean, m2, out):
    """:func:`variance` compiled, into ``out``: the same float64 operations per entry (Welford over the K
    rows, in row order; the division kept a division), m2 / K rounded to float32; one pass a row, not six
    (``mean``, ``m2``: float64 scratch of n entries)."""
    k, n = d.shape
    mean[:] = 0.0
    m2[:] = 0.0
    for i in range(k):
        c = float(i + 1)
        for j in range(n):
            x = np.float64(d[i, j])
            delta = x - mean[j]
            mean[j] += delta / c
            m2[j] += (x - mean[j]) * delta
    for j in range(n):
        out[j] = np.float32(m2[j] / float(k))


@njit(nogil=True, cache=True)
def _pass_one(d, hist, sq, block, mean, m2, var, tops):
    """One block of sce's pass one over [K, n] float32 deltas: each entry's variance (:func:`_welford_nb`),
    its top 16 bits counted in ``hist`` (patterns past TOP_BINS, a negative NaN, dropped), each expert's
    delta^2 (float64) summed per bin into ``block`` [K, TOP_BINS] (zeros; entries in flat order, as
    np.bincount adds its weights), then added to ``sq`` (as ``sq[:, i] += bincount``) and ``block`` zeroed
    again. Returns the entries whose variance is 0 (mean, m2, var, tops: scratch of n entries)."""
    k, n = d.shape
    _welford_nb(d, mean, m2, var)
    bits = var.view(np.uint32)
    zeros = 0
    for j in range(n):
        if var[j] == 0:
            zeros += 1
        top = np.int64(bits[j] >> np.uint32(16))
        tops[j] = top
        if top < TOP_BINS:
            hist[top] += 1
    for i in range(k):
        for j in range(n):
            if tops[j] < TOP_BINS:
                x = np.float64(d[i, j])
                block[i, tops[j]] += x * x
        for t in range(TOP_BINS):
            sq[t, i] += block[i, t]
            block[i, t] = 0.0  # zeros again for the next block
    return zeros


_LOCAL = threading.local()


def _thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable uint8 buffer ``name`` of at least ``nbytes`` (a task's SceSelection is made,
    used and done in one thread, one at a time)."""
    buf = getattr(_LOCAL, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        setattr(_LOCAL, name, buf)
    return buf


def keep_count(nonzero: int, topk: float) -> int:
    """mergekit's k: int(count_nonzero(var) * density), a float32 product (torch: an int64 tensor times a
    float is float32: both sides rounded to float32, then multiplied)."""
    return int(np.float32(nonzero) * np.float32(topk))


class SceSelection:
    """One base tensor's sce statistics for the experts (passes) of one ANALYZE task."""

    def __init__(self, binfo, spans, n_experts: int, topks, reread):
        self.spans, self.numel, self.topks = spans, binfo.numel, tuple(topks)
        self.reread = reread  # span -> [K, n] float32 deltas (read again)
        self.hist = np.zeros(TOP_BINS, dtype=np.int64)
        self.sq = np.zeros((TOP_BINS, n_experts))
        self.zeros = 0
        self.cache: list | None = [] if binfo.numel * n_experts * 4 <= CACHE_BYTES else None
        # the cached blocks' floats, in this thread's reusable buffer (fresh pages each tensor: page faults)
        self.cache_buf, self.cache_pos = (_thread_buffer("cache", binfo.numel * n_experts * 4)
                                          if self.cache is not None else None), 0
        size = n_experts * TOP_BINS * 8  # the buffer may be larger (an earlier task had more experts)
        self.block = _thread_buffer("block", size)[:size].view(np.float64).reshape(n_experts, TOP_BINS)
        self.block[:] = 0.0

    def add(self, deltas: np.ndarray) -> None:
        """Pass one, one block: [K, n] float32 deltas (one compiled loop: :func:`_pass_one`)."""
        d = np.asarray(deltas, dtype=np.float32)
        n = d.shape[1]
        work = _thread_buffer("work", 28 * n)  # scratch: mean, m2 (float64), var (float32), tops (int64)
        self.zeros += _pass_one(d, self.hist, self.sq, self.block, work[:8 * n].view(np.float64),
                                work[8 * n:16 * n].view(np.float64), work[16 * n:20 * n].view(np.float32),
                                work[20 * n:28 * n].view(np.int64))
        if self.cache is not None:
            piece = self.cache_buf[self.cache_pos:self.cache_pos + d.nbytes].view(np.float32).reshape(d.shape)
            piece[...] = deltas
            self.cache_pos += d.nbytes
            self.cache.append(piece)

    def _blocks(self):
        return iter(self.cache) if self.cache is not None else (self.reread(s) for s in self.spans)

    def rows(self, ids: list[str], key: str) -> list[tuple[str, str, float]]:
        out = []
        for topk in self.topks:
            thr, cut, rank, sums = self._select(topk)
            keys = row_keys(topk, key)
            out += [(keys["sums"], e, float(v)) for e, v in zip(ids, sums)]
            out += [(keys["thr"], ids[0], thr), (keys["cut"], ids[0], float(cut)), (keys["rank"], ids[0], float(rank))]
        return out

    def _select(self, topk: float) -> tuple[float, int, int, np.ndarray]:
        """(threshold, cut block, cut rank, each expert's sum of kept delta^2) for one select_topk."""
        nonzero = self.numel - self.zeros
        k = keep_count(nonzero, topk)
        if k <= 0:
            return float("inf"), NO_CUT, 0, np.zeros(self.sq.shape[1])
        desc = np.cumsum(self.hist[::-1])
        j = int(np.searchsorted(desc, k))
        top = TOP_BINS - 1 - j
        above = int(desc[j - 1]) if j > 0 else 0
        sums = self.sq[top + 1:].sum(axis=0)
        low_hist, low_sq = self._low_bits(top)
        low_desc = np.cumsum(low_hist[::-1])
        lj = int(np.searchsorted(low_desc, k - above))
        low = (1 << 16) - 1 - lj
        above += int(low_desc[lj - 1]) if lj > 0 else 0
        sums = sums + low_sq[low + 1:].sum(axis=0)
        pattern = (top << 16) | low
        thr = float(np.array([pattern], dtype=np.uint32).view(np.float32)[0])
        equal, m = int(low_hist[low]), k - above
        if m == equal:
            return thr, NO_CUT, 0, sums + low_sq[low]
        cut, rank, tied = self._cut(pattern, m)
        return thr, cut, rank, sums + tied

    def _low_bits(self, top: int) -> tuple[np.ndarray, np.ndarray]:
        """Pass two: counts and delta^2 sums of the low 16 bits of the entries in bin ``top``."""
        k = self.sq.shape[1]
        hist, sq = np.zeros(1 << 16, dtype=np.int64), np.zeros((1 << 16, k))
        for deltas in self._blocks():
            bits = variance(deltas).view(np.uint32).astype(np.int64)
            sel = (bits >> 16) == top
            low = bits[sel] & 0xFFFF
            hist += np.bincount(low, minlength=1 << 16)
            for i in range(k):
                sq[:, i] += np.bincount(low, weights=np.square(deltas[i][sel], dtype=np.float64), minlength=1 << 16)
        return hist, sq

    def _cut(self, pattern: int, m: int) -> tuple[int, int, np.ndarray]:
        """Pass three: the exact-k cut (block index, rank in it) of the first ``m`` entries tied at the
        threshold in flat order, and their delta^2 sums."""
        seen, sums = 0, np.zeros(self.sq.shape[1])
        for span, deltas in zip(self.spans, self._blocks()):
            eq = np.flatnonzero(variance(deltas).view(np.uint32) == pattern)
            if seen + eq.size > m:  # the (m+1)-th tied entry is in this block
                r = m - seen
                sums += np.square(deltas[:, eq[:r]], dtype=np.float64).sum(axis=1)
                return span.index, r, sums
            sums += np.square(deltas[:, eq], dtype=np.float64).sum(axis=1)
            seen += eq.size
        raise AssertionError("fewer tied entries than counted")
