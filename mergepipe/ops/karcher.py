"""Karcher mean (mergekit's ``karcher``): the weighted Riemannian mean of the models on the unit sphere,
rescaled by their mean norm. mergekit averages every entry of the group with equal weights: the models
and, when ``base_model`` is given, the base as well. Without a base_model (a config listing the models only)
MergePipe plans against the first model as the reference (config/soup.py): it is the "base" here, which
karcher averages in like any model, so the group is exactly mergekit's.

The iteration is per tensor and over the whole tensor, but every iterate is a linear combination of the
unit vectors x_i / |x_i|: so MergePipe runs mergekit's iteration (``max_iter``, ``tol``, its branches) on
coefficient vectors, with inner products from the catalog's Gram statistics (<x_i, x_j> from ||base||^2,
<base, delta_i>, <delta_i, delta_j>) in float64, and the engine applies the final coefficients block by
block: out = sum_i c_i x_i. No extra read, no whole tensor in memory. mergekit iterates in float32, so
the outputs differ by float32 rounding of that iteration (measured in the README).

Budget: a block is read for all experts or for none; an omitted block keeps the base's values.
The additive error bound does not apply.
"""

from __future__ import annotations

import math

from mergepipe.ops.interp import Gram, f32
from mergepipe.ops.spec import Consensus, OpSpec, Param

MAX_ITER = Param("max_iter", 10.0, "karcher: most iterations of the mean", low=0.0, step=1.0, decimals=0)
TOL = Param("tol", 1e-5, "karcher: convergence tolerance", low=0.0, step=1e-5)

SPECS = (OpSpec("karcher", None, Consensus.NONE, False, False, extras=(MAX_ITER, TOL), nonlinear=True, joint=True,
                gram=True, common=(), min_experts=1, base_optional=True,
                reference="mergekit karcher, https://arxiv.org/abs/2603.04972",
                budget_semantics="all experts' blocks are read or none; an omitted block keeps the base's values",
                bound_note="n/a: the Karcher mean is not additive (an iteration over whole-tensor angles)"),)


def _matrix(gram: Gram):
    """[[<x_i, x_j>, <x_i, base>], [<base, x_j>, ||base||^2]] in float64, each entry summed in Gram.xx's order."""
    import numpy as np
    k = len(gram.bd)
    bd = np.array(gram.bd, dtype=np.float64)
    g = np.zeros((k + 1, k + 1))
    bx = gram.bb + bd
    g[:k, :k] = bx[:, None] + bd[None, :] + np.array(gram.dd, dtype=np.float64).reshape(k, k)
    g[:k, k] = g[k, :k] = bx
    g[k, k] = gram.bb
    return g


def _clip(values):
    """min(1.0, max(-1.0, v)) of each value, as Python's min and max take it (NaN -> -1.0)."""
    import numpy as np
    values = np.where(values > -1.0, values, -1.0)
    return np.where(values < 1.0, values, 1.0)


def _tangent(g, mean, units, na, tol: float):
    """sum over the valid models, in their order, of a (theta / sin theta) (u - <mean, u> mean): mergekit's
    loop with every model's term computed at once (<mean, u> = (mean @ g) @ u; terms added one after another)."""
    import numpy as np
    dots = _clip(units @ (mean @ g)).tolist()
    thetas = [math.acos(d) for d in dots]
    keep = [i for i, theta in enumerate(thetas) if not theta < tol]
    coef = np.array([na[i] * (thetas[i] / math.sin(thetas[i])) for i in keep])
    terms = coef[:, None] * (units[keep] - np.array(dots)[keep][:, None] * mean[None, :])
    return np.concatenate([np.zeros((1, len(mean))), terms]).sum(axis=0)


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """Coefficients of [x_1, ..., x_K, base] in the output."""
    import numpy as np
    g = _matrix(gram)
    n = len(g)
    max_iter, tol = int(params["max_iter"]), params["tol"]
    alphas = [1.0 / n] * n
    diag = np.diagonal(g)
    norms = np.sqrt(np.where(0.0 > diag, 0.0, diag)).astype(np.float32).astype(np.float64).tolist()

    def norm(c):
        return math.sqrt(max(float(c @ g @ c), 0.0))

    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return [0.0] * n
    asum = sum(alphas[i] for i in valid)
    na = [alphas[i] / asum for i in valid]
    units = np.zeros((len(valid), n))  # row r: the unit vector of model valid[r], 1 / |x| at its own position
    units[np.arange(len(valid)), valid] = [1.0 / norms[i] for i in valid]
    mean = np.zeros(n)  # sum_r na_r u_r: one term per position
    mean[valid] = np.array(na) * units[np.arange(len(valid)), valid]
    mn = norm(mean)
    mean = units[0].copy() if mn < tol else mean / mn
    for _ in range(max_iter):
        tangent = _tangent(g, mean, units, na, tol)
        tn = norm(tangent)
        if tn < tol:
            break
        mean = math.cos(tn) * mean + math.sin(tn) * (tangent / tn)
        un = norm(mean)
        if un > tol:
            mean = mean / un
    scale = sum(a * nm for a, nm in zip(alphas, norms))
    return [float(v) for v in scale * mean]


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    out = None
    for c, x in zip(scalars, list(xs) + [base]):
        term = f32(c) * x
        out = term if out is None else out + term
    return out


METHODS = {"karcher": (scalars, block)}
