"""DELLA (MAGPRUNE) as mergekit 0.1.5's ``della_magprune``: drop entries at random with a keep probability
that rises linearly with the magnitude rank within each row, then (``rescale``, default on) restore the
L1 norm of the delta.

Per row of n entries (a 2-D tensor's rows; a 1-D tensor is one row), rank r = 0..n-1 of |delta|
ascending (equal magnitudes by position: a stable sort, where mergekit's argsort breaks ties
arbitrarily), ``p = (density - epsilon) + (r / (n - 1)) * 2 * epsilon`` in float32 (p = density when
n = 1, where mergekit's 0/0 gives NaN), keep iff u < p (u: the block's random stream, ops/streams.py).

Streaming forces two differences from mergekit, both documented in ops/core.py:
  * the L1 restoration ``kept * ||delta||_1 / ||kept||_1`` is per block, not per tensor (the kept
    part's norm depends on the random mask of every block: knowing it before the first block is
    written would take a second read of the tensor). The expected update is the same.
  * ranks are within each row of the block; for a 2-D tensor a block holds whole rows, so this is
    exactly mergekit's per-row rank. A 1-D tensor is ranked as one row over the whole tensor by
    mergekit; here within each block: identical whenever the tensor fits in one block (every 1-D
    tensor of up to block_bytes bytes: 256 Ki fp32 entries at the default 1 MiB), else per block.
The 1/p rescale of the DELLA paper (MergePipe's definition before issue 15) is no longer offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import EPSILON, Consensus, OpSpec, Sparsify
from mergepipe.ops.streams import l1_rescale, uniform

if TYPE_CHECKING:
    import torch

SPECS = (
    OpSpec("della", Sparsify.DELLA, Consensus.SIGN, True, True, extras=(EPSILON,),
           reference="DELLA-merging, Deep et al. 2024, https://arxiv.org/abs/2406.11617"),
    OpSpec("della_linear", Sparsify.DELLA, Consensus.NONE, False, True, extras=(EPSILON,),
           reference="DELLA-merging, Deep et al. 2024, https://arxiv.org/abs/2406.11617"),
)


def keep_probability(rows: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """mergekit's MAGPRUNE keep probability per entry of ``rows`` [R, n] (float32, see the module)."""
    import torch
    n = rows.shape[1]
    if n <= 1:
        return torch.full_like(rows, density)
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1, stable=True), dim=1, stable=True).float()
    rank_norm = (ranks / (n - 1)).clamp_(0, 1)
    return (density - epsilon) + rank_norm * 2 * epsilon


def della_block(delta: torch.Tensor, density: float, epsilon: float, rescale: bool, seed: int) -> torch.Tensor:
    """MAGPRUNE on one block: per-row rank keep probability, random mask, per-block L1 restoration."""
    rows = delta.reshape(delta.shape[0], -1) if delta.dim() >= 2 else delta.reshape(1, -1)
    keep = uniform(seed, rows.shape) < keep_probability(rows, density, epsilon)
    kept = (rows * keep).reshape(delta.shape)
    return l1_rescale(delta, kept) if rescale else kept


SPARSIFY = {Sparsify.DELLA: lambda delta, density, params, thresholds, seed, block: della_block(
    delta, density, params["epsilon"], params["rescale"], seed)}
