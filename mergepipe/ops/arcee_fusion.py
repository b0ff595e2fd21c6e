"""Arcee Fusion (mergekit's ``arcee_fusion``): take the expert's change only where it matters most.

With the base a and the one other model x, per tensor: importance = |x - a| * KL_row, where KL_row =
sum over the last dimension of p log(p / q), p = softmax(x) + 1e-8, q = softmax(a) + 1e-8 (one value per
row, broadcast along it); threshold = median + 1.5 (q3 - q1) of the importance over the whole tensor
(quantiles by index floor(q (n - 1)) of the sorted values); out = a + (x - a) * [importance >= threshold].

The threshold is a whole-tensor statistic: ANALYZE (``--arcee``, in its one pass: analyze/gram.py) computes
it per (expert, tensor) from the importance of every entry, in float32 by mergekit's own torch expressions,
and the catalog stores it; the planner records it in the plan. The rows' KL and the mask are computed inside
each block (the grid cuts tensors along dim 0, so every row lies in one block): bit-equal to mergekit.
Above 1,000,000 entries mergekit estimates the quantiles from 1,000,000 entries drawn at random (with
replacement); ANALYZE then draws its 1,000,000 from a fixed-seed stream: statistically equal, not draw for
draw. A 1-D tensor is one softmax row: it must fit in one block (else refused, naming it).

Budget: base and exactly one model; an omitted block keeps the base's values (the change is dropped there);
the threshold does not depend on what is read. The additive error bound does not apply (the mask depends on
the values).
"""

from __future__ import annotations

from mergepipe.ops.spec import Consensus, OpSpec

EPS = 1e-8  # mergekit's
QUANTILE_SAMPLE_SIZE = 1_000_000  # mergekit's: above this many entries the quantiles come from a sample
SAMPLE_SEED = 0x41524345  # the fixed seed of ANALYZE's sample (mergekit draws from torch's global generator)

SPECS = (OpSpec("arcee_fusion", None, Consensus.NONE, False, False, nonlinear=True, joint=True, common=(),
                min_experts=1, max_experts=1, reference="Arcee Fusion, mergekit, https://arcee.ai",
                budget_semantics="an omitted block keeps the base's values",
                bound_note="n/a: arcee_fusion keeps the changes whose importance passes a per-tensor threshold"),)


def importance(x, base):
    """mergekit's _compute_importance (float32 rows along the last dimension)."""
    import torch
    import torch.nn.functional as F
    diff = (x - base).abs()
    p = F.softmax(x, dim=-1) + EPS
    q = F.softmax(base, dim=-1) + EPS
    kl_div = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    return diff * kl_div


def threshold(values) -> float:
    """mergekit's dynamic threshold, median + 1.5 IQR, of the importance values given (flat float32)."""
    import torch
    sorted_values, _ = torch.sort(values.reshape(-1))
    q = torch.tensor([0.25, 0.5, 0.75])
    q1, median, q3 = sorted_values[(q * (sorted_values.numel() - 1)).long()]
    return float(median + 1.5 * (q3 - q1))


def scalars(spec, gram, settings: dict, params: dict, ndim: int) -> list[float]:
    return [settings["arcee_threshold"]]


def block(spec, base, xs, scalars: list[float], params: dict, ndim: int):
    import torch
    x = xs[0]
    mask = (importance(x, base) >= torch.tensor(scalars[0], dtype=torch.float32)).float()
    return base + (x - base) * mask


METHODS = {"arcee_fusion": (scalars, block)}
