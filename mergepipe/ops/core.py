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

Since issue 15 every operator follows mergekit 0.1.5's definitions (sparsify.py, generalized task
arithmetic): TIES keeps exactly k = max(1, int(density * n)) entries and honours ``rescale`` (per-tensor
L1 factor from ANALYZE's exact top-k L1); breadcrumbs drops the top int(gamma * n) and keeps the next
int(density * n), and keeps the delta unchanged at density >= 1; DELLA uses epsilon 0.15, keep
probability (density - eps) + 2 eps * r / (n - 1) and L1 restoration (tests/parity/ measures it).

Deliberate differences from mergekit, all forced by streaming block by block or by determinism:
  * The L1-preserving ``rescale`` of the random operators (DARE, DELLA) and of breadcrumbs is applied
    per block instead of per tensor: the kept part's norm depends on every block's mask, unknown before
    the first block is written unless the tensor were read twice. Same expected update.
  * DELLA ranks magnitudes within each row (exactly mergekit's for 2-D tensors, whose blocks hold whole
    rows); a 1-D tensor that spans several blocks is ranked within each block (mergekit: whole tensor).
  * Magnitude ties at a cut-off: exactly k entries are kept (as torch's top-k), the tied ones chosen by
    a documented rule -- the first in flat C order over the tensor (:func:`tensor_statistics`) -- where
    torch's unstable sort picks arbitrarily: counts match mergekit, positions of tied entries may not.
    Exception: TIES where int(density * n) = 0 (k = 1: every entry tied at the max is kept).
  * Random masks come from a counter-based stream seeded by (seed, the expert block's content, tensor,
    block) (ops/streams.py), not torch's global generator: equal in distribution, not draw for draw;
    independent of traversal order, parallelism and the catalog (ids, fingerprints).

The interpolation methods (slerp, nuslerp, model_stock, multislerp, karcher, nearswap, sce, ram,
ramplus_tl: ``spec.nonlinear``) are not of this form: each registers ``METHODS[name] = (scalars, block)``
(ops/interp.py): per-tensor scalars from ANALYZE's Gram statistics, computed by the planner, and a block
kernel the engine applies to the experts' values (an omitted block keeps the base's values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.errors import PlanError, brief
from mergepipe.ops import (
    arcee_fusion, breadcrumbs, dare, della, karcher, linear, model_stock, multislerp, nearswap, nuslerp, passthrough, ram,
    sce, slerp, ties,
)
from mergepipe.ops.setting import Setting, param_bool, param_float
from mergepipe.ops.topk import NO_CUT
from mergepipe.ops.spec import (  # noqa: F401
    LAMBDA, OPERATORS, Consensus, OpSpec, Param, Sparsify, all_parameters, register_op,
)

if TYPE_CHECKING:
    import torch

FAMILIES = (linear, ties, dare, breadcrumbs, della, slerp, nuslerp, model_stock, multislerp, karcher, nearswap, sce,
            ram, passthrough, arcee_fusion)
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
    key = name.strip().lower() if isinstance(name, str) else None
    for spec in OPERATORS.values():
        if key == spec.name or key in spec.aliases:
            return spec
    names = ", ".join(sorted(list(OPERATORS) + [a for s in OPERATORS.values() for a in s.aliases]))
    raise PlanError(f"unknown operator {brief(name)} (choose from {names})")


def resolve_params(spec: OpSpec, normalize=None, rescale=None, lam=None, **extra) -> dict:
    """The operator's full parameter set: declared defaults overridden by what the user gave, each
    checked against its declaration (a finite number within the declared range; NaN is refused)."""
    unknown = [k for k, v in extra.items() if v is not None and k not in spec.params]
    if unknown:
        raise PlanError(f"operator {spec.name} takes no parameter {', '.join(unknown)}")
    params = {
        "normalize": spec.normalize if normalize is None else _json(Setting.parse_flag(normalize, "normalize")),
        "rescale": spec.rescale if rescale is None else _json(Setting.parse_flag(rescale, "rescale")),
        "lambda": 1.0 if lam is None else (Setting.parse_param(lam, LAMBDA).json if isinstance(lam, (list, tuple, dict))
                                           else LAMBDA.check(param_float(lam, LAMBDA.name))),
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
            params[p.name] = param_bool(value, p.name)
        elif p.gradient and isinstance(value, (list, tuple, dict)):
            params[p.name] = Setting.parse_param(value, p).json
        else:
            params[p.name] = p.check(param_float(value, p.name))
    check = getattr(_family_of(spec), "check", None)
    problem = check(params) if check else None
    if problem:
        raise PlanError(problem)
    return params


# the merge-wide parameters that may vary per tensor (mergekit's SHARED parameters with filters or a
# gradient, parsed by ops/setting.Setting): the planner resolves them per tensor (PlanContext.params_for),
# the plan records the values
TENSOR_PARAMS = ("lambda", "normalize", "rescale")


def _json(value):
    """A parsed normalize/rescale in the plan's form: a bool, or a setting's plain form."""
    return value.json if isinstance(value, Setting) else value


def _family_of(spec: OpSpec):
    return next((f for f in FAMILIES if any(s.name == spec.name for s in f.SPECS)), None)


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
                      topk_json: str | None, delta_l1: float, max_abs: float, numel: int) -> list[float] | None:
    """The per-tensor statistics an operator needs for one (expert, tensor), from its catalog row
    (tensor_stats: thresholds, topk, delta_l1, delta_max_abs, numel); None when one is missing (the
    expert is then analyzed on the way; catalogs analyzed before schema v5 have no ``topk``).

    Exact k (mergekit's top-k keeps exactly k entries; which of the entries tied at the cut-off is
    arbitrary in torch): the entries of a tensor are ordered by |delta| descending, then by flat index
    (C order over the whole tensor) ascending, and the top k are the first k. An entry is in the top k
    iff |d| > thr, or |d| == thr and it is among the first m tied entries in flat order. ANALYZE stores
    where those end as a cut (B, r) (analyze/thresholds.tie_cut_queries): blocks before B keep every
    tied entry, block B its first r in C order, later blocks none; so each block decides alone.

    * TIES (magnitude): ``[thr, ratio, cut_block, cut_rank]`` for k = max(1, int(density * n)) as
      mergekit (where int(density * n) = 0: thr = the tensor's max |delta|, every entry tied at it
      kept); ``ratio`` is mergekit's per-tensor L1 rescale ``||delta||_1 / ||top-k||_1`` with ``rescale``
      (1.0 without, or when either norm is below mergekit's 1e-7), ``||top-k||_1`` the L1 of exactly k
      top entries (ANALYZE).
    * breadcrumbs (outliers): ``[thr_hi, thr_lo, cut_block_hi, cut_rank_hi, cut_block_lo, cut_rank_lo]``:
      mergekit's magnitude_outliers' counts: keep the top k_lo = n - n_bot less the top k_hi = k_lo - target,
      target = int(density * n), n_bot = max(0, n - target - int(gamma * n)) (so k_hi = int(gamma * n) and
      k_lo = int(gamma * n) + int(density * n), also below n where gamma + density = 1 but the two round
      down: the smallest n_bot entries are dropped), each from a stored fraction f with int(f * n) = k or
      k + 1 (:func:`kth_statistics`; f = 1 for k = n - 1).
    Density >= 1: ``[0.0]`` / ``[0.0, 0.0]`` (the delta is kept as it is)."""
    import json

    topk = json.loads(topk_json) if topk_json else None
    return statistics_of(spec, density, params, json.loads(thresholds_json or "{}"), topk, delta_l1, max_abs, numel)


def statistics_of(spec: OpSpec, density: float, params: dict, table: dict, topk: dict | None, delta_l1: float,
                  max_abs: float, numel: int) -> list[float] | None:
    """:func:`tensor_statistics` of the parsed JSON (``table``: the thresholds, ``topk``: None where not stored)."""
    fractions = threshold_fractions(spec, density, params)
    vals = lookup_thresholds(table, fractions)
    if vals is None or not spec.thresholded or density >= 1.0:
        return vals
    if spec.sparsify is Sparsify.MAGNITUDE:
        return _magnitude_statistics(vals[0], fractions[0], topk, params, delta_l1, max_abs)
    return _outlier_statistics(table, topk, density, params, numel)


def _tie_cut(topk: dict | None, fraction: float, value: float, at: int = 3) -> list | None:
    """The exact-k cut (cut_block, cut_rank) stored for ``fraction``; None when ``topk`` lacks it."""
    import math
    if math.isinf(value) or value == 0.0:  # keep nothing / every non-zero entry: no tie to break
        return list(NO_CUT)
    entry = _lookup(topk, fraction) if topk is not None else None
    return None if entry is None else [entry[at], entry[at + 1]]


def _magnitude_statistics(thr: float, fraction: float, topk: dict | None, params: dict, delta_l1: float,
                          max_abs: float) -> list[float] | None:
    """TIES' ``[thr, ratio, cut_block, cut_rank]`` (:func:`tensor_statistics`)."""
    import math
    kept = None
    if math.isinf(thr):  # k = int(density * n) = 0: mergekit keeps the largest entry
        thr = kept = float(max_abs)
        cut = list(NO_CUT)
    else:
        cut = _tie_cut(topk, fraction, thr)
        if thr == 0.0:  # fewer non-zeros than k: all of them are kept
            kept = float(delta_l1)
    if cut is None:
        return None
    ratio = 1.0
    if params.get("rescale"):
        if kept is None:
            kept = float(_lookup(topk, fraction)[2])
        ratio = float(delta_l1) / kept if delta_l1 >= 1e-7 and kept >= 1e-7 else 1.0
    return [thr, ratio, *cut]


def _outlier_statistics(table: dict, topk: dict | None, density: float, params: dict,
                        numel: int) -> list[float] | None:
    """breadcrumbs' ``[thr_hi, thr_lo, cut_block_hi, cut_rank_hi, cut_block_lo, cut_rank_lo]``
    (:func:`tensor_statistics`)."""
    # mergekit's magnitude_outliers sorts the n entries by |delta| ascending and keeps positions
    # [n_bot, n_bot + target), target = int(density n), n_bot = max(0, n - target - int(gamma n)): in descending
    # order the top k_lo = n - n_bot less the top k_hi = k_lo - target (k_hi = int(gamma n) unless that leaves
    # fewer than target entries); k_lo < n where int(gamma n) + int(density n) < n, gamma + density = 1 too
    n = int(numel)
    target = int(density * n)
    n_bot = max(0, n - target - int(params["gamma"] * n))
    hi = kth_statistics(table, topk, n - n_bot - target, n)
    lo = kth_statistics(table, topk, n - n_bot, n)
    if hi is None or lo is None:
        return None
    return [hi[0], lo[0], hi[1], hi[2], lo[1], lo[2]]


def kth_statistics(table: dict, topk: dict | None, k: int, n: int) -> list | None:
    """``[thr, cut_block, cut_rank]`` of the top ``k`` of a tensor's ``n`` entries (|delta| descending, then flat
    index ascending) from ANALYZE's stored grid: a fraction f stores the top int(f n) and the top int(f n) - 1
    (``topk``: analyze/thresholds.kth_largest_thresholds), so any f of the grid with int(f n) = k or k + 1
    answers (f = 1 for k = n - 1). k <= 0 keeps nothing (thr inf); k at least the non-zero entries keeps every
    non-zero one (thr 0; a stored 0 at f says int(f n) exceeds them). None when the grid holds no such f."""
    import math
    if k <= 0:
        return [float("inf"), *NO_CUT]
    if k >= n:
        return [0.0, *NO_CUT]
    found, topk = None, topk or {}
    for key, value in table.items():
        if found is not None and value != 0.0:  # found: only a stored 0 still matters
            continue
        kf = int(float(key) * n)
        if value == 0.0 and k >= kf - 1:  # int(f n) > nnz: k >= nnz
            return [0.0, *NO_CUT]
        entry = topk.get(key)
        if entry is None or found is not None:
            continue
        if kf == k and not math.isinf(value):
            found = [float(value), entry[3], entry[4]]
        elif kf - 1 == k and not math.isinf(entry[5]):
            found = [float(entry[5]), entry[8], entry[9]]
    return found


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
             seed: int, block: int = 0) -> torch.Tensor:
    """Sparsify one expert's delta block (float32, block shape); ``block``: its index in the grid (the
    exact-k tie-break of the magnitude operators)."""
    kind = spec.sparsify
    if kind is None or density >= 1.0:  # mergekit: every sparsification keeps a density >= 1 delta as it is
        return delta
    return SPARSIFY[kind](delta, density, params, thresholds, seed, block)


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
