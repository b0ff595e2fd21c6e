"""SCE (mergekit's ``sce``, Wan et al. 2024): Select, Calculate, Erase.

With the base and K experts, per tensor: task vectors v_i = x_i - base; (Select: with ``select_topk`` < 1,
keep the entries whose variance across the experts is in the top fraction -- see below); Calculate: each
expert's weight is mean(v_i^2) / sum_j mean(v_j^2) (1/K when that sum is about 0), from the catalog's Gram
statistics (|v_i|^2 / numel); Erase: keep the entries whose sign agrees with the sign of sum_i v_i; out =
base + sum_i w_i m_i v_i / max(sum_i w_i m_i, 1e-6). Everything after the weights is elementwise, so each
block is merged on its own in mergekit's order.

``select_topk`` < 1 needs a per-tensor top-k threshold of the variance across the experts, a statistic
ANALYZE does not gather: refused (the default, 1, selects everything).

Budget: a block is read for all experts or for none; an omitted block keeps the base's values.
The additive error bound does not apply (sign election and data-dependent weights).
"""

from __future__ import annotations

from mergepipe.ops.interp import Gram, f32
from mergepipe.ops.spec import Consensus, OpSpec, Param

SELECT_TOPK = Param("select_topk", 1.0, "sce: fraction of entries kept by variance across experts (only 1 "
                    "is supported)", low=0.0, high=1.0, step=0.01)

SPECS = (OpSpec("sce", None, Consensus.NONE, False, False, extras=(SELECT_TOPK,), nonlinear=True, joint=True,
                gram=True, common=(), min_experts=1,
                reference="SCE, Wan et al. 2024, https://arxiv.org/abs/2408.07990",
                budget_semantics="all experts' blocks are read or none; an omitted block keeps the base's values",
                bound_note="n/a: sce elects signs and weighs experts by their whole-tensor energy"),)


def check(params: dict) -> str | None:
    if params.get("select_topk", 1.0) < 1.0:
        return ("sce select_topk < 1 needs a per-tensor top-k of the variance across the experts, which ANALYZE "
                "does not compute: not supported (leave select_topk at 1)")
    return None


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """The experts' weights (float32, mergekit's sce_weight)."""
    import torch
    k = len(gram.bd)
    numel = max(gram.numel, 1)
    weights = torch.stack([f32(gram.dd[i][i] / numel)[0] for i in range(k)])
    weight_sum = torch.sum(weights).item()
    if abs(weight_sum) < 1e-6:
        weights = torch.ones_like(weights) / k
    else:
        weights = weights / weight_sum
    return [float(w) for w in weights]


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    import torch
    task_vectors = torch.stack([x - base for x in xs], dim=0)
    sign = task_vectors.sign()
    majority = (task_vectors.sum(dim=0) >= 0).to(base.dtype) * 2 - 1
    erase_mask = sign == majority
    tv_weights = torch.tensor(scalars, dtype=torch.float32)
    while tv_weights.dim() < task_vectors.dim():
        tv_weights = tv_weights.unsqueeze(-1)
    erased = tv_weights * erase_mask
    merged = (task_vectors * erased).sum(dim=0)
    return base + merged / torch.sum(erased, dim=0).clamp(min=1e-6)


METHODS = {"sce": (scalars, block)}
