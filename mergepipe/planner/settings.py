"""Per-tensor parameter settings: mergekit's filters and gradients for an expert's weight and density.

A setting is one of
- a number: the same value for every tensor;
- a gradient, a list of numbers: interpolated over the layer index, t = layer / (layers - 1) for
  ``...layers.N...`` tensors and t = 0 for the others (embeddings, final norm, head), as mergekit does;
- a list of conditions ``{"filter": "self_attn", "value": SETTING}``: the first whose filter is a
  substring of the tensor name (or that has no filter, or filter ``*``) gives the value.
An expert-level setting that yields no value for a tensor falls back to the merge-wide setting, then to
the default (weight 1, density 1), following mergekit's precedence.
"""

from __future__ import annotations

import math

from mergepipe.errors import PlanError, brief
# a decoder/encoder layer's tensors (``layers.N.``, ``h.N.``, ``layer.N.``, ``blocks.N.``): storage/views.py
from mergepipe.storage.views import LAYER  # noqa: F401 (re-exported)

# tensors before the layers (mergekit's pre_weights: embeddings); the others outside the layers come after
PRE_LAYER_NAMES = ("embed", "wte.", "wpe.")


def is_scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_setting(value, where: str, error: type[Exception] = PlanError):
    """Validate a setting (``where`` names it in messages); returns its plain JSON form: floats, lists
    of floats, ``{"filter", "value"}`` dicts. A single dict is one condition."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return _number(value, where, error)
    if not value:
        raise error(f"{where} is an empty list: it must be a number, a list of numbers (gradient) or a list "
                    f"of {{filter, value}} conditions")
    if all(not isinstance(v, (dict, list, tuple)) for v in value):
        return [_number(v, f"{where}[{i}]", error) for i, v in enumerate(value)]  # a gradient
    conds = []
    for i, cond in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(cond, dict):
            raise error(f"{w} must be a {{filter, value}} condition (a list mixes numbers and conditions)")
        if set(cond) - {"filter", "value"} or "value" not in cond:
            raise error(f"{w}: a condition has the keys filter and value (got {', '.join(map(str, cond))})")
        f = cond.get("filter")
        if f is not None and not isinstance(f, str):
            raise error(f"{w}.filter must be a substring of tensor names, not {brief(f)}")
        v = cond["value"]
        if isinstance(v, dict) or (isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list, tuple)) for x in v)):
            raise error(f"{w}.value: conditions cannot be nested")
        conds.append({"filter": f, "value": check_setting(v, f"{w}.value", error)})
    return conds


def _number(value, where: str, error: type[Exception]) -> float:
    if not is_scalar(value):
        raise error(f"{where} must be a number, a list of numbers (gradient) or a list of {{filter, value}} "
                    f"conditions, not {brief(value)}")
    if not math.isfinite(value):
        raise error(f"{where} must be a finite number, not {brief(value)}")
    return float(value)


def layer_t(tensor: str, num_layers: int) -> float:
    """Where a tensor sits along the layer stack, in [0, 1] (0 outside the layers)."""
    m = LAYER.search(tensor)
    if not m:
        return 0.0
    return int(m.group(1)) / (num_layers - 1) if num_layers > 1 else 1.0


def evaluate(setting, tensor: str, t: float) -> float | None:
    """The value of a (checked) setting for one tensor; None when no condition matches."""
    if setting is None or is_scalar(setting):
        return setting
    if all(is_scalar(v) for v in setting):
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * setting[i0] + frac * setting[i1]
    for cond in setting:
        f = cond["filter"]
        if f is None or f == "*" or f in tensor:
            return evaluate(cond["value"], tensor, t)
    return None


def resolve(settings, tensor: str, t: float, default: float) -> float:
    """First value along ``settings`` (highest precedence first), else ``default``."""
    for s in settings:
        v = evaluate(s, tensor, t)
        if v is not None:
            return float(v)
    return default


def num_layers(tensor_names, config: dict) -> int:
    n = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    if isinstance(n, int) and n > 0:
        return n
    found = [int(m.group(1)) for name in tensor_names if (m := LAYER.search(name))]
    return max(found) + 1 if found else 1


def tensor_weight(expert: dict, tensor: str) -> float:
    """An expert's weight on one tensor (per-tensor value from a plan, else its single weight)."""
    per = expert.get("tensors")
    return per[tensor][0] if per and tensor in per else expert["weight"]  # None: a non-float tensor


# mergekit's per-model (NON_BASE) operator parameters besides weight and density: breadcrumbs' gamma,
# DELLA's epsilon; an expert's own value (its spec's key) overrides the merge-wide one
PER_MODEL_PARAMS = ("gamma", "epsilon")


def expert_params(params: dict, expert: dict, tensor: str | None = None) -> dict:
    """The operator parameters for one expert (on ``tensor``): the merge-wide ones with the expert's own
    gamma/epsilon, a number or, given as filters or a gradient, its value on the tensor (the plan's per-expert
    ``tensor_params``)."""
    own = {k: float(expert[k]) for k in PER_MODEL_PARAMS if k in params and isinstance(expert.get(k), (int, float))
           and not isinstance(expert[k], bool)}  # anything else is refused by the planner, naming it
    if tensor is not None and expert.get("tensor_params"):
        own.update(expert["tensor_params"].get(tensor) or {})
    return {**params, **own} if own else params


def params_on(params: dict, per_tensor: dict | None, tensor: str) -> dict:
    """The operator parameters on one tensor: the plan's ``tensor_params`` (lambda, normalize, rescale given
    as filters or a gradient, resolved per tensor by the planner) over the merge-wide ones."""
    own = (per_tensor or {}).get(tensor)
    return {**params, **own} if own else params


def tensor_density(expert: dict, tensor: str) -> float | None:
    per = expert.get("tensors")
    return per[tensor][1] if per and tensor in per else expert["density"]
