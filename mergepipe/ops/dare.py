"""DARE: drop each delta entry at random (keep probability = density), optionally rescaling the kept
entries to preserve the block's L1 norm (per block, not per tensor: see ops.core)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import Consensus, OpSpec, Sparsify
from mergepipe.ops.streams import l1_rescale, uniform

if TYPE_CHECKING:
    import torch

SPECS = (
    OpSpec("dare_linear", Sparsify.RANDOM, Consensus.NONE, False, True,
           reference="DARE, Yu et al. 2024, https://arxiv.org/abs/2311.03099"),
    OpSpec("dare_ties", Sparsify.RANDOM, Consensus.SIGN, False, True, aliases=("dare",),
           reference="DARE, Yu et al. 2024, https://arxiv.org/abs/2311.03099 (with TIES' sign election)"),
)


def random_drop(delta: torch.Tensor, density: float, params: dict, seed: int) -> torch.Tensor:
    kept = delta * (uniform(seed, delta.shape) < density)
    return l1_rescale(delta, kept) if params["rescale"] else kept


SPARSIFY = {Sparsify.RANDOM: lambda delta, density, params, thresholds, seed, block: random_drop(delta, density, params, seed)}
