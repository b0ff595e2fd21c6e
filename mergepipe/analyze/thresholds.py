"""Exact top-k magnitude thresholds by a radix select on the float32 bit pattern of |delta|: the k-th
largest from a histogram of the top 16 bits, then the low 16 bits of only the bins that hold it."""

from __future__ import annotations

import numpy as np

from mergepipe.analyze import kernels


HIST_BINS = 1 << 15  # top 16 bits of a non-negative float32: sign 0, so 2**15 bins
class DenseSelection:
    """Counts of the low 16 bits of the entries in a few top-16 bins: [slots, 65536]."""

    def __init__(self, dense: np.ndarray):
        self.dense = dense

    def kth_low_bits(self, slots: list[int], ranks: list[int]) -> list[int]:
        """The low 16 bits of the rank-th largest entry (1-based) within each slot."""
        return kernels.kth_from_top(self.dense, np.array(slots, dtype=np.int64),
                                    np.array(ranks, dtype=np.int64)).tolist()

    def split(self, slot: int, top: int, low: int, count: int) -> tuple[int, float, int]:
        """(entries above, their sum, entries equal) to the pattern ``top << 16 | low`` in its bin."""
        row = self.dense[slot]
        above = row[low + 1:]
        return int(above.sum()), _pattern_sum(top, np.nonzero(above)[0] + low + 1, above[above != 0]), int(row[low])


class KeySelection:
    """The entries of a few top-16 bins whose low 16 bits are not zero, as sorted ``slot << 16 | low``
    keys; every other entry of those bins has low bits 0 and ranks below them."""

    def __init__(self, sorted_keys: np.ndarray):
        self.keys = sorted_keys

    def kth_low_bits(self, slots: list[int], ranks: list[int]) -> list[int]:
        out = []
        for slot, rank in zip(slots, ranks):
            end = int(np.searchsorted(self.keys, (slot + 1) << 16))
            start = int(np.searchsorted(self.keys, (slot << 16) + 1))
            out.append(int(self.keys[end - rank]) & 0xFFFF if rank <= end - start else 0)
        return out

    def split(self, slot: int, top: int, low: int, count: int) -> tuple[int, float, int]:
        """(entries above, their sum, entries equal) to the pattern ``top << 16 | low`` in its bin of
        ``count`` entries (the ones not listed have low bits 0)."""
        start = int(np.searchsorted(self.keys, (slot << 16) + 1))
        end = int(np.searchsorted(self.keys, (slot + 1) << 16))
        lows = (self.keys[start:end] & 0xFFFF).astype(np.int64)
        above = lows[lows > low]
        equal = int((lows == low).sum()) if low else count - (end - start)
        return int(above.size), _pattern_sum(top, above, None), equal


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
    desc = np.cumsum(hist[::-1])  # desc[j] = entries in the top j+1 bins
    ks = {int(d * numel) for d in densities}
    if topk is not None:
        ks |= {k - 1 for k in ks}
    wanted: dict[int, tuple[int, int]] = {}
    for k in sorted(ks):
        if 0 < k <= nnz:
            j = int(np.searchsorted(desc, k))
            above = int(desc[j - 1]) if j > 0 else 0
            wanted[k] = (HIST_BINS - 1 - j, k - above)
    bins = sorted({b for b, _ in wanted.values()})
    values: dict[int, float] = {}
    counts: dict[int, list] = {}
    if bins:
        slot = {b: i for i, b in enumerate(bins)}
        sel = select(bins)
        low = sel.kth_low_bits([slot[b] for b, _ in wanted.values()], [r for _, r in wanted.values()])
        bits = np.array([(b << 16) | lo for (b, _), lo in zip(wanted.values(), low)], dtype=np.uint32)
        values = dict(zip(wanted, bits.view(np.float32).tolist()))
        if l1hist is not None and topk is not None:
            l1desc = np.cumsum(l1hist[:HIST_BINS][::-1])
            for (k, (b, _)), lo in zip(wanted.items(), low):
                j = HIST_BINS - 1 - b
                n_hi = int(desc[j - 1]) if j > 0 else 0
                s_hi = float(l1desc[j - 1]) if j > 0 else 0.0
                n_in, s_in, equal = sel.split(slot[b], b, lo, int(hist[b]))
                above = n_hi + n_in
                counts[k] = [above, equal, s_hi + s_in + (k - above) * values[k]]
    out = {}
    for d in densities:
        k = int(d * numel)
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
    out = []
    for d, entry in topk.items():
        k = int(d * numel)
        above, equal, thr1, above1, equal1 = entry[0], entry[1], entry[5], entry[6], entry[7]
        if k - above < equal:
            out.append((_pattern(thresholds[d]), k - above, d, 3))
        if not np.isinf(thr1) and (k - 1) - above1 < equal1:
            out.append((_pattern(thr1), (k - 1) - above1, d, 8))
    return out


def block_cut(per_block: np.ndarray, m: int) -> tuple[int, int]:
    """(B, r) from the tied entries of each block in grid order: the (m+1)-th is in block B, r of that
    block's tied entries come before it."""
    before = np.concatenate([[0], np.cumsum(per_block)])
    b = int(np.searchsorted(before, m, side="right")) - 1
    return b, int(m - before[b])


def _pattern(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])
