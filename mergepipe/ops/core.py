"""Merge operators: the registry (one module per operator family declares its specs and block math;
this module registers them by name), parameter resolution, and the per-block sparsify and combine.

All operators work on one block at a time (mask-aware): the engine hands an operator the base block
and the deltas of the experts the plan selected for that block; omitted experts contribute delta = 0
with their coefficients unchanged. Semantics follow the design brief (mergekit's generalized task
arithmetic):

    delta_i' = sparsify(delta_i)          # per tensor (thresholds from the catalog) or per block
    contrib  = sum_i w_i * delta_i' [* sign-consensus mask]
    divisor  = sum of weights (of agreeing entries, with consensus)   -- applied when normalize
    out      = base + lambda * contrib / divisor

Deliberate differences from mergekit, all forced by streaming block by block:
  * DARE's L1-preserving rescale (``rescale``) is applied per block instead of per tensor.
  * DELLA ranks magnitudes within each row of dim 0 (1-D tensors: within each block).
  * Breadcrumbs keeps entries with tau_lo <= |d| < tau_hi, where tau_hi / tau_lo are the k-th largest
    |d| for k = int(gamma*n) and int((gamma+density)*n); mergekit's int(gamma*n)+int(density*n) can
    differ by one element.
  * Magnitude ties at a threshold are all kept (torch.topk keeps an arbitrary subset of them).

The interpolation methods (slerp, nuslerp, model_stock, multislerp, karcher, nearswap, sce, ram,
ramplus_tl: ``spec.nonlinear``) are not of this form: each registers ``METHODS[name] = (scalars, block)``
(ops/interp.py): per-tensor scalars from ANALYZE's Gram statistics, computed by the planner, and a block
kernel the engine applies to the experts' values (an omitted block keeps the base's values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.errors import PlanError
from mergepipe.ops import (
    breadcrumbs, dare, della, karcher, linear, model_stock, multislerp, nearswap, nuslerp, ram, sce, slerp, ties,
)
from mergepipe.ops.spec import (  # noqa: F401
    LAMBDA, OPERATORS, Consensus, OpSpec, Param, Sparsify, all_parameters, register_op,
)

if TYPE_CHECKING:
    import torch

FAMILIES = (linear, ties, dare, breadcrumbs, della, slerp, nuslerp, model_stock, multislerp, karcher, nearswap, sce,
            ram)
# Registration order is the order operators are listed in (the CLI, the dashboard, error messages).
# A family declares SPECS, and for the sparsify kinds it implements SPARSIFY (kind -> block function
# (delta, density, params, thresholds, seed)) and THRESHOLDS (kind -> top-k fractions (density, params)).
SPARSIFY: dict = {}
THRESHOLDS: dict = {}
# The interpolation methods (spec.nonlinear): name -> (scalars, block); see ops/interp.py.
METHODS: dict = {}
for _family in FAMILIES:
    for _spec in _family.SPECS:
        register_op(_spec)
    SPARSIFY.update(getattr(_family, "SPARSIFY", {}))
    THRESHOLDS.update(getattr(_family, "THRESHOLDS", {}))
    METHODS.update(getattr(_family, "METHODS", {}))


def get_op(name: str) -> OpSpec:
    key = name.strip().lower()
    for spec in OPERATORS.values():
        if key == spec.name or key in spec.aliases:
            return spec
    names = ", ".join(sorted(list(OPERATORS) + [a for s in OPERATORS.values() for a in s.aliases]))
    raise PlanError(f"unknown operator {name!r} (choose from {names})")


def resolve_params(spec: OpSpec, normalize=None, rescale=None, lam=None, **extra) -> dict:
    """The operator's full parameter set: declared defaults overridden by what the user gave, each
    checked against its declaration (a finite number within the declared range; NaN is refused)."""
    unknown = [k for k, v in extra.items() if v is not None and k not in spec.params]
    if unknown:
        raise PlanError(f"operator {spec.name} takes no parameter {', '.join(unknown)}")
    params = {
        "normalize": spec.normalize if normalize is None else bool(normalize),
        "rescale": spec.rescale if rescale is None else bool(rescale),
        "lambda": 1.0 if lam is None else LAMBDA.check(_float(lam, LAMBDA)),
    }
    if spec.common is not None:  # the interpolation methods take none of these
        given = [n for n, v in (("lambda", lam), ("normalize", normalize), ("rescale", rescale)) if v is not None
                 and n not in spec.common]
        if given:
            raise PlanError(f"operator {spec.name} takes no parameter {', '.join(given)}")
    for p in spec.extras:
        value = extra.get(p.name)
        if value is None:
            if p.required:
                raise PlanError(f"operator {spec.name} needs the parameter {p.name} ({p.help})")
            params[p.name] = p.default
        elif p.kind is bool:
            params[p.name] = _bool(value, p)
        elif p.gradient and isinstance(value, (list, tuple, dict)):
            params[p.name] = _setting(value, p)
        else:
            params[p.name] = p.check(_float(value, p))
    check = getattr(_family_of(spec), "check", None)
    problem = check(params) if check else None
    if problem:
        raise PlanError(problem)
    return params


def _family_of(spec: OpSpec):
    return next((f for f in FAMILIES if any(s.name == spec.name for s in f.SPECS)), None)


def _bool(value, param: Param) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise PlanError(f"{param.name} must be true or false, not {value!r}")


def _setting(value, param: Param):
    """A gradient (list of numbers) or a list of {filter, value} conditions, checked (finite numbers in
    the declared range); returned in the planner's JSON form."""
    if isinstance(value, dict):
        value = [value]
    out = []
    for v in value:
        if isinstance(v, dict):
            if set(v) - {"filter", "value"} or "value" not in v:
                raise PlanError(f"{param.name}: a condition has the keys filter and value")
            f = v.get("filter")
            if f is not None and not isinstance(f, str):
                raise PlanError(f"{param.name}: filter must be a substring of tensor names, not {f!r}")
            inner = v["value"]
            out.append({"filter": f, "value": _setting(inner, param) if isinstance(inner, (list, tuple))
                        else param.check(_float(inner, param))})
        else:
            out.append(param.check(_float(v, param)))
    if not out:
        raise PlanError(f"{param.name} is an empty list")
    return out


