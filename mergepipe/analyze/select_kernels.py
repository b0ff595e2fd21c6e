"""Compiled kernels of ANALYZE's exact-k selection over what the first pass recorded (analyze/second_pass.py,
analyze/thresholds.py): the entries of each block tied at a cut-off pattern, and the k-th largest entry of a
histogram. Self-contained (numba's cache keys a kernel by its own file), moved out of analyze/kernels.py."""

from __future__ import annotations

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit

_C = dict(nogil=True, cache=True)


@njit(**_C)
def count_keys(keys, pats, first, eq, same_top):
    """Over one block's collected low-bit keys: eq[p] += keys equal to pats[p], same_top[p] += keys in
    pats[p]'s top-16 bin (``first`` as in count_patterns). No pass over the block's data."""
    P = pats.size
    for i in range(keys.size):
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
def tied_per_block(keys, key_spans, bins, counts, bin_ends, pats, first, per_block):
    """Every block's entries equal to each of ``pats`` (sorted float32 patterns), from what the first
    pass recorded: block i's collected low-bit keys keys[key_spans[i, 0]:key_spans[i, 1]] and its sparse
    histogram counts bins/counts[bin_ends[i - 1]:bin_ends[i]] (sorted bins). A pattern with low bits is
    counted among the keys; one with low bits 0 is never a key: its bin's count less the bin's keys.
    The loop SecondPass.tie_cuts ran per block (count_keys and a lookup of the bins), in one call."""
    P = pats.size
    eq = np.zeros(P, np.int64)
    same_top = np.zeros(P, np.int64)
    b0 = 0
    for i in range(per_block.shape[0]):
        eq[:] = 0
        same_top[:] = 0
        count_keys(keys[key_spans[i, 0]:key_spans[i, 1]], pats, first, eq, same_top)
        j = b0
        for p in range(P):
            if pats[p] & np.uint32(0xFFFF):
                per_block[i, p] = eq[p]
                continue
            top = np.int64(pats[p] >> np.uint32(16))
            while j < bin_ends[i] and bins[j] < top:
                j += 1
            in_bin = counts[j] if j < bin_ends[i] and bins[j] == top else 0
            per_block[i, p] = in_bin - same_top[p]
        b0 = bin_ends[i]


@njit(**_C)
def kth_from_top(dense, slots, ranks):
    """For each query q: the index of the ranks[q]-th largest entry (1-based) counted in row
    dense[slots[q]], i.e. scanning that histogram from its top bin. One scan per row."""
    out = np.zeros(slots.size, np.int64)
    for row in np.unique(slots):
        desc = np.cumsum(dense[row][::-1])
        for q in range(slots.size):
            if slots[q] == row:
                out[q] = dense.shape[1] - 1 - np.searchsorted(desc, ranks[q])
    return out
