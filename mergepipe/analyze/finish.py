"""The end of one (expert, tensor) pass of ANALYZE (analyze/stats.py's finish), compiled: the radix select's
walk down the histogram, the low 16 bits of every k-th largest |delta| from the keys the first pass
collected, the counts and L1 sums of the top k, and the exact-k cuts of the entries tied at a threshold
(from each block's sparse histogram and keys) -- for every density at once, in two calls instead of some
sixty numpy steps per tensor.

This is the common case only: every |delta| pattern with low bits was collected by the first pass, no delta
is NaN/Inf, and every block recorded its histogram counts. It computes exactly what
thresholds.kth_largest_thresholds, KeySelection and SecondPass.tie_cuts compute there (the same integer
steps, the same float64 operations in the same order: equal in every bit, tests/analyze/test_finish_fused.py);
any other case, or anything unexpected on the way (:func:`finish_rest` returns False), takes that path.

Every jitted function used here lives in this file (numba's cache is kept per file).
"""

from __future__ import annotations

import math

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit

_C = dict(nogil=True, cache=True)
HIST_BINS = 1 << 15  # top 16 bits of a non-negative float32 (thresholds.HIST_BINS)
NO_CUT = 1 << 62  # thresholds.NO_CUT


@njit(**_C)
def choose_keys(hist, l1hist, kk, j, n_hi, s_hi, bins, keys, nkeys, slot_of, out):
    """The walk (bins.walk_bins over hist[:HIST_BINS] and l1hist[:HIST_BINS], from the top bin down) for the
    sorted ks ``kk``, into j / n_hi / s_hi; the distinct bins holding a k-th largest into ``bins`` (ascending);
    and the first pass's keys (float32 patterns) that fall in one of them as ``slot << 16 | low`` into
    ``out`` (unsorted; SecondPass.select's keys). ``slot_of``: int32 [65536] scratch, all -1 (left so).
    Returns (keys chosen, distinct bins)."""
    n = HIST_BINS
    q = 0
    cum = 0
    s = 0.0
    done = kk.size == 0
    if not done:
        for idx in range(n):
            nxt = cum + hist[n - 1 - idx]
            while q < kk.size and kk[q] <= nxt:
                j[q] = idx
                n_hi[q] = cum
                s_hi[q] = s
                q += 1
            if q == kk.size:
                done = True
                break
            cum = nxt
            s += l1hist[n - 1 - idx]
    while q < kk.size:
        j[q] = n
        n_hi[q] = cum
        s_hi[q] = s
        q += 1
    # kk ascending: j non-decreasing, the bins (HIST_BINS - 1 - j) non-increasing
    nb = 0
    for q in range(kk.size - 1, -1, -1):
        b = HIST_BINS - 1 - j[q]
        if nb == 0 or bins[nb - 1] != b:
            bins[nb] = b
            nb += 1
    for i in range(nb):
        slot_of[bins[i]] = i
    m = 0
    for i in range(nkeys):
        bits = keys[i]
        sl = slot_of[bits >> np.uint32(16)]
        if sl >= 0:
            out[m] = (np.int64(sl) << 16) | np.int64(bits & np.uint32(0xFFFF))
            m += 1
    for i in range(nb):
        slot_of[bins[i]] = -1
    return m, nb


@njit(inline="always", **_C)
def _left(a, v):
    """np.searchsorted(a, v, side="left")."""
    lo, hi = 0, a.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(inline="always", **_C)
def _right(a, v):
    """np.searchsorted(a, v, side="right")."""
    lo, hi = 0, a.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**_C)
def _count_keys(keys, k0, k1, pats, first, eq, same_top):
    """select_kernels.count_keys over keys[k0:k1]."""
    P = pats.size
    for i in range(k0, k1):
        k = keys[i]
        top = k >> 16
        p = first[top]
        if p < 0:
            continue
        while p < P and (pats[p] >> 16) == top:
            same_top[p] += 1
            if pats[p] == k:
                eq[p] += 1
            p += 1


