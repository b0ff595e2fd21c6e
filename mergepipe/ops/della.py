"""DELLA (MAGPRUNE): drop entries at random with a keep probability that rises with magnitude rank
within each row, rescaling the kept ones by 1/p."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import EPSILON, Consensus, OpSpec, Sparsify
from mergepipe.ops.streams import uniform

if TYPE_CHECKING:
    import torch

SPECS = (
    OpSpec("della", Sparsify.DELLA, Consensus.SIGN, True, True, extras=(EPSILON,),
           reference="DELLA-merging, Deep et al. 2024, https://arxiv.org/abs/2406.11617"),
    OpSpec("della_linear", Sparsify.DELLA, Consensus.NONE, False, True, extras=(EPSILON,),
           reference="DELLA-merging, Deep et al. 2024, https://arxiv.org/abs/2406.11617"),
)


def della_block(delta: torch.Tensor, density: float, epsilon: float, rescale: bool, seed: int) -> torch.Tensor:
    """MAGPRUNE: keep probability rises linearly with magnitude rank within each row."""
    import torch
    rows = delta.reshape(delta.shape[0], -1) if delta.dim() >= 2 else delta.reshape(1, -1)
    n = rows.shape[1]
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1, stable=True), dim=1, stable=True).float()
    probs = (density - epsilon) + (2 * epsilon / n) * ranks if n > 1 else torch.full_like(rows, density)
    probs = probs.clamp(1e-6, 1.0)
    keep = uniform(seed, rows.shape) < probs
    kept = (rows / probs if rescale else rows) * keep
    return kept.reshape(delta.shape)


SPARSIFY = {Sparsify.DELLA: lambda delta, density, params, thresholds, seed: della_block(
    delta, density, params["epsilon"], params["rescale"], seed)}
