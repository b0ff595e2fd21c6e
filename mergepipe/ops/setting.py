"""mergekit's per-tensor settings, in one type: :class:`Setting`.

A setting is one of
- a number: the same value for every tensor;
- a gradient, a list of numbers: interpolated over the layer index, t = layer / (layers - 1) for
  ``...layers.N...`` tensors and t = 0 for the others (embeddings, final norm, head), as mergekit does;
- a list of conditions ``{"filter": "self_attn", "value": SETTING}``: the first whose filter is a
  substring of the tensor name (or that has no filter, or filter ``*``) gives the value.

The grammar lives here and nowhere else: the operators (ops/core.py: lambda, normalize/rescale, an
operator's gradient parameter such as slerp's t), the planner (weights, densities, gamma/epsilon per
expert), the YAML config (config/parse.py, config/slices.py) and the export (config/export.py) parse with
:meth:`Setting.parse` (or its declared-range and true/false variants), read a value with
:meth:`Setting.at` and write mergekit YAML with :meth:`Setting.to_yaml`.

A setting's :attr:`Setting.json` is the plain form requests and plans record (floats, lists of floats,
``{"filter", "value"}`` dicts): it is what plan digests hash, so it is exactly the form the validators
returned before this type existed. This module sits in the operator layer (the lowest that needs it) and
imports neither torch nor numpy.
"""

from __future__ import annotations

import json
import math

from mergepipe.errors import PlanError, brief
# a decoder/encoder layer's tensors (``layers.N.``, ``h.N.``, ``layer.N.``, ``blocks.N.``): storage/views.py
from mergepipe.storage.views import LAYER

# tensors before the layers (mergekit's pre_weights: embeddings); the others outside the layers come after
PRE_LAYER_NAMES = ("embed", "wte.", "wpe.")


def is_scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def layer_t(tensor: str, num_layers: int) -> float:
    """Where a tensor sits along the layer stack, in [0, 1] (0 outside the layers)."""
    m = LAYER.search(tensor)
    if not m:
        return 0.0
    return int(m.group(1)) / (num_layers - 1) if num_layers > 1 else 1.0


class Setting:
    """A checked mergekit setting. Build one with :meth:`parse` (mergekit's grammar, finite numbers),
    :meth:`parse_param` (an operator parameter within its declared range), :meth:`parse_flag`
    (normalize/rescale: true/false conditions) or :meth:`from_json` (a form a request or plan recorded,
    already checked). Equal settings have equal plain forms (and hash alike)."""

    __slots__ = ("json",)

    def __init__(self, form) -> None:
        self.json = form  # the plain, checked form (see the module docstring)

    # --- parsing -------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, form) -> "Setting":
        """A setting from its recorded plain form (no checks: it was checked when recorded)."""
        return form if isinstance(form, Setting) else cls(form)

    @classmethod
    def parse(cls, value, where: str, error: type[Exception] = PlanError) -> "Setting":
        """Validate a setting (``where`` names it in messages). A single dict is one condition; conditions
        cannot be nested; numbers must be finite."""
        return cls(_check(value, where, error))

    @classmethod
    def parse_param(cls, value, param) -> "Setting":
        """A gradient (list of numbers) or a list of ``{filter, value}`` conditions for a declared operator
        parameter (ops/spec.Param): each number within the declared range."""
        return cls(_check_param(value, param))

    @classmethod
    def parse_flag(cls, value, name: str) -> "Setting | bool":
        """normalize/rescale: true/false, or a list of ``{filter, value: true/false}`` conditions (a setting
        of 1.0/0.0)."""
        if isinstance(value, (list, tuple, dict)):
            return cls(_check_flags(value, name))
        return bool(value)

    # --- reading -------------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``number``, ``gradient`` or ``conditions``."""
        if is_scalar(self.json):
            return "number"
        return "gradient" if all(is_scalar(v) for v in self.json) else "conditions"

    def at(self, tensor: str, t: float) -> float | None:
        """The value on one tensor at layer position ``t`` (:func:`layer_t`); None when no condition
        matches."""
        return evaluate(self.json, tensor, t)

    def to_yaml(self, flag: bool = False):
        """mergekit's YAML form: the plain form, with a true/false setting's values as booleans."""
        if flag and isinstance(self.json, list):
            return [{"filter": c["filter"], "value": bool(c["value"])} for c in self.json]
        return self.json

    def __eq__(self, other) -> bool:
        return isinstance(other, Setting) and _key(self.json) == _key(other.json)

    def __hash__(self) -> int:
        return hash(_key(self.json))

    def __repr__(self) -> str:
        return f"Setting({self.json!r})"


def _key(form) -> str:
    return json.dumps(form, sort_keys=True)


def evaluate(setting, tensor: str, t: float) -> float | None:
    """The value of a (checked) setting, plain form or :class:`Setting`, on one tensor; None when no
    condition matches."""
    if isinstance(setting, Setting):
        setting = setting.json
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


# --- the grammar ------------------------------------------------------------------------------------------
def _check(value, where: str, error: type[Exception]):
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
        conds.append({"filter": f, "value": _check(v, f"{w}.value", error)})
    return conds


def _number(value, where: str, error: type[Exception]) -> float:
    if not is_scalar(value):
        raise error(f"{where} must be a number, a list of numbers (gradient) or a list of {{filter, value}} "
                    f"conditions, not {brief(value)}")
    if not math.isfinite(value):
        raise error(f"{where} must be a finite number, not {brief(value)}")
    return float(value)


def _check_param(value, param):
    if isinstance(value, dict):
        value = [value]
    out = []
    for v in value:
        if isinstance(v, dict):
            if set(v) - {"filter", "value"} or "value" not in v:
                raise PlanError(f"{param.name}: a condition has the keys filter and value")
            f = v.get("filter")
            if f is not None and not isinstance(f, str):
                raise PlanError(f"{param.name}: filter must be a substring of tensor names, not {brief(f)}")
            inner = v["value"]
            out.append({"filter": f, "value": _check_param(inner, param) if isinstance(inner, (list, tuple))
                        else param.check(param_float(inner, param.name))})
        else:
            out.append(param.check(param_float(v, param.name)))
    if not out:
        raise PlanError(f"{param.name} is an empty list")
    return out


def _check_flags(value, name: str):
    conds = [value] if isinstance(value, dict) else list(value)
    if not all(isinstance(c, dict) for c in conds):
        raise PlanError(f"{name} is true or false, or a list of {{filter, value}} conditions (not a gradient)")
    out = []
    for c in conds:
        if set(c) - {"filter", "value"} or "value" not in c or isinstance(c["value"], (list, tuple, dict)):
            raise PlanError(f"{name}: a condition has the keys filter and value (true or false)")
        f = c.get("filter")
        if f is not None and not isinstance(f, str):
            raise PlanError(f"{name}: filter must be a substring of tensor names, not {brief(f)}")
        out.append({"filter": f, "value": 1.0 if param_bool(c["value"], name) else 0.0})
    return out


def param_bool(value, name: str) -> bool:
    """A true/false operator parameter (1 and 0 accepted)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise PlanError(f"{name} must be true or false, not {brief(value)}")


def param_float(value, name: str) -> float:
    """A number operator parameter (a bool refused; what float() reads accepted)."""
    if isinstance(value, bool):
        raise PlanError(f"{name} must be a number, not {brief(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{name} must be a number, not {brief(value)}") from None
