"""Exact top-k magnitude thresholds by a radix select on the float32 bit pattern of |delta|: the k-th
largest from a histogram of the top 16 bits, then the low 16 bits of only the bins that hold it."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from mergepipe.analyze import select_kernels
from mergepipe.analyze.bins import walk_bins


HIST_BINS = 1 << 15  # top 16 bits of a non-negative float32: sign 0, so 2**15 bins
class DenseSelection:
    """Counts of the low 16 bits of the entries in a few top-16 bins: [slots, 65536]."""

    def __init__(self, dense: np.ndarray):
        self.dense = dense

    def kth_low_bits(self, slots: list[int], ranks: list[int]) -> list[int]:
        """The low 16 bits of the rank-th largest entry (1-based) within each slot."""
        return select_kernels.kth_from_top(self.dense, np.array(slots, dtype=np.int64),
                                    np.array(ranks, dtype=np.int64)).tolist()

    def split(self, slot: int, top: int, low: int, count: int) -> tuple[int, float, int]:
        """(entries above, their sum, entries equal) to the pattern ``top << 16 | low`` in its bin."""
        row = self.dense[slot]
        above = row[low + 1:]
        return int(above.sum()), _pattern_sum(top, np.nonzero(above)[0] + low + 1, above[above != 0]), int(row[low])

    def split_many(self, slots, tops, lows, counts) -> list[tuple[int, float, int]]:
        return [self.split(*q) for q in zip(slots, tops, lows, counts)]


class KeySelection:
    """The entries of a few top-16 bins whose low 16 bits are not zero, as sorted ``slot << 16 | low``
    keys; every other entry of those bins has low bits 0 and ranks below them."""

    def __init__(self, sorted_keys: np.ndarray):
        self.keys = sorted_keys

    def kth_low_bits(self, slots: list[int], ranks: list[int]) -> list[int]:
        slots, ranks = np.asarray(slots, dtype=np.int64), np.asarray(ranks, dtype=np.int64)
        end = np.searchsorted(self.keys, (slots + 1) << 16)
        start = np.searchsorted(self.keys, (slots << 16) + 1)
        if not self.keys.size:
            return [0] * len(slots)
        found = self.keys[np.minimum(np.maximum(end - ranks, 0), self.keys.size - 1)] & 0xFFFF
        return np.where(ranks <= end - start, found, 0).tolist()

    def split(self, slot: int, top: int, low: int, count: int) -> tuple[int, float, int]:
        """(entries above, their sum, entries equal) to the pattern ``top << 16 | low`` in its bin of
        ``count`` entries (the ones not listed have low bits 0)."""
        start = int(np.searchsorted(self.keys, (slot << 16) + 1))
        end = int(np.searchsorted(self.keys, (slot + 1) << 16))
        lows = (self.keys[start:end] & 0xFFFF).astype(np.int64)
        above = lows[lows > low]
        equal = int((lows == low).sum()) if low else count - (end - start)
        return int(above.size), _pattern_sum(top, above, None), equal

    def split_many(self, slots, tops, lows, counts) -> list[tuple[int, float, int]]:
        """:meth:`split` of many patterns at once. The sums are exact (the values of one top-16 bin are
        multiples of one float32 ulp, fewer than 2**29 of them add up exactly in float64), so they are
        taken from a prefix sum of the low bits: equal to :meth:`split`'s in every bit."""
        keys = self.keys
        slots, tops, lows = (np.asarray(v, dtype=np.int64) for v in (slots, tops, lows))
        if keys.size >= 1 << 29 or (tops >= 0x7F80).any():  # not provably exact, or Inf/NaN: one by one
            return [self.split(*q) for q in zip(slots.tolist(), tops.tolist(), lows.tolist(), counts)]
        start = np.searchsorted(keys, (slots << 16) + 1)
        end = np.searchsorted(keys, (slots + 1) << 16)
        lo = np.searchsorted(keys, (slots << 16) + lows, side="left")
        hi = np.searchsorted(keys, (slots << 16) + lows, side="right")
        above = end - hi
        low_sums = np.concatenate([[0], np.cumsum(keys & 0xFFFF)])
        exp = tops >> 7
        mant = ((tops & 0x7F) << 16) + np.where(exp > 0, 1 << 23, 0)  # the bin's mantissa, low bits 0
        total = above * mant + (low_sums[end] - low_sums[hi])  # sum of the entries' mantissas, exact int
        scale = np.where(exp > 0, exp, 1) - 150
        equal = np.where(lows > 0, hi - lo, np.asarray(counts, dtype=np.int64) - (end - start))
        return [(a, math.ldexp(float(t), sc), q) for a, t, sc, q in
                zip(above.tolist(), total.tolist(), scale.tolist(), equal.tolist())]


