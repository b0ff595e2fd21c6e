"""TIES: keep each delta's largest magnitudes (per-tensor threshold from the catalog), elect a sign per
entry, and merge only the agreeing contributions (also the consensus step of dare_ties, breadcrumbs_ties
and della)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import Consensus, OpSpec, Sparsify
from mergepipe.ops.topk import NO_CUT, top_mask

if TYPE_CHECKING:
    import torch

SPECS = (OpSpec("ties", Sparsify.MAGNITUDE, Consensus.SIGN, True, False,
                reference="TIES-merging, Yadav et al. 2023, https://arxiv.org/abs/2306.01708"),)



def _thresholds(density: float, params: dict) -> list[float]:
    return [density]


def magnitude(delta: torch.Tensor, thresholds: list[float], block: int = 0) -> torch.Tensor:
    """Keep exactly the tensor's top-k entries (``thresholds`` = [thr, ratio, cut_block, cut_rank] from the
    catalog: ops.core.tensor_statistics); ``ratio`` is mergekit's per-tensor L1 rescale factor, applied
    to the kept entries as mergekit does (float32)."""
    thr = thresholds[0]
    ratio = thresholds[1] if len(thresholds) > 1 else 1.0
    cut = thresholds[2:4] if len(thresholds) > 3 else NO_CUT
    kept = delta * top_mask(delta.abs(), thr, cut[0], cut[1], block)
    return kept * ratio if ratio != 1.0 else kept



SPARSIFY = {Sparsify.MAGNITUDE: lambda delta, density, params, thresholds, seed, block: magnitude(delta, thresholds, block)}
THRESHOLDS = {Sparsify.MAGNITUDE: _thresholds}


def combine_consensus(base: torch.Tensor, deltas: list[tuple[float, torch.Tensor]], params: dict) -> torch.Tensor:
    """Sign election: sum the weighted deltas that agree with the elected sign of their sum
    [/ the weights of the agreeing entries when normalize]."""
    import torch
    lam = params["lambda"]
    if not deltas:
        return base
    # Arithmetic rather than torch.where/boolean masks: ~3x faster on CPU, same values.
    weighted = [w * d for w, d in deltas]
    total = weighted[0].clone()
    for wd in weighted[1:]:
        total += wd
    sign = (total >= 0) * 2.0 - 1.0  # elected sign; a zero sum elects +
    magnitude = torch.zeros_like(base)  # sum of |w_i d_i| over entries agreeing with the sign
    divisor = torch.zeros_like(base) if params["normalize"] else None
    for (w, _), wd in zip(deltas, weighted):
        agreeing = (wd * sign).clamp_(min=0)  # |w_i d_i| where it agrees, else 0
        magnitude += agreeing
        if divisor is not None:
            divisor.add_(torch.sign(agreeing), alpha=w)
    mixed = magnitude * sign
    if divisor is not None:
        mixed /= divisor.masked_fill_(divisor == 0, 1.0)
    return base + mixed * lam if lam != 1 else base + mixed
