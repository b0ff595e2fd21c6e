"""Multi-SLERP (mergekit's ``multislerp``): barycentric interpolation of K task vectors on the hypersphere.

With the base, per tensor: v_i = x_i - base, u_i = v_i / (|v_i| + eps), weights w
(divided by their sum when ``normalize_weights``, default on); mean = sum w_i u_i / |sum w_i u_i|;
mergekit then projects the u_i to the tangent space at the mean, averages them there and maps back --
but the weighted tangent average of the u_i at their own normalized weighted mean is zero (up to rounding),
so the result is mean * (sum w_i |v_i|) + base. The norms |v_i| and |sum w_i u_i| come from the catalog's
Gram statistics; the block kernel forms the mean in mergekit's order. One expert: its own values
(mergekit returns the model as it is). If |sum w_i u_i| < eps: two experts fall back to linear
sum w_i v_i + base, more are refused (antipodal task vectors), as in mergekit.

Without a ``base_model`` mergekit interpolates the models themselves (v_i = x_i, no base added). MergePipe
plans that as a soup (config/soup.py): the first model is the reference, read in full as the "base" and
weighted as a model; the norms and dots of the whole models come from the Gram statistics with the base read
(||base||^2, <base, delta_i>: full checkpoints).

Budget: a block is read for all experts or for none; an omitted block keeps the base's values (without a
base_model: the reference model's values).
The additive error bound does not apply (the coefficients depend on whole-tensor norms and angles).
"""

from __future__ import annotations

import math

from mergepipe.errors import PlanError
from mergepipe.ops.interp import Gram, f32
from mergepipe.ops.spec import Consensus, OpSpec, Param

NORMALIZE_WEIGHTS = Param("normalize_weights", True, "multislerp: divide the weights by their sum")
EPS = Param("eps", 1e-8, "multislerp: small constant added to the norms", low=0.0, low_open=True, step=1e-8)

SPECS = (OpSpec("multislerp", None, Consensus.NONE, False, False, extras=(NORMALIZE_WEIGHTS, EPS), nonlinear=True,
                joint=True, gram=True, common=("weight",), min_experts=1, base_optional=True,
                reference="mergekit multislerp, https://goddard.blog/posts/multislerp-wow-what-a-cool-idea",
                budget_semantics="all experts' blocks are read or none; an omitted block keeps the base's values",
                bound_note="n/a: multislerp is not additive (its coefficients depend on whole-tensor norms)"),)

NORMAL, LINEAR, SINGLE = 0.0, 1.0, 2.0


def _model_dots(gram: Gram) -> list[list[float]]:
    """<v_i, v_j> of the vectors interpolated without a base_model: the reference (the "base") and the experts,
    whole values."""
    k = len(gram.bd)
    return [[gram.bb] + [gram.bx(j) for j in range(k)]] + [
        [gram.bx(i)] + [gram.xx(i, j) for j in range(k)] for i in range(k)]


def scalars(spec: OpSpec, gram: Gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """[mode, |mean|, sum w_i |v_i|, then per vector (|v_i| + eps, w_i)] in float32; without a base_model the
    vectors are the reference and the experts, and one more value, 1, ends the list."""
    import torch
    whole = "reference_weight" in settings
    if whole:
        dots, ws = _model_dots(gram), [settings["reference_weight"], *settings["weights"]]
    else:
        dots, ws = [list(row) for row in gram.dd], settings["weights"]
    k = len(dots)
    if k == 1:
        return [SINGLE, 0.0, 0.0, 0.0, 0.0]
    eps = params["eps"]
    weights = torch.tensor(ws, dtype=torch.float32)
    if params["normalize_weights"]:
        weights = weights / weights.sum()
    w = [float(v) for v in weights]
    norms = [float(f32(math.sqrt(max(dots[i][i], 0.0)))) for i in range(k)]
    denom = [float(f32(n) + eps) for n in norms]
    sq = sum(w[i] * w[j] * dots[i][j] / (denom[i] * denom[j]) for i in range(k) for j in range(k))
    mean_norm = float(f32(math.sqrt(max(sq, 0.0))))
    mode = NORMAL
    if mean_norm < eps:
        if k != 2:
            raise PlanError("multislerp: the weighted sum of the task vectors is zero on a tensor (antipodal task "
                            "vectors with balancing weights); try other weights")
        mode = LINEAR
    avg_norm = float((torch.tensor(norms, dtype=torch.float32) * weights).sum())
    out = [mode, mean_norm, avg_norm]
    for i in range(k):
        out += [denom[i], w[i]]
    return out + [1.0] if whole else out


def block(spec: OpSpec, base, xs, scalars: list[float], params: dict, ndim: int):
    import torch
    mode = scalars[0]
    if mode == SINGLE:
        return xs[0]
    whole = len(scalars) == 3 + 2 * (len(xs) + 1) + 1  # no base_model: the reference and the experts themselves
    vectors = [base, *xs] if whole else [x - base for x in xs]
    offset = base if not whole else 0.0
    k = len(vectors)
    denom = [scalars[3 + 2 * i] for i in range(k)]
    weights = torch.tensor([scalars[4 + 2 * i] for i in range(k)], dtype=torch.float32)
    tensors = torch.stack(vectors, dim=0)
    shape = tensors.shape[1:]
    flat = tensors.reshape(k, -1)
    if mode == LINEAR:
        return (flat[0] * weights[0] + flat[1] * weights[1]).view(shape) + offset
    unit = flat / torch.tensor(denom, dtype=torch.float32).view(-1, 1)
    mean = (unit * weights.view(-1, 1)).sum(0)
    mean = mean / f32(scalars[1])
    result = mean * f32(scalars[2])
    return result.view(shape) + offset


METHODS = {"multislerp": (scalars, block)}
