"""Per-tensor parameter settings as the planner and engine apply them: an expert's weight and density
and the operator parameters on one tensor, from a plan's expert entries.

The setting grammar itself (numbers, gradients over the layers, ``{filter, value}`` conditions) is
:class:`mergepipe.ops.setting.Setting`; the names below re-export it for the planner's modules. An
expert-level setting that yields no value for a tensor falls back to the merge-wide setting, then to the
default (weight 1, density 1), following mergekit's precedence.
"""

from __future__ import annotations

from mergepipe.errors import PlanError
from mergepipe.ops.setting import (  # noqa: F401 (re-exported)
    LAYER, PRE_LAYER_NAMES, Setting, evaluate, is_scalar, layer_t, resolve,
)


def check_setting(value, where: str, error: type[Exception] = PlanError):
    """Validate a setting (``where`` names it in messages); returns its plain JSON form
    (:attr:`Setting.json`: what requests and plans record)."""
    return Setting.parse(value, where, error).json


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
