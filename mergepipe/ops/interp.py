"""Shared pieces of the interpolation methods (slerp, nuslerp, model_stock, multislerp, karcher, nearswap):
the per-tensor Gram statistics they read from the catalog, and float32 scalar helpers.

These methods are not ``base + fixed coefficients x deltas`` over the block grid: each output tensor
depends on whole-tensor angles and norms (slerp's angle between base and expert, model_stock's mean
angle between task vectors, ...). Those come from ANALYZE's Gram statistics (``catalog/gram.py``):
per base tensor ||base||^2, <base, delta_i> and <delta_i, delta_j> for the experts analyzed together,
accumulated in float64 over float32 deltas (the deltas mergekit computes). The planner turns them into a
few per-tensor scalars (``scalars``, recorded in the plan); the engine then merges block by block with
the method's own block kernel (``block``), following mergekit's float32 operation order. The scalars are
computed in float32 by the same torch expressions as mergekit from float64 statistics, so they can
differ from mergekit's float32 reductions by an ulp or so: outputs then differ by a few float32 ulps.
Nothing here is read from disk and no extra pass over a tensor is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Gram:
    """Per-tensor statistics of one base tensor and K experts (deltas delta_i = x_i - base, float32)."""

    bb: float | None  # ||base||^2 (None: not stored, e.g. delta checkpoints only)
    bd: tuple[float, ...]  # <base, delta_i>
    dd: tuple[tuple[float, ...], ...]  # <delta_i, delta_j>
    numel: int = 0

    def xx(self, i: int, j: int) -> float:
        """<x_i, x_j> of the full expert tensors."""
        return self.bb + self.bd[i] + self.bd[j] + self.dd[i][j]

    def bx(self, i: int) -> float:
        return self.bb + self.bd[i]

    def dnorm(self, i: int) -> float:
        return math.sqrt(max(self.dd[i][i], 0.0))

    def xnorm(self, i: int) -> float:
        return math.sqrt(max(self.xx(i, i), 0.0))

    @property
    def bnorm(self) -> float:
        return math.sqrt(max(self.bb, 0.0))


def f32(value: float):
    """A float32 torch tensor of shape [1] (mergekit's per-tensor scalars are float32 tensors)."""
    import torch
    return torch.tensor([value], dtype=torch.float32)


def floats(t) -> list[float]:
    return [float(v) for v in t.reshape(-1).tolist()]


def rows_mode(ndim: int, flag: bool) -> bool:
    """mergekit's per-row variants (``dim=-1`` of a >= 2-D tensor) are computed inside a block: the grid
    cuts tensors along dim 0, so every row lies in one block. A 1-D tensor is one row: whole-tensor
    statistics from the catalog."""
    return flag and ndim >= 2
