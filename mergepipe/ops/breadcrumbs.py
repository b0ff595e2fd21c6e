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


def outliers(delta: torch.Tensor, params: dict, thresholds: list[float]) -> torch.Tensor:
    a = delta.abs()
    kept = delta * ((a >= thresholds[1]) & (a < thresholds[0]))
    return l1_rescale(delta, kept) if params["rescale"] else kept


def _thresholds(density: float, params: dict) -> list[float]:
    """tau_hi (top gamma) and tau_lo (top gamma + density); none needed at density >= 1 (the delta is
    kept as it is, as mergekit's magnitude_outliers does)."""
    if density >= 1.0:
        return [1.0, 1.0]
    gamma = params["gamma"]
    return [round(gamma, 10), round(min(1.0, gamma + density), 10)]


SPARSIFY = {Sparsify.OUTLIERS: lambda delta, density, params, thresholds, seed: outliers(delta, params, thresholds)}
THRESHOLDS = {Sparsify.OUTLIERS: _thresholds}
