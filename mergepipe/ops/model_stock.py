"""Model Stock (mergekit's ``model_stock``, Jang et al. 2024): interpolate between the base and the
experts' average by a ratio from the mean angle between their task vectors.

At least two experts and a base. Per tensor, with offsets v_i = x_i - base: cos = mean over pairs i<j of
<v_i, v_j> / max(|v_i||v_j|, 1e-6) (clamped to [-1, 1]); t = K cos / (1 + (K-1) cos) (0 where the
denominator is about 0); out = t * mean_i(x_i) + (1 - t) * base. The pairwise dot products and norms come
from the catalog's Gram statistics (experts analyzed together). ``filter_wise: true`` takes the angle
per row (last dimension) of a >= 2-D tensor, computed inside the block (bit-equal to mergekit); 1-D
tensors use the whole-tensor angle.

Budget: the planner reads a block for all experts or for none (joint selection: the average needs every
expert); an omitted block keeps the base's values (t = 0 there). The additive error bound does not apply.
"""

from __future__ import annotations

from mergepipe.ops.interp import Gram, f32, rows_mode
from mergepipe.ops.spec import Consensus, OpSpec, Param

FILTER_WISE = Param("filter_wise", False, "model_stock: one angle per row (filter) instead of per tensor")

SPECS = (OpSpec("model_stock", None, Consensus.NONE, False, False, extras=(FILTER_WISE,), nonlinear=True,
                joint=True, gram=True, common=(), min_experts=2,
                reference="Model Stock, Jang et al. 2024, https://arxiv.org/abs/2403.19522",
                budget_semantics="all experts' blocks are read or none; an omitted block keeps the base's values",
                bound_note="n/a: model_stock is not additive (t depends on the angles between whole task vectors)"),)


def _ratio(cos_theta, count: int):
    import torch
    denominator = 1 + (count - 1) * cos_theta
    singular = denominator.abs() < 1e-6
    safe_denominator = torch.where(singular, torch.ones_like(denominator), denominator)
    return torch.where(singular, torch.zeros_like(cos_theta), (count * cos_theta) / safe_denominator)


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """[t] of the whole tensor: the mean cosine over the pairs i < j of the K x K Gram matrix, in one pass of
    whole-array steps with the same float64 / float32 operations, element by element, as mergekit's per pair
    (norms rounded to float32, their float32 product, the float64 quotient rounded to float32, clamped), and
    torch's float32 mean over the pairs in the same order."""
    import numpy as np
    import torch
    k = len(gram.bd)
    dd = np.array(gram.dd, dtype=np.float64).reshape(k, k)
    norms = np.sqrt(np.maximum(np.diagonal(dd), 0.0)).astype(np.float32)
    i, j = np.triu_indices(k, 1)  # the pairs in the order of the loops i < j
    norm_product = (norms[i] * norms[j]).astype(np.float64)
    cos = np.clip((dd[i, j] / np.maximum(norm_product, 1e-6)).astype(np.float32), np.float32(-1), np.float32(1))
    cos_theta = torch.from_numpy(np.ascontiguousarray(cos)).mean(dim=0).unsqueeze(-1)
    return [float(_ratio(cos_theta, k))]


def _rows(base, xs):
    """mergekit's filter_wise model stock on a block of whole rows."""
    import torch
    offsets = [x - base for x in xs]
    cos_thetas = []
    for idx, a in enumerate(offsets):
        for b in offsets[idx + 1:]:
            norm_product = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cos_thetas.append(((a * b).sum(dim=-1) / norm_product.clamp(min=1e-6)).clamp(-1, 1))
    cos_theta = torch.stack(cos_thetas).mean(dim=0).unsqueeze(-1)
    return _ratio(cos_theta, len(xs))


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    t = _rows(base, xs) if rows_mode(ndim, params.get("filter_wise", False)) else f32(scalars[0])
    average = sum(xs) / len(xs)
    return t * average + (1 - t) * base


METHODS = {"model_stock": (scalars, block)}
