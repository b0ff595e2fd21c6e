"""SCE (mergekit's ``sce``, Wan et al. 2024): Select, Calculate, Erase.

With the base and K experts, per tensor: task vectors v_i = x_i - base; (Select: with ``select_topk`` < 1,
keep the entries whose variance across the experts is in the top fraction -- see below); Calculate: each
expert's weight is mean(v_i^2) / sum_j mean(v_j^2) (1/K when that sum is about 0), from the catalog's Gram
statistics (|v_i|^2 / numel); Erase: keep the entries whose sign agrees with the sign of sum_i v_i; out =
base + sum_i w_i m_i v_i / max(sum_i w_i m_i, 1e-6). Everything after the weights is elementwise, so each
block is merged on its own in mergekit's order.

``select_topk`` < 1 (Select): mergekit keeps the k = int(count_nonzero(var) * select_topk) entries with the
largest variance across the experts (torch.var, unbiased=False) and weighs the experts by their *masked*
task vectors. Both are whole-tensor statistics, taken from the catalog: ANALYZE (``mergepipe analyze
--sce-topk X``; a config merge asks for it) stores, per tensor and expert set, the exact k-th largest
variance, the exact-k cut among entries tied at it (variance descending, then flat index ascending: the rule
of ties' top-k) and each expert's sum of kept delta^2 (analyze/sce.py). The block kernel recomputes the
variance of its entries (elementwise across the experts, so equal to the whole tensor's) and masks with the
threshold and the cut. torch.topk keeps an unspecified subset of tied entries, so on entries tied at the
threshold (common with bf16 deltas) mergekit and MergePipe may keep different ones.

Budget: a block is read for all experts or for none; an omitted block keeps the base's values.
The additive error bound does not apply (sign election and data-dependent weights).
"""

from __future__ import annotations

from mergepipe.ops.interp import Gram
from mergepipe.ops.spec import Consensus, OpSpec, Param
from mergepipe.ops.topk import NO_CUT, top_mask

SELECT_TOPK = Param("select_topk", 1.0, "sce: fraction of entries kept by variance across experts (the "
                    "top-k comes from ANALYZE --sce-topk)", low=0.0, high=1.0, step=0.01)

SPECS = (OpSpec("sce", None, Consensus.NONE, False, False, extras=(SELECT_TOPK,), nonlinear=True, joint=True,
                gram=True, common=(), min_experts=1,
                reference="SCE, Wan et al. 2024, https://arxiv.org/abs/2408.07990",
                budget_semantics="all experts' blocks are read or none; an omitted block keeps the base's values",
                bound_note="n/a: sce elects signs and weighs experts by their whole-tensor energy"),)


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """The experts' weights (float32, mergekit's sce_weight), then the top-k threshold, cut block and cut
    rank (threshold -1: select everything)."""
    import torch
    k = len(gram.bd)
    numel = max(gram.numel, 1)
    selection = settings.get("sce")
    topk = params.get("select_topk", 1.0)
    if topk >= 1.0:
        energy, tail = [gram.dd[i][i] for i in range(k)], [-1.0, float(NO_CUT[0]), 0.0]
    elif topk <= 0.0:  # keep nothing: every task vector is zero (weights 1/K, the output the base)
        energy, tail = [0.0] * k, [float("inf"), float(NO_CUT[0]), 0.0]
    else:
        energy, thr, cut, rank = selection
        tail = [float(thr), float(cut), float(rank)]
    weights = torch.tensor([e / numel for e in energy], dtype=torch.float32)  # each rounded as f32(e / numel)
    weight_sum = torch.sum(weights).item()
    if abs(weight_sum) < 1e-6:
        weights = torch.ones_like(weights) / k
    else:
        weights = weights / weight_sum
    return [float(w) for w in weights] + tail


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    import torch
    k = len(xs)
    task_vectors = torch.stack([x - base for x in xs], dim=0)
    thr, cut_block, cut_rank = scalars[k:k + 3]
    if thr >= 0:  # mergekit's sce_mask: the tensor's top-k variance across the experts
        var = torch.var(task_vectors, dim=0, unbiased=False)
        keep = top_mask(var, thr, int(cut_block), int(cut_rank), params.get("block_index", 0))
        task_vectors = task_vectors * keep.to(base.dtype).unsqueeze(0)
    sign = task_vectors.sign()
    majority = (task_vectors.sum(dim=0) >= 0).to(base.dtype) * 2 - 1
    erase_mask = sign == majority
    tv_weights = torch.tensor(scalars[:k], dtype=torch.float32)
    while tv_weights.dim() < task_vectors.dim():
        tv_weights = tv_weights.unsqueeze(-1)
    erased = tv_weights * erase_mask
    merged = (task_vectors * erased).sum(dim=0)
    return base + merged / torch.sum(erased, dim=0).clamp(min=1e-6)


METHODS = {"sce": (scalars, block)}
