"""NuSLERP (mergekit's ``nuslerp``): spherical interpolation of two experts' task vectors against the base.

Exactly two models besides the base; t = w_2 / (w_1 + w_2) from their weights (0.5 when the weights sum
to about 0). With v_i = x_i - base: out = base + (sin((1-t)theta) v_1 + sin(t theta) v_2) / sin(theta),
theta the angle between v_1 and v_2 (linear (1-t) v_1 + t v_2 where they are collinear).
``nuslerp_flatten`` (default on): one angle per tensor, from the catalog's Gram statistics.
``nuslerp_flatten: false``: one angle per row (last dimension) of a >= 2-D tensor, computed inside the
block (rows never straddle blocks; bit-equal to mergekit); 1-D tensors use the whole-tensor angle.
``nuslerp_row_wise: true`` with ``nuslerp_flatten: false`` (an angle per column: it needs every row of a
tensor at once) is refused.

Without a ``base_model`` mergekit interpolates the two models themselves (v_0 = x_0, v_1 = x_1, no base added).
MergePipe plans that as a soup (config/soup.py): the first model is the reference, read in full as the "base",
the second its one expert; the angle comes from ||x_0||^2 = ||base||^2, <x_0, x_1> = ||base||^2 + <base, delta>
and ||x_1||^2 (the Gram statistics with the base read: full checkpoints).

Budget: a block is read for both experts or for neither (joint selection); an omitted block keeps the
base's values (task vectors 0 there; without a base_model: the reference model's values, t = 0 there). The
additive error bound does not apply.
"""

from __future__ import annotations

from mergepipe.ops.interp import Gram, f32, floats, rows_mode
from mergepipe.ops.spec import Consensus, OpSpec, Param

ROW_WISE = Param("nuslerp_row_wise", False, "nuslerp: with nuslerp_flatten off, interpolate columns instead of rows")
FLATTEN = Param("nuslerp_flatten", True, "nuslerp: one angle per tensor (off: one per row)")

SPECS = (OpSpec("nuslerp", None, Consensus.NONE, False, False, extras=(ROW_WISE, FLATTEN), nonlinear=True,
                joint=True, gram=True, common=("weight",), min_experts=2, max_experts=2, base_optional=True,
                reference="mergekit nuslerp, https://github.com/arcee-ai/mergekit",
                budget_semantics="both experts' blocks are read or neither; an omitted block keeps the base's values",
                bound_note="n/a: nuslerp is not additive (its coefficients depend on whole-tensor angles)"),)


def interpolation_t(weights) -> float:
    total = sum(weights)
    return 0.5 if abs(total) < 1e-6 else weights[1] / total


def check(params: dict) -> str | None:
    if params.get("nuslerp_row_wise") and not params.get("nuslerp_flatten"):
        return ("nuslerp_row_wise with nuslerp_flatten off needs an angle per column, i.e. every row of a tensor "
                "at once: not supported by a block-streaming merge (use nuslerp_flatten, or row-wise off)")
    return None


def _normalize_norm(n: float) -> float:
    return max(n, 1e-7)


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """[t, colinear, sin((1-t)theta), sin(t theta), sin(theta)] of the whole tensor; without a base_model one
    more, 1 (the two vectors are the reference and the one expert's whole values)."""
    import torch
    whole = "reference_weight" in settings
    if whole:
        t = interpolation_t([settings["reference_weight"], settings["weights"][0]])
        n0, n1, dot = float(f32(gram.bnorm)), float(f32(gram.xnorm(0))), gram.bx(0)
    else:
        t = interpolation_t(settings["weights"])
        n0, n1, dot = float(f32(gram.dnorm(0))), float(f32(gram.dnorm(1))), gram.dd[0][1]
    cos_theta = f32(dot / (_normalize_norm(n0) * _normalize_norm(n1))).clamp(-1, 1)
    eps = 1e-8
    colinear = (1 - cos_theta.square()) <= eps ** 2
    theta = torch.acos(torch.where(colinear, 0, cos_theta))
    sin_theta = torch.sin(theta)
    out = [t, float(colinear)] + floats(torch.sin((1 - t) * theta)) + floats(torch.sin(t * theta)) + floats(sin_theta)
    return out + [1.0] if whole else out


def nuslerp_rows(t: float, v0, v1, eps: float = 1e-8):
    """mergekit's nuslerp(dim=-1, flatten=False) on a block of whole rows."""
    import torch

    def _normalize(x, eps: float = 1e-7):
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=eps)

    v0_u, v1_u = _normalize(v0), _normalize(v1)
    cos_theta = torch.sum(v0_u * v1_u, dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos_theta.square()) <= eps ** 2
    theta = torch.acos(torch.where(colinear, 0, cos_theta))
    sin_theta = torch.sin(theta)
    result = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin_theta
    return torch.where(colinear, (1 - t) * v0 + t * v1, result)


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    t, colinear, s0, s1, st = scalars[:5]
    whole = len(scalars) > 5  # no base_model: the reference and the expert themselves
    v0, v1 = (base, xs[0]) if whole else (xs[0] - base, xs[1] - base)
    if rows_mode(ndim, not params.get("nuslerp_flatten", True)):
        result = nuslerp_rows(t, v0, v1)
    elif colinear:
        result = (1 - t) * v0 + t * v1
    else:
        result = (f32(s0) * v0 + f32(s1) * v1) / f32(st)
    return result if whole else base + result


METHODS = {"nuslerp": (scalars, block)}
