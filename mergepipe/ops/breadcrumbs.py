"""Model breadcrumbs as mergekit's magnitude_outliers: drop both the largest (the top k_hi = int(gamma n))
and the smallest magnitudes of each delta, keeping the entries ranked [k_hi, k_hi + int(density n)) by
magnitude (exact k, ties at either cut-off by flat index: ops.core.tensor_statistics; thresholds and
cuts from the catalog). Density >= 1 keeps the delta unchanged (mergekit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import GAMMA, Consensus, OpSpec, Sparsify
from mergepipe.ops.streams import l1_rescale
from mergepipe.ops.topk import NO_CUT, top_mask

if TYPE_CHECKING:
    import torch

SPECS = (
    OpSpec("breadcrumbs", Sparsify.OUTLIERS, Consensus.NONE, False, False, extras=(GAMMA,),
           reference="model breadcrumbs, Davari & Belilovsky 2024, https://arxiv.org/abs/2312.06795"),
    OpSpec("breadcrumbs_ties", Sparsify.OUTLIERS, Consensus.SIGN, False, False, extras=(GAMMA,),
           reference="model breadcrumbs, https://arxiv.org/abs/2312.06795 (with TIES' sign election)"),
)


def outliers(delta: torch.Tensor, params: dict, thresholds: list[float], block: int = 0) -> torch.Tensor:
    """Keep the entries ranked in [k_hi, k_lo) of the tensor's exact magnitude order (``thresholds`` =
    [thr_hi, thr_lo, cut_block_hi, cut_rank_hi, cut_block_lo, cut_rank_lo]: ops.core.tensor_statistics)."""
    a = delta.abs()
    cuts = thresholds[2:6] if len(thresholds) > 5 else [*NO_CUT, *NO_CUT]
    kept = delta * (top_mask(a, thresholds[1], cuts[2], cuts[3], block)
                    & ~top_mask(a, thresholds[0], cuts[0], cuts[1], block))
    return l1_rescale(delta, kept) if params["rescale"] else kept


def _thresholds(density: float, params: dict) -> list[float]:
    """tau_hi (top gamma) and tau_lo (top gamma + density); none needed at density >= 1 (the delta is
    kept as it is, as mergekit's magnitude_outliers does)."""
    if density >= 1.0:
        return [1.0, 1.0]
    gamma = params["gamma"]
    return [round(gamma, 10), round(min(1.0, gamma + density), 10)]


SPARSIFY = {Sparsify.OUTLIERS: lambda delta, density, params, thresholds, seed, block: outliers(delta, params, thresholds,
                                                                                         block)}
THRESHOLDS = {Sparsify.OUTLIERS: _thresholds}