@njit(**_C)
def finish_rest(hist, kk, j, n_hi, s_hi, bins, nb, ck, dens_k, keys, blk, blk_bins, blk_counts, span_index,
                thr, has, ti, tf):
    """After :func:`choose_keys` and the sort of its keys ``ck``: per density (k = ``dens_k``), its threshold
    into thr (inf for k <= 0; 0.0 where k exceeds the non-zeros, i.e. is not in ``kk``), has = 1 where it has a
    topk entry, and that entry: ti [above, equal, cut_block, cut_rank, above1, equal1, cut_block1, cut_rank1],
    tf [kept_l1, thr1] (thresholds.kth_largest_thresholds' topk with SecondPass.tie_cuts' cuts). Block i's
    keys are keys[blk[i, 1]:blk[i, 2]] and its sparse histogram blk_bins / blk_counts [blk[i - 1, 0]:blk[i, 0]]. Returns False where the general path must decide (nothing to trust then)."""
    if ck.size >= (1 << 29):
        return False
    ok, value, vbits, above, equal, kept = _select_values(hist, kk, j, n_hi, s_hi, bins, nb, ck)
    if not ok:
        return False
    D = dens_k.size
    qm = np.empty(2 * D, np.int64)
    qpat = np.empty(2 * D, np.uint32)
    qd = np.empty(2 * D, np.int64)
    qat = np.empty(2 * D, np.int64)
    nq = _per_density(dens_k, kk, value, vbits, above, equal, kept, thr, has, ti, tf, qm, qpat, qd, qat)
    if nq <= 0:
        return nq == 0
    pats = np.unique(qpat[:nq])
    per_block = _tied_per_block(keys, blk, blk_bins, blk_counts, pats)
    return _block_cuts(pats, qm, qpat, qd, qat, nq, per_block, span_index, ti)


@njit(**_C)
def _select_values(hist, kk, j, n_hi, s_hi, bins, nb, ck):
    """Per query k (``kk``): the k-th largest pattern (its float64 value and float32 bits), the entries above
    and equal to it, and the exact sum of the top k (KeySelection.split_many); ok False at an Inf/NaN bin or a k
    past every entry."""
    Q = kk.size
    nck = ck.size
    value = np.empty(Q, np.float64)
    vbits = np.empty(Q, np.uint32)
    above = np.empty(Q, np.int64)
    equal = np.empty(Q, np.int64)
    kept = np.empty(Q, np.float64)
    low_sums = np.empty(nck + 1, np.int64)
    low_sums[0] = 0
    acc = 0
    for i in range(nck):
        acc += ck[i] & 0xFFFF
        low_sums[i + 1] = acc
    for q in range(Q):
        kbin = np.int64(HIST_BINS - 1 - j[q])
        if kbin >= 0x7F80 or kbin < 0:  # Inf/NaN: KeySelection.split one by one; < 0: k past every entry
            return False, value, vbits, above, equal, kept
        slot = np.int64(_left(bins[:nb], kbin))
        rank = kk[q] - n_hi[q]
        end = _left(ck, (slot + 1) << 16)
        start = _left(ck, (slot << 16) + 1)
        low = np.int64(0)
        if nck:
            idx = min(max(end - rank, 0), nck - 1)
            if rank <= end - start:
                low = ck[idx] & 0xFFFF
        b32 = np.uint32((kbin << 16) | low)
        vbits[q] = b32
        value[q] = np.float64(b32.view(np.float32))
        # KeySelection.split_many: entries above and equal to the pattern in its bin, their exact sum
        lo = _left(ck, (slot << 16) + low)
        hi = _right(ck, (slot << 16) + low)
        above_in = end - hi
        ex = kbin >> 7
        mant = ((kbin & 0x7F) << 16) + ((1 << 23) if ex > 0 else 0)
        total = above_in * mant + (low_sums[end] - low_sums[hi])
        scale = (ex if ex > 0 else 1) - 150
        s_in = math.ldexp(np.float64(total), scale)
        eq = hi - lo if low > 0 else hist[kbin] - (end - start)
        a = n_hi[q] + above_in
        above[q] = a
        equal[q] = eq
        kept[q] = s_hi[q] + s_in + np.float64(kk[q] - a) * value[q]
    return True, value, vbits, above, equal, kept


