"""Coalescing-aware selection: at (nearly) equal bytes, prefer fewer, larger ranges on a remote tier.

A remote read costs a request's latency on top of its bytes (storage/tiers.py). The greedy plan takes
blocks by score per byte, so at a 10 % budget it takes scattered blocks of near-equal score, each a range
of its own: many requests. The rule, applied after the greedy selection at budget B:

1. The **cut-off** c is the score per byte of the last block of the greedy prefix (the lowest that the
   greedy plan takes before it only fills what is left). The **band** is every candidate whose score per
   byte lies in [c (1 - t), c (1 + t)); the tolerance t is 10 % unless the request sets another
   (``coalesce_tolerance``, ``--coalesce-tolerance``).
2. Blocks above the band, and the small blocks the greedy plan took below it to fill what was left, stay
   chosen. The band's share of the budget (B minus their bytes) is chosen again among the band's blocks,
   one at a time, preferring first the block with the most chosen neighbours in its tensor (2: it fills a
   one-block gap and joins two ranges into one; 1: it extends a range; 0: it opens a new request), then
   the higher score per byte, then (expert, tensor, block) order. A block that no longer fits is skipped.

So a coalesced plan reads at most B bytes (the band's blocks are re-chosen within the bytes the greedy plan
gave them), and every block it swaps in scores within 2 t per byte of the block it replaces; the
plan's error bound is computed from the blocks it actually reads, as for every plan. EXPLAIN shows the
requests and estimated transfer time of the greedy selection and of the coalesced one.

It applies when a request asks for it (``coalesce="on"``) or, by default (``"auto"``), when any expert lives
on a remote tier; never with a strategy that is not a score per byte (random, uniform), a target bound,
an operator that selects blocks jointly, an interpolation method, or LoRA experts (whose blocks carry a
per-tensor one-off read). A local merge's plan is the greedy plan, as before.
"""

from __future__ import annotations

import heapq

import numpy as np

from mergepipe.planner.candidates import Candidates

MODES = ("auto", "on", "off")


def prefix_length(cands: Candidates, budget_bytes: int) -> int:
    return int(np.searchsorted(cands.cum_bytes, budget_bytes, side="right"))


def coalesce(cands: Candidates, chosen: np.ndarray, budget_bytes: int, tolerance: float = 0.10) -> np.ndarray:
    """The chosen blocks with the band re-chosen for fewer ranges (module docstring), in candidate order."""
    k = prefix_length(cands, budget_bytes)
    if k == 0 or len(chosen) >= len(cands.order):
        return chosen
    ratio = cands.ratio
    cutoff = float(ratio[cands.order[k - 1]])
    if not np.isfinite(cutoff) or cutoff <= 0:
        return chosen
    lo, hi = cutoff * (1 - tolerance), cutoff * (1 + tolerance)
    in_band = (ratio >= lo) & (ratio < hi)
    kept = chosen[~in_band[chosen]]
    left = budget_bytes - int(cands.nbytes[kept].sum())
    band = np.flatnonzero(in_band)
    key_of = {(int(cands.expert[i]), int(cands.tensor[i]), int(cands.block[i])): int(i) for i in band}
    taken = {(int(cands.expert[i]), int(cands.tensor[i]), int(cands.block[i])) for i in kept}
    picked = _pick(cands, key_of, taken, left)
    return np.array(sorted(list(kept) + picked), dtype=np.int64)


def _pick(cands: Candidates, key_of: dict, taken: set, left: int) -> list[int]:
    """Band blocks within ``left`` bytes, most chosen neighbours first (a max-heap with re-pushes: a block's
    neighbour count only grows, so its newest entry is its best and older ones are skipped as taken)."""

    def entry(key):
        e, t, b = key
        near = ((e, t, b - 1) in taken) + ((e, t, b + 1) in taken)
        return (-near, -float(cands.ratio[key_of[key]]), e, t, b)

    heap = [entry(key) for key in key_of]
    heapq.heapify(heap)
    picked: list[int] = []
    while heap and left > 0:
        *_, e, t, b = heapq.heappop(heap)
        key = (e, t, b)
        i = key_of[key]
        if key in taken or int(cands.nbytes[i]) > left:
            continue
        taken.add(key)
        picked.append(i)
        left -= int(cands.nbytes[i])
        for nb in ((e, t, b - 1), (e, t, b + 1)):
            if nb in key_of and nb not in taken:
                heapq.heappush(heap, entry(nb))
    return picked