def _float(value, param: Param) -> float:
    if isinstance(value, bool):
        raise PlanError(f"{param.name} must be a number, not {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{param.name} must be a number, not {value!r}") from None


def threshold_fractions(spec: OpSpec, density: float, params: dict) -> list[float]:
    """The top-k fractions whose |delta| thresholds the operator needs per (expert, tensor)."""
    fractions = THRESHOLDS.get(spec.sparsify)
    return fractions(density, params) if fractions else []


def lookup_thresholds(table: dict, fractions: list[float]) -> list[float] | None:
    """Stored thresholds (``{str(density): value}``) for ``fractions``; None if one is missing.
    Keeping every entry (fraction 1) needs no threshold."""
    out = []
    for f in fractions:
        if f >= 1.0:
            out.append(0.0)
            continue
        value = table.get(str(f))
        if value is None:  # keys are str(float); fall back to a tolerant match
            value = next((v for k, v in table.items() if abs(float(k) - f) < 1e-9), None)
        if value is None:
            return None
        out.append(value)
    return out


def useful_blocks(spec: OpSpec, thresholds: list[float] | None, max_abs):
    """Which blocks (by their max |delta|) can contribute after sparsification: under a magnitude
    threshold a block whose largest entry is below it contributes nothing (numpy arrays)."""
    import numpy as np

    if spec.thresholded:  # the smallest kept magnitude is the last threshold
        return max_abs >= thresholds[-1] if thresholds else np.zeros_like(max_abs, dtype=bool)
    return np.ones_like(max_abs, dtype=bool)


def sparsify(spec: OpSpec, delta: torch.Tensor, density: float, params: dict, thresholds: list[float],
             seed: int) -> torch.Tensor:
    """Sparsify one expert's delta block (float32, block shape)."""
    kind = spec.sparsify
    if kind is None or (density >= 1.0 and kind is not Sparsify.OUTLIERS):
        return delta
    return SPARSIFY[kind](delta, density, params, thresholds, seed)


def combine(spec: OpSpec, base: torch.Tensor, deltas: list[tuple[float, torch.Tensor]],
            weight_sum: float, params: dict) -> torch.Tensor:
    """Merge one block. ``deltas`` are (weight, sparsified delta) of the experts read for this block;
    ``weight_sum`` is the sum of all experts' weights (omitted ones included)."""
    if spec.consensus:
        return ties.combine_consensus(base, deltas, params)
    return linear.combine_additive(spec, base, deltas, weight_sum, params)


def coefficient(spec: OpSpec, weight: float, weight_sum: float, params: dict) -> float:
    """Effective coefficient of an expert's delta in the output (additive operators)."""
    c = weight * params["lambda"]
    if params["normalize"] and abs(weight_sum) >= 1e-8:
        c /= weight_sum
    return c