def _pattern_sum(top: int, lows: np.ndarray, counts) -> float:
    """sum of the float32 values ``top << 16 | low`` (times ``counts``), in float64."""
    if not len(lows):
        return 0.0
    vals = ((np.uint32(top) << np.uint32(16)) | lows.astype(np.uint32)).view(np.float32).astype(np.float64)
    return float((vals * counts).sum() if counts is not None else vals.sum())


def kth_largest_thresholds(hist: np.ndarray, numel: int, nnz: int, densities, select,
                           l1hist: np.ndarray | None = None, topk: dict | None = None) -> dict[float, float]:
    """Exact k-th largest |delta| for k = int(d * numel), d in ``densities``, by radix select.

    ``hist`` counts the top 16 bits of |delta|'s float32 pattern (bin 0 holds the zeros and is
    never selected: k <= nnz); ``select(bins)`` returns a selection of the entries in those bins
    (a second pass over the tensor) that answers ``kth_low_bits(slots, ranks)`` and ``split``.

    With ``l1hist`` (sum of |delta| per top-16 bin) and a dict ``topk``, also fills, for every d with
    0 < k <= nnz, ``topk[d] = [above, equal, kept_l1, cut_block, cut_rank, thr1, above1, equal1,
    cut_block1, cut_rank1]``: the entries strictly
    above the threshold, the entries equal to it, the L1 norm of exactly k top entries,
    ``sum(|d| > thr) + (k - above) * thr`` (what mergekit's top-k keeps, whichever tied entries it
    keeps), the exact-k cut (None here; :func:`tie_cut_queries` says which ANALYZE finds), and the
    threshold, above and equal counts and cut of k - 1 (thr1 = inf when k = 1), which breadcrumbs' k = int(gamma n) + int(density n)
    needs where it is one less than int((gamma + density) n) (d = 1: the top n - 1, where gamma + density = 1;
    ops.core.kth_statistics)."""
    pairs, all_ks = _density_ks(tuple(densities), numel, topk is not None)
    kk = all_ks[(all_ks > 0) & (all_ks <= nnz)]
    # j: the bins from the top down to the one holding the k-th largest, n_hi / s_hi: the entries / sum of
    # |d| in the bins above it (cumulative sums from the top, as np.cumsum(hist[::-1]) and its searchsorted)
    j, n_hi, s_hi = np.empty(kk.size, np.int64), np.empty(kk.size, np.int64), np.empty(kk.size, np.float64)
    walk_bins(np.ascontiguousarray(hist, dtype=np.int64),
                      np.zeros(hist.size) if l1hist is None else l1hist[:hist.size], kk, j, n_hi, s_hi)
    kbins = HIST_BINS - 1 - j
    wanted: dict[int, tuple[int, int]] = dict(zip(kk.tolist(), zip(kbins.tolist(), (kk - n_hi).tolist())))
    values: dict[int, float] = {}
    counts: dict[int, list] = {}
    if kk.size:
        bins = np.unique(kbins)
        slots = np.searchsorted(bins, kbins)
        sel = select(bins.tolist())
        low = np.asarray(sel.kth_low_bits(slots.tolist(), (kk - n_hi).tolist()), dtype=np.int64)
        bits = ((kbins << 16) | low).astype(np.uint32)
        values = dict(zip(kk.tolist(), bits.view(np.float32).tolist()))
        if l1hist is not None and topk is not None:
            parts = sel.split_many(slots.tolist(), kbins.tolist(), low.tolist(), hist[kbins].tolist())
            for k, nh, sh, (n_in, s_in, equal) in zip(kk.tolist(), n_hi.tolist(), s_hi.tolist(), parts):
                above = nh + n_in
                counts[k] = [above, equal, sh + s_in + (k - above) * values[k]]
    out = {}
    for d, k in pairs:
        if k <= 0:
            out[d] = float("inf")  # keep nothing
        elif k not in wanted:
            out[d] = 0.0  # fewer non-zeros than k: every non-zero entry is kept
        else:
            out[d] = values[k]
            if k in counts:
                prev = [float("inf"), 0, 0] if k == 1 else [values[k - 1], *counts[k - 1][:2]]
                topk[d] = counts[k][:3] + [None, None] + prev + [None, None]
    return out


