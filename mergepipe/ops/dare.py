"""DARE: drop each delta entry at random (keep probability = density), optionally rescaling the kept
entries to preserve the block's L1 norm (per block, not per tensor: see ops.core)."""

from __future__ import annotations

import torch

from mergepipe.ops.spec import OpSpec
from mergepipe.ops.streams import l1_rescale, uniform

SPECS = (
    OpSpec("dare_linear", "random", False, False, True),
    OpSpec("dare_ties", "random", True, False, True, aliases=("dare",)),
)


def random_drop(delta: torch.Tensor, density: float, params: dict, seed: int) -> torch.Tensor:
    kept = delta * (uniform(seed, delta.shape) < density)
    return l1_rescale(delta, kept) if params["rescale"] else kept
