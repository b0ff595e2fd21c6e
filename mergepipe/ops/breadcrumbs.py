"""Model breadcrumbs: drop both the largest (the top ``gamma``) and the smallest magnitudes of each delta,
keeping tau_lo <= |d| < tau_hi (per-tensor thresholds from the catalog)."""

from __future__ import annotations

import torch

from mergepipe.ops.spec import OpSpec
from mergepipe.ops.streams import l1_rescale

SPECS = (
    OpSpec("breadcrumbs", "magnitude_outliers", False, False, False, params={"gamma": 0.01}),
    OpSpec("breadcrumbs_ties", "magnitude_outliers", True, False, False, params={"gamma": 0.01}),
)


def outliers(delta: torch.Tensor, params: dict, thresholds: list[float]) -> torch.Tensor:
    a = delta.abs()
    kept = delta * ((a >= thresholds[1]) & (a < thresholds[0]))
    return l1_rescale(delta, kept) if params["rescale"] else kept