@lru_cache(maxsize=256)
def _density_ks(densities: tuple, numel: int, with_prev: bool) -> tuple[tuple, np.ndarray]:
    """((d, int(d * numel)) for each density, and the sorted distinct k (with every k - 1 when
    ``with_prev``)): the same for every expert of a tensor, so computed once."""
    pairs = tuple((d, int(d * numel)) for d in densities)
    ks = {k for _, k in pairs}
    if with_prev:
        ks |= {k - 1 for k in ks}
    kk = np.array(sorted(ks), dtype=np.int64)
    kk.flags.writeable = False
    return pairs, kk


@lru_cache(maxsize=64)
def density_names(densities: tuple) -> dict:
    """str(d) of each density: the JSON keys of the thresholds and topk (the same for every tensor)."""
    return {d: str(d) for d in densities}


NO_CUT = 1 << 62  # a cut block past every block: every entry tied at the threshold is in the top k


def tie_cut_queries(topk: dict, thresholds: dict, numel: int) -> list[tuple[int, int, float, int]]:
    """The exact-k cuts ANALYZE must find: (float32 pattern of the threshold, m, density, index of the
    cut in topk[d]) for every threshold (of k and of k - 1) whose tied entries straddle the top k:
    m = k - above of the tied entries are in the top k, equal - m are not.

    The rule (deterministic, exactly k kept): entries are ordered by |d| descending, then flat index
    (C order over the whole tensor) ascending; the top k are the first k. So the tied entries in the top
    k are the first m in flat order; the cut says where they end, block by block: ``cut_block`` B, the
    block (of the base's grid) holding the (m+1)-th tied entry, and ``cut_rank`` r, the tied entries of
    block B in the top k (its first r in C order). Blocks before B keep every tied entry, blocks after
    B none. Where no tie straddles, the cut is (NO_CUT, 0): every tied entry is in the top k."""
    out, values = [], []
    for d, entry in topk.items():
        k = int(d * numel)
        above, equal, thr1, above1, equal1 = entry[0], entry[1], entry[5], entry[6], entry[7]
        if k - above < equal:
            out.append((k - above, d, 3))
            values.append(thresholds[d])
        if not math.isinf(thr1) and (k - 1) - above1 < equal1:
            out.append(((k - 1) - above1, d, 8))
            values.append(thr1)
    # the float32 patterns of all of them at once (the values are float32 numbers: exact)
    pats = np.array(values, dtype=np.float32).view(np.uint32).tolist()
    return [(pat, *q) for pat, q in zip(pats, out)]


def block_cuts(per_block: np.ndarray, columns, ms) -> tuple[list[int], list[int]]:
    """Exact-k cuts from the tied entries of each block in grid order (per_block [blocks, patterns]): for
    query q on column ``columns[q]``, the (m+1)-th tied entry (m = ``ms[q]``) is in block B, and r of that
    block's tied entries come before it; returns (the B's, the r's)."""
    before = np.zeros((per_block.shape[0] + 1, per_block.shape[1]), dtype=np.int64)
    np.cumsum(per_block, axis=0, out=before[1:])
    cols, ms = np.asarray(columns, dtype=np.int64), np.asarray(ms, dtype=np.int64)
    at = before[:, cols]  # [blocks + 1, queries], non-decreasing down each column
    b = (at <= ms).sum(axis=0) - 1  # searchsorted(side="right") - 1 in every column
    return b.tolist(), (ms - at[b, np.arange(cols.size)]).tolist()
