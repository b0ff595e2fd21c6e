"""Candidate blocks and the greedy selection: score per byte, deterministic tie-break, budget-sound
by construction; the budget/bound frontier."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Candidates:
    """Every block the operator could use, with its bytes and score, in greedy order."""

    expert: np.ndarray  # index into experts
    tensor: np.ndarray  # index into tensor names
    block: np.ndarray
    nbytes: np.ndarray
    score: np.ndarray
    bound_term: np.ndarray  # |c_i| * ||delta|| (additive error bound contribution)
    priority: np.ndarray | None = None  # greedy key (higher first); default score per byte
    setup: np.ndarray | None = None  # bytes read once per (expert, tensor) if any of its blocks is (LoRA A)
    order: np.ndarray = field(default=None)  # greedy order

    def __post_init__(self):
        if self.setup is None:
            self.setup = np.zeros(len(self.nbytes), dtype=np.int64)
        self.group = self.expert * (int(self.tensor.max(initial=0)) + 1) + self.tensor
        if self.priority is None:
            # a block's cost carries its share of the tensor's one-off bytes
            _, inverse, counts = np.unique(self.group, return_inverse=True, return_counts=True)
            cost = self.nbytes + self.setup / counts[inverse]
            ratio = np.where(cost > 0, self.score / np.maximum(cost, 1), np.inf)
        else:
            ratio = self.priority
        self.ratio = ratio  # the greedy key: score per byte, or the strategy's priority
        # lexsort: last key is primary -> sort by -ratio, then expert, tensor, block
        self.order = np.lexsort((self.block, self.tensor, self.expert, -ratio))
        grp = self.group[self.order]
        first = np.zeros(len(grp), dtype=bool)
        first[np.unique(grp, return_index=True)[1]] = True
        self.cost_in_order = self.nbytes[self.order] + self.setup[self.order] * first
        self.cum_bytes = np.cumsum(self.cost_in_order)
        self.cum_bound = np.cumsum(self.bound_term[self.order])

    @property
    def full_bytes(self) -> int:
        return int(self.cost_in_order.sum())

    def bytes_of(self, chosen: np.ndarray) -> np.ndarray:
        """Bytes each chosen candidate costs: its own, plus its group's one-off bytes for the first."""
        first = np.zeros(len(chosen), dtype=bool)
        first[np.unique(self.group[chosen], return_index=True)[1]] = True
        return self.nbytes[chosen] + self.setup[chosen] * first

    def select(self, budget_bytes: int) -> np.ndarray:
        """Greedy: walk the order, take every block that still fits."""
        if budget_bytes >= self.full_bytes:
            return self.order
        # Fast path: the longest prefix that fits, then the remaining blocks that still fit.
        k = int(np.searchsorted(self.cum_bytes, budget_bytes, side="right"))
        chosen = list(self.order[:k])
        used = int(self.cum_bytes[k - 1]) if k else 0
        paid = set(self.group[self.order[:k]].tolist())
        for c in self.order[k:]:
            extra = int(self.nbytes[c]) + (0 if self.group[c] in paid else int(self.setup[c]))
            if used + extra <= budget_bytes:
                chosen.append(c)
                used += extra
                paid.add(self.group[c])
        return np.array(chosen, dtype=np.int64)

    def frontier(self, points: int = 101) -> list[tuple[int, float]]:
        """(budget bytes, omitted bound) along the greedy prefix, for the budget-bound curve."""
        total = float(self.bound_term.sum())
        if len(self.order) == 0:
            return [(0, 0.0)]
        idx = np.unique(np.linspace(0, len(self.order), points).astype(int))
        out = []
        for k in idx:
            used = int(self.cum_bytes[k - 1]) if k else 0
            covered = float(self.cum_bound[k - 1]) if k else 0.0
            out.append((used, max(0.0, total - covered)))
        return out

    def smallest_budget_for(self, target_abs: float) -> int:
        total = float(self.bound_term.sum())
        need = total - target_abs
        if need <= 0:  # reading nothing already meets the target
            return 0
        k = int(np.searchsorted(self.cum_bound, need - 1e-12 * max(1.0, total), side="left"))
        k = min(k, len(self.order) - 1)
        return int(self.cum_bytes[k])
