"""The vectorized pieces of ANALYZE's radix select equal the one-at-a-time code they replace, in every bit:
the split of a selected bin, the walk down the histogram, the exact-k cuts, and block_stats' L1 histogram
when the common entries are folded in at the end (kernels.fold_l1)."""

from __future__ import annotations

import numpy as np

from mergepipe.analyze import bins, kernels
from mergepipe.analyze.thresholds import KeySelection, block_cuts


def _keys(rng, n_slots: int, n: int) -> np.ndarray:
    slots = rng.integers(0, n_slots, n)
    lows = rng.integers(1, 1 << 16, n)
    return np.sort((slots.astype(np.int64) << 16) | lows)


def test_split_many_equals_split_and_kth_low_bits_equals_the_loop():
    rng = np.random.default_rng(7)
    for n in (0, 1, 50, 5000):
        sel = KeySelection(_keys(rng, 6, n))
        tops = rng.integers(0x3000, 0x3F00, 6)  # one top-16 bin per slot (normal numbers)
        tops[0] = 0x0005  # a subnormal bin
        q_slots = rng.integers(0, 6, 40).tolist()
        q_tops = [int(tops[s]) for s in q_slots]
        q_lows = [int(v) if rng.random() < 0.7 else 0 for v in rng.integers(0, 1 << 16, 40)]
        q_counts = [int(c) for c in rng.integers(n, n + 100, 40)]
        got = sel.split_many(q_slots, q_tops, q_lows, q_counts)
        want = [sel.split(*q) for q in zip(q_slots, q_tops, q_lows, q_counts)]
        assert [(a, np.float64(s).tobytes(), e) for a, s, e in got] == \
               [(a, np.float64(s).tobytes(), e) for a, s, e in want]
        ranks = [int(r) for r in rng.integers(1, 60, 40)]
        loop = []
        for slot, rank in zip(q_slots, ranks):
            end = int(np.searchsorted(sel.keys, (slot + 1) << 16))
            start = int(np.searchsorted(sel.keys, (slot << 16) + 1))
            loop.append(int(sel.keys[end - rank]) & 0xFFFF if rank <= end - start else 0)
        assert sel.kth_low_bits(q_slots, ranks) == loop


def test_walk_bins_equals_cumsum_and_searchsorted():
    rng = np.random.default_rng(3)
    hist = np.zeros(1 << 15, np.int64)
    hist[rng.integers(0, 1 << 15, 300)] = rng.integers(1, 1000, 300)
    l1 = rng.random(1 << 15) * hist
    ks = np.unique(rng.integers(1, hist.sum() + 1, 200))
    j, n_hi, s_hi = np.empty(ks.size, np.int64), np.empty(ks.size, np.int64), np.empty(ks.size)
    bins.walk_bins(hist, l1, ks, j, n_hi, s_hi)
    desc, l1desc = np.cumsum(hist[::-1]), np.cumsum(l1[::-1])
    want_j = np.searchsorted(desc, ks)
    assert np.array_equal(j, want_j)
    assert np.array_equal(n_hi, np.where(want_j > 0, desc[np.maximum(want_j - 1, 0)], 0))
    assert np.array_equal(s_hi.view(np.uint64), np.where(want_j > 0, l1desc[np.maximum(want_j - 1, 0)], 0.0).view(np.uint64))


def test_block_cuts_equal_one_cut_at_a_time():
    rng = np.random.default_rng(5)
    per_block = rng.integers(0, 5, (9, 4))
    cols = rng.integers(0, 4, 30)
    ms = [int(rng.integers(0, per_block[:, c].sum())) for c in cols]
    bs, rs = block_cuts(per_block, cols.tolist(), ms)
    for c, m, b, r in zip(cols, ms, bs, rs):
        before = np.concatenate([[0], np.cumsum(per_block[:, c])])
        want_b = int(np.searchsorted(before, m, side="right")) - 1
        assert (b, r) == (want_b, int(m - before[want_b]))


def test_folded_l1_histogram_equals_adding_every_entry():
    rng = np.random.default_rng(11)
    base = (rng.standard_normal(1 << 16).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    noise = rng.integers(-3, 4, base.size).astype(np.int32)
    expert = np.clip(base.astype(np.int32) + noise, 0, 0x7F7F).astype(np.uint16)  # nearby bf16 values
    expert[::97] = (rng.standard_normal(expert[::97].size).astype(np.float32).view(np.uint32) >> 16)
    direct = (np.zeros((4, 1 << 16), np.int32), np.empty(1 << 16, np.uint32), np.zeros(1 << 16))
    folded = (np.zeros((4, 1 << 16), np.int32), np.empty(1 << 16, np.uint32), np.zeros(1 << 16))
    lowcnt, total = np.zeros(1 << 16, np.int32), np.zeros(1 << 16, np.int64)
    for start in range(0, base.size, 10_001):  # blocks, the last one short
        e, b = expert[start:start + 10_001], base[start:start + 10_001]
        r1 = kernels.block_stats(e, b, direct[0], direct[1], 0, direct[2])
        r2 = kernels.block_stats(e, b, folded[0], folded[1], 0, folded[2], lowcnt)
        assert r1 == r2
    lo, hi = bins.lane_sums(folded[0], total, 1 << 16)
    assert np.array_equal(total, direct[0].sum(axis=0)) and lowcnt.sum() > 0
    bins.fold_l1(total, lowcnt, folded[2], bins.BIN_VALUES, lo, hi)
    assert np.array_equal(folded[2].view(np.uint64), direct[2].view(np.uint64))
