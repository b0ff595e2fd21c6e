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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.errors import PlanError
from mergepipe.ops import breadcrumbs, dare, della, linear, ties
from mergepipe.ops.spec import (  # noqa: F401
    LAMBDA, OPERATORS, Consensus, OpSpec, Param, Sparsify, all_parameters, register_op,
)

if TYPE_CHECKING:
    import torch

FAMILIES = (linear, ties, dare, breadcrumbs, della)
# Registration order is the order operators are listed in (the CLI, the dashboard, error messages).
# A family declares SPECS, and for the sparsify kinds it implements SPARSIFY (kind -> block function
# (delta, density, params, thresholds, seed)) and THRESHOLDS (kind -> top-k fractions (density, params)).
SPARSIFY: dict = {}
THRESHOLDS: dict = {}
for _family in FAMILIES:
    for _spec in _family.SPECS:
        register_op(_spec)
    SPARSIFY.update(getattr(_family, "SPARSIFY", {}))
    THRESHOLDS.update(getattr(_family, "THRESHOLDS", {}))


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
    for p in spec.extras:
        params[p.name] = p.check(_float(extra[p.name], p)) if extra.get(p.name) is not None else p.default
    return params


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


def _lookup(table: dict, f: float):
    value = table.get(str(f))
    if value is None:  # keys are str(float); fall back to a tolerant match
        value = next((v for k, v in table.items() if abs(float(k) - f) < 1e-9), None)
    return value


def tensor_statistics(spec: OpSpec, density: float, params: dict, thresholds_json: str | None,
                      topk_json: str | None, delta_l1: float, max_abs: float) -> list[float] | None:
    """The per-tensor statistics an operator needs for one (expert, tensor), from its catalog row
    (tensor_stats: thresholds, topk, delta_l1, delta_max_abs); None when one is missing (the expert is
    then analyzed on the way).

    Thresholded operators: the thresholds of :func:`threshold_fractions`. TIES (magnitude) keeps at
    least one entry as mergekit (k = max(1, int(density * n))): where int(density * n) = 0 the
    threshold is the tensor's max |delta|. With ``rescale`` TIES appends mergekit's per-tensor L1
    rescale factor ``||delta||_1 / ||top-k||_1`` (1.0 when either norm is below mergekit's 1e-7),
    where ``||top-k||_1`` is the L1 norm of exactly k top entries stored by ANALYZE (``topk``)."""
    import json
    import math

    fractions = threshold_fractions(spec, density, params)
    table = json.loads(thresholds_json or "{}")
    vals = lookup_thresholds(table, fractions)
    if vals is None or spec.sparsify is not Sparsify.MAGNITUDE or density >= 1.0:
        return vals
    kept = None
    if math.isinf(vals[0]):  # k = int(density * n) = 0: mergekit keeps the largest entry
        vals[0] = kept = float(max_abs)
    elif vals[0] == 0.0:  # fewer non-zeros than k: all of them are kept
        kept = float(delta_l1)
    if params.get("rescale"):
        if kept is None:
            entry = _lookup(json.loads(topk_json), density) if topk_json else None
            if entry is None:
                return None
            kept = float(entry[2])
        vals.append(float(delta_l1) / kept if delta_l1 >= 1e-7 and kept >= 1e-7 else 1.0)
    return vals


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

    if spec.thresholded:  # the smallest kept magnitude: TIES' threshold, breadcrumbs' lower one
        if not thresholds:
            return np.zeros_like(max_abs, dtype=bool)
        return max_abs >= thresholds[0 if spec.sparsify is Sparsify.MAGNITUDE else 1]
    return np.ones_like(max_abs, dtype=bool)


def sparsify(spec: OpSpec, delta: torch.Tensor, density: float, params: dict, thresholds: list[float],
             seed: int) -> torch.Tensor:
    """Sparsify one expert's delta block (float32, block shape)."""
    kind = spec.sparsify
    if kind is None or density >= 1.0:  # mergekit: every sparsification keeps a density >= 1 delta as it is
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
