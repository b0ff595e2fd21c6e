"""The second look at one (expert, tensor) of ANALYZE (analyze/stats.py): the radix select's low 16 bits
of the bins that hold a k-th largest |delta| (:meth:`SecondPass.select`) and the exact-k cuts of entries
tied at a threshold (:meth:`SecondPass.tie_cuts`). Both use what the first pass kept (the |delta| bit
patterns it collected, each block's histogram counts, the blocks kept in memory) and re-read the
blocks only when that does not suffice.
"""

from __future__ import annotations

import numpy as np

from mergepipe.analyze import kernels, select_kernels
from mergepipe.analyze.thresholds import NO_CUT, DenseSelection, KeySelection, block_cuts, tie_cut_queries

NO_KEYS = np.empty(0, dtype=np.uint32)  # the first pass ran out of room: the select reads again


class SecondPass:
    """The second-pass methods of analyze/stats.py's tensor pass, which holds what they read: ``binfo``,
    ``spans``, the first pass's ``keys`` (NO_KEYS: none), ``nkeys``, ``block_bins`` and ``nonzero_low``,
    the blocks kept (``cached``, when ``keep``) and ``reread(span)``."""

    def tie_cuts(self, topk: dict, thresholds: dict) -> None:
        """Fill the exact-k cuts of ``topk`` (analyze/thresholds.tie_cut_queries), only where entries tied
        at a threshold straddle the top k, from the count of tied entries in each block, taken from what
        the first pass recorded (each block's histogram counts and its collected low-bit keys: no second
        pass); only when the first pass ran out of room for keys (the select then re-reads as well), by a
        pass over the kept blocks or a re-read."""
        for entry in topk.values():
            entry[3], entry[4], entry[8], entry[9] = NO_CUT, 0, NO_CUT, 0
        # A threshold that is NaN or Inf (an expert or base holding non-finite values, which the planner
        # refuses) needs no cut, and NaN ties cannot be counted per block: a block's max |d| ignores NaN,
        # so its recorded bins stop below NaN's and the blocks' tied counts fall short of m (the cut ran
        # past the last block: IndexError). Such cuts stay (NO_CUT, 0).
        queries = [q for q in tie_cut_queries(topk, thresholds, self.binfo.numel)
                   if (q[0] >> 23) & 0xFF != 0xFF]
        if not queries:
            return
        pats = np.array(sorted({q[0] for q in queries}), dtype=np.uint32)
        per_block = np.zeros((len(self.spans), pats.size), dtype=np.int64)
        first = np.full(1 << 16, -1, dtype=np.int32)
        tops, at = np.unique(pats >> 16, return_index=True)  # pats sorted: the first pattern of each top
        first[tops] = at
        if self.keys is not NO_KEYS and len(self.block_bins) == len(self.spans):
            bb = self.block_bins  # per block (bins, counts, first key, end key): counted in one call
            select_kernels.tied_per_block(self.keys, np.array([(k0, k1) for _, _, k0, k1 in bb], dtype=np.int64),
                                   np.concatenate([b for b, _, _, _ in bb]), np.concatenate([c for _, c, _, _ in bb]),
                                   np.cumsum([b.size for b, _, _, _ in bb], dtype=np.int64), pats, first, per_block)
        else:
            blocks = self.cached if self.keep else (self.reread(s) for s in self.spans)
            for i, (e, b) in enumerate(blocks):
                kernels.count_patterns(e, b, pats, first, per_block[i])
        column = {int(p): j for j, p in enumerate(pats.tolist())}
        for (_, _, d, at), b, r in zip(queries, *block_cuts(per_block, [column[q[0]] for q in queries],
                                                            [q[1] for q in queries])):
            topk[d][at], topk[d][at + 1] = self.spans[b].index, r

    def select(self, bins: list[int]):
        """Second pass: the low 16 bits of the entries in ``bins`` (from memory or re-read).

        Entries whose low 16 bits are all zero need no second look: the first pass counted them (their
        bin's count minus the others). bf16 deltas almost only have such entries, so when few entries
        have low bits set, only those are collected; otherwise every entry of the bins is counted."""
        slot_of = np.full(1 << 16, len(bins), dtype=np.int32)  # unselected bins map past the last slot
        slot_of[np.array(bins)] = np.arange(len(bins), dtype=np.int32)
        if self.keys is not NO_KEYS:  # all collected by the first pass
            bits = self.keys[:self.nkeys]
            slots = slot_of[bits >> 16]
            chosen = slots < len(bins)
            keys = (slots[chosen].astype(np.int64) << 16) | (bits[chosen] & 0xFFFF).astype(np.int64)
            return KeySelection(np.sort(keys))
        blocks = self.cached if self.keep else (self.reread(s) for s in self.spans)
        if self.nonzero_low * 8 < self.binfo.numel:
            keys = np.empty(self.nonzero_low, dtype=np.int64)
            pos = 0
            if self.nonzero_low:
                for e, b in blocks:
                    pos = kernels.collect_nonzero_low_keys(e, b, slot_of, len(bins), keys, pos)
            return KeySelection(np.sort(keys[:pos]))
        dense = np.zeros((len(bins) + 1, 1 << 16), dtype=np.int64 if self.binfo.numel >= 2**31 else np.int32)
        for e, b in blocks:
            kernels.count_low_bits(e, b, slot_of, dense)
        return DenseSelection(dense[:-1])