@njit(**_C)
def _per_density(dens_k, kk, value, vbits, above, equal, kept, thr, has, ti, tf, qm, qpat, qd, qat):
    """Each density's threshold and topk entry (see :func:`finish_rest`), and the tie-cut queries it needs
    into qm/qpat/qd/qat; returns their number, or -1 where the general path must decide."""
    Q = kk.size
    nq = 0
    for d in range(dens_k.size):
        k = dens_k[d]
        has[d] = 0
        if k <= 0:
            thr[d] = np.inf
            continue
        q = _left(kk, k)
        if q == Q or kk[q] != k:
            thr[d] = 0.0
            continue
        thr[d] = value[q]
        has[d] = 1
        ti[d, 0] = above[q]
        ti[d, 1] = equal[q]
        tf[d, 0] = kept[q]
        ti[d, 2] = NO_CUT
        ti[d, 3] = 0
        ti[d, 6] = NO_CUT
        ti[d, 7] = 0
        p = q
        if k == 1:
            tf[d, 1] = np.inf
            ti[d, 4] = 0
            ti[d, 5] = 0
        else:
            p = _left(kk, k - 1)
            if p == Q or kk[p] != k - 1:
                return -1
            tf[d, 1] = value[p]
            ti[d, 4] = above[p]
            ti[d, 5] = equal[p]
        # thresholds.tie_cut_queries, less those at a NaN/Inf pattern (SecondPass.tie_cuts)
        if k - above[q] < equal[q] and (vbits[q] >> 23) & 0xFF != 0xFF:
            qm[nq] = k - above[q]
            qpat[nq] = vbits[q]
            qd[nq] = d
            qat[nq] = 2
            nq += 1
        if k != 1:
            if (k - 1) - above[p] < equal[p] and (vbits[p] >> 23) & 0xFF != 0xFF:
                qm[nq] = (k - 1) - above[p]
                qpat[nq] = vbits[p]
                qd[nq] = d
                qat[nq] = 6
                nq += 1
    return nq


@njit(**_C)
def _tied_per_block(keys, blk, blk_bins, blk_counts, pats):
    """select_kernels.tied_per_block: every block's entries equal to each of ``pats`` (sorted patterns)."""
    P = pats.size
    first = np.full(1 << 16, -1, np.int32)
    for p in range(P - 1, -1, -1):
        first[pats[p] >> 16] = p
    nblk = blk.shape[0]
    per_block = np.zeros((nblk, P), np.int64)
    eqc = np.zeros(P, np.int64)
    same_top = np.zeros(P, np.int64)
    b0 = 0
    for i in range(nblk):
        eqc[:] = 0
        same_top[:] = 0
        _count_keys(keys, blk[i, 1], blk[i, 2], pats, first, eqc, same_top)
        jj = b0
        for p in range(P):
            if pats[p] & np.uint32(0xFFFF):
                per_block[i, p] = eqc[p]
                continue
            top = np.int64(pats[p] >> np.uint32(16))
            while jj < blk[i, 0] and blk_bins[jj] < top:
                jj += 1
            in_bin = np.int64(blk_counts[jj]) if jj < blk[i, 0] and blk_bins[jj] == top else np.int64(0)
            per_block[i, p] = in_bin - same_top[p]
        b0 = blk[i, 0]
    return per_block


@njit(**_C)
def _block_cuts(pats, qm, qpat, qd, qat, nq, per_block, span_index, ti):
    """thresholds.block_cuts: per tie-cut query, the block holding the (m+1)-th tied entry and the tied entries
    before it there, into ti; False where that block is not in the tensor."""
    nblk = per_block.shape[0]
    before = np.empty(nblk + 1, np.int64)
    for t in range(nq):
        col = _left(pats, qpat[t])
        m = qm[t]
        before[0] = 0
        cnt = 1 if m >= 0 else 0
        for i in range(nblk):
            before[i + 1] = before[i] + per_block[i, col]
            if before[i + 1] <= m:
                cnt += 1
        b = cnt - 1
        if b < 0 or b >= nblk:
            return False
        ti[qd[t], qat[t]] = span_index[b]
        ti[qd[t], qat[t] + 1] = m - before[b]
    return True
