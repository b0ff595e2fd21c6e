"""SLERP: spherical interpolation between the base model and one other model, per tensor (mergekit's
``slerp``: ``base_model`` must be one of exactly two models; ``t`` is required and may be a gradient
over the layers or a list of filter conditions; t = 0 gives the base, t = 1 the other model).

Per tensor, with a = base and b = the other model as float32 vectors: dot = <a/|a|, b/|b|> (norms
below 1e-8 count as 1), theta = acos(dot); coefficients ca = sin((1-t)theta)/sin(theta),
cb = sin(t theta)/sin(theta), or 1-t and t where |dot| > 0.9995 (nearly collinear: linear
interpolation); out = ca*a + cb*b. The norms and the dot product come from the catalog's Gram
statistics (|a|^2, <a, delta>, |delta|^2), never from a read of the whole tensor.

Budget: a block left out of the plan keeps the base's values there (t = 0 on that block); every other
block, the unchanged ones included, is interpolated with the tensor's coefficients (a block the expert
does not change has b = a there and is not read). The additive error bound does not apply.
"""

from __future__ import annotations

from mergepipe.ops.interp import Gram, f32, floats
from mergepipe.ops.spec import Consensus, OpSpec, Param

T = Param("t", 0.5, "slerp/nearswap: interpolation factor (0: the base, 1: the other model); a number, a gradient "
          "over the layers or filter conditions (mergekit has no default: the merge must give it)",
          gradient=True, required=True, label="t (0: base, 1: other model)", step=0.05, decimals=2)
DOT_THRESHOLD = 0.9995  # mergekit's slerp(): above it, linear interpolation
EPS = 1e-8

SPECS = (OpSpec("slerp", None, Consensus.NONE, False, False, extras=(T,), nonlinear=True, joint=True, gram=True,
                common=(), min_experts=1, max_experts=1,
                reference="mergekit slerp (Shoemake 1985), https://en.wikipedia.org/wiki/Slerp",
                budget_semantics="an omitted block keeps the base's values (t = 0 there)",
                bound_note="n/a: slerp is not additive (its coefficients depend on the whole-tensor angle)"),)


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """[ca, cb] of one tensor (float32 values, mergekit's expressions)."""
    import torch
    na, nb = f32(gram.bnorm), f32(gram.xnorm(0))
    na = torch.where(na > EPS, na, 1)
    nb = torch.where(nb > EPS, nb, 1)
    dot = f32(gram.bx(0) / (float(na) * float(nb))).clamp(-1, 1).reshape(1, 1)
    t = torch.tensor([settings["t"]], dtype=torch.float32).reshape(-1, 1)
    linear = dot.abs() > DOT_THRESHOLD
    theta = torch.acos(torch.where(linear, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(linear, 1 - t, torch.sin((1 - t) * theta) / sin_theta)
    coef_b = torch.where(linear, t, torch.sin(t * theta) / sin_theta)
    return floats(coef_a) + floats(coef_b)


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    ca, cb = f32(scalars[0]), f32(scalars[1])
    return ca * base + cb * xs[0]


METHODS = {"slerp": (scalars, block)}
