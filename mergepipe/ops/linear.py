"""Linear (weighted average of whole models) and task arithmetic (base + weighted sum of deltas): the
additive operators, for which the planner's error bound holds.

A model soup (linear over models without a base_model, or with the base among the models) averages the
base in too: :func:`soup_block` follows mergekit's linear float32 operation order (a weighted sum model by
model, then one division by the float32 sum of the weights), so the result is bit-equal to mergekit's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.ops.spec import Consensus, OpSpec

if TYPE_CHECKING:
    import torch

SPECS = (
    OpSpec("linear", None, Consensus.NONE, True, False, aliases=("avg",), whole_models=True, base_optional=True,
           reference="model soups, Wortsman et al. 2022, https://arxiv.org/abs/2203.05482"),
    OpSpec("task_arithmetic", None, Consensus.NONE, False, False,
           reference="task arithmetic, Ilharco et al. 2023, https://arxiv.org/abs/2212.04089"),
)


def combine_additive(spec: OpSpec, base: torch.Tensor, deltas: list[tuple[float, torch.Tensor]],
                     weight_sum: float, params: dict) -> torch.Tensor:
    """base + lambda * sum_i w_i delta_i [/ sum of all weights when normalize]; whole-model operators
    without normalize scale the base by the weight sum (sum_i w_i x_i)."""
    import torch
    lam = params["lambda"]
    mixed = torch.zeros_like(base)
    for w, d in deltas:
        mixed += w * d  # not add_(alpha=w): keep the reference's rounding (weight, then sum)
    divisor = weight_sum if abs(weight_sum) >= 1e-8 else 1.0
    if spec.whole_models and not params["normalize"]:
        base = base * weight_sum  # sum_i w_i x_i = (sum_i w_i) base + sum_i w_i delta_i
    if params["normalize"]:
        mixed /= divisor
    if lam != 1:
        mixed *= lam
    return base + mixed


def soup_block(base: torch.Tensor, xs: list[torch.Tensor], weights: list[float], position: int,
               params: dict) -> torch.Tensor:
    """mergekit's linear over the models in config order: ``xs`` (the experts' values) with the base at
    ``position``; ``weights`` in that order. float32 weights, ``result.addcmul_`` model by model, one
    division by the weights' float32 sum (normalize), as mergekit's linear_merge; then lambda."""
    import torch
    models = list(xs)
    models.insert(position, base)
    w = torch.tensor([weights], dtype=torch.float32)  # [batch 1, models]: mergekit's weight tensor
    shape = (1,) * base.dim()
    result = torch.zeros_like(base)
    for x, c in zip(models, w.unbind(1)):
        result.addcmul_(x, c.reshape(shape))
    if params["normalize"]:
        result.div_(w.sum(dim=1).reshape(shape))
    lam = params["lambda"]
    return result * lam if lam != 1 else result
