"""How candidate blocks are ranked: the strategies, and the sketch-based scores (sign conflict,
kept energy) the conflict and kept strategies use."""

from __future__ import annotations

import math

import numpy as np

from mergepipe.catalog import analyses
from mergepipe.catalog.sketch import decode
from mergepipe.ops.spec import Sparsify


# How candidate blocks are ranked (greedy takes the highest priority per byte first):
#   norm      |c_i| * ||delta||_2 per byte: minimises the additive error bound (the default)
#   conflict  norm, discounted by the block's sign-conflict rate against the other experts (sketches)
#   kept      norm of the part of delta the operator keeps (entries above the TIES/breadcrumbs
#             magnitude threshold, estimated from the sketch); equals norm for other operators
#   random    a seeded random order (a baseline for studies)
#   uniform   the same fraction of every (expert, tensor), blocks spread evenly (a baseline)
STRATEGIES = ("norm", "conflict", "kept", "random", "uniform")


class StrategyScores:
    """The scores the conflict and kept strategies need, computed from the stored sketches (a mixin of
    PlanContext: uses its catalog, experts, operator, params and tensor index)."""

    def _sketch_matrix(self):
        """Per (tensor, block): the experts' sketches rescaled to delta units, as [blocks, K, S]."""
        if hasattr(self, "_sketches"):
            return self._sketches
        keys: dict[tuple[str, int], int] = {}
        index, expert, scale, blobs = [], [], [], []
        for ei, e in enumerate(self.experts):
            for tensor, block, mx, blob in analyses.changed_block_sketches(self.catalog, e["id"]):
                index.append(keys.setdefault((tensor, block), len(keys)))
                expert.append(ei)
                scale.append(mx)
                blobs.append(blob)
        size = max((len(b) // 2 for b in blobs), default=0)
        mat = np.zeros((len(keys), len(self.experts), size), dtype=np.float32)
        full = [i for i, b in enumerate(blobs) if len(b) == 2 * size]  # most blocks: decode them at once
        if full:
            vals = np.frombuffer(b"".join(blobs[i] for i in full), dtype=np.float16).reshape(len(full), size)
            sel = np.array(full)
            mat[np.array(index)[sel], np.array(expert)[sel]] = vals.astype(np.float32) * np.array(scale, dtype=np.float32)[sel, None]
        for i in set(range(len(blobs))) - set(full):  # small blocks sample every element
            v = decode(blobs[i]) * scale[i]
            mat[index[i], expert[i], : len(v)] = v
        self._sketches = (keys, mat)
        return self._sketches

    def _conflict_rates(self, arr) -> np.ndarray:
        """For each candidate: sign-conflict rate of the expert's delta against the others' weighted sum."""
        keys, mat = self._sketch_matrix()
        wm = self.weight_matrix.astype(np.float32)
        rates = np.zeros(len(arr["expert"]))
        names = [t["name"] for t in self.tensors]
        for n, (ei, ti, b) in enumerate(zip(arr["expert"], arr["tensor"], arr["block"])):
            idx = keys.get((names[ti], int(b)))
            if idx is None:
                continue
            weighted = mat[idx] * wm[:, ti, None]
            mine = weighted[ei]
            others = weighted.sum(axis=0) - mine
            both = (mine != 0) & (others != 0)
            if both.any():
                rates[n] = float((np.sign(mine[both]) != np.sign(others[both])).mean())
        return rates

    def _kept_energy(self, arr) -> np.ndarray:
        """For each candidate: the share of its block's energy above the operator's magnitude threshold.

        Estimated from the block's sketch (a fixed sample of delta). Operators without a magnitude
        threshold keep everything (share 1)."""
        if not self.op.thresholded:
            return np.ones(len(arr["expert"]))
        keys, mat = self._sketch_matrix()
        names = [t["name"] for t in self.tensors]
        share = np.ones(len(arr["expert"]))
        for n, (ei, ti, b) in enumerate(zip(arr["expert"], arr["tensor"], arr["block"])):
            idx = keys.get((names[ti], int(b)))
            thr = self.thresholds.get(self.experts[ei]["id"], {}).get(names[ti])
            if idx is None or not thr:
                continue
            v = mat[idx, ei]
            lo, hi = (thr[0], math.inf) if self.op.sparsify is Sparsify.MAGNITUDE else (thr[1], thr[0])
            energy = float((v * v).sum())
            if energy > 0:
                a = np.abs(v)
                share[n] = float((v[(a >= lo) & (a <= hi)] ** 2).sum()) / energy
        return share

def _uniform_priority(expert: np.ndarray, tensor: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Priority that takes the same fraction of every (expert, tensor) group, spread over its blocks.

    Within a group of n candidates the j-th (by block index) gets the position of j in a
    van der Corput sequence, so any prefix of the greedy order covers each group evenly."""
    priority = np.zeros(len(block))
    groups: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(expert.tolist(), tensor.tolist())):
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        members.sort(key=lambda i: block[i])
        for j, i in enumerate(members):
            priority[i] = 1.0 - _van_der_corput(j)
    return priority


def _van_der_corput(n: int) -> float:
    q, denom = 0.0, 1.0
    while n:
        denom *= 2
        n, bit = divmod(n, 2)
        q += bit / denom
    return q
