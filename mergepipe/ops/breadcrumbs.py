"""Model breadcrumbs: drop both the largest (the top ``gamma``) and the smallest magnitudes of each delta,
keeping tau_lo <= |d| < tau_hi (per-tensor thresholds from the catalog)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import GAMMA, Consensus, OpSpec, Sparsify
from mergepipe.ops.streams import l1_rescale

if TYPE_CHECKING:
    import torch

SPECS = (
    OpSpec("breadcrumbs", Sparsify.OUTLIERS, Consensus.NONE, False, False, extras=(GAMMA,),
           reference="model breadcrumbs, Davari & Belilovsky 2024, https://arxiv.org/abs/2312.06795"),
    OpSpec("breadcrumbs_ties", Sparsify.OUTLIERS, Consensus.SIGN, False, False, extras=(GAMMA,),
           reference="model breadcrumbs, https://arxiv.org/abs/2312.06795 (with TIES' sign election)"),
)


def outliers(delta: torch.Tensor, params: dict, thresholds: list[float], offset: int = 0) -> torch.Tensor:
    """Keep the entries ranked in [k_hi, k_lo) of the tensor's exact magnitude order (``thresholds`` =
    [thr_hi, thr_lo, cut_hi, cut_lo]: ops.core.tensor_statistics)."""
    from mergepipe.ops.core import NO_CUT
    from mergepipe.ops.ties import top_mask
    a = delta.abs()
    cut_hi, cut_lo = (thresholds[2], thresholds[3]) if len(thresholds) > 3 else (NO_CUT, NO_CUT)
    kept = delta * (top_mask(a, thresholds[1], cut_lo, offset) & ~top_mask(a, thresholds[0], cut_hi, offset))
    return l1_rescale(delta, kept) if params["rescale"] else kept


def _thresholds(density: float, params: dict) -> list[float]:
    """tau_hi (top gamma) and tau_lo (top gamma + density); none needed at density >= 1 (the delta is
    kept as it is, as mergekit's magnitude_outliers does)."""
    if density >= 1.0:
        return [1.0, 1.0]
    gamma = params["gamma"]
    return [round(gamma, 10), round(min(1.0, gamma + density), 10)]


SPARSIFY = {Sparsify.OUTLIERS: lambda delta, density, params, thresholds, seed, offset: outliers(delta, params, thresholds,
                                                                                          offset)}
THRESHOLDS = {Sparsify.OUTLIERS: _thresholds}
