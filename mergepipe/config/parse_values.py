"""The checks of single config values: a parameter (a number, a flag, or a weight/density setting), a
model reference, a dtype; and mergekit's fallback of a model's or module's setting to the merge-wide one."""

from __future__ import annotations

import math
from pathlib import Path

from mergepipe.config.model import ConfigError, DTYPE_NAMES, GRADIENT_PARAMS, PARAMS, PER_TENSOR
from mergepipe.errors import PlanError, brief
from mergepipe.ops.setting import Setting
from mergepipe.planner.settings import PER_MODEL_PARAMS


def _known(key, allowed, where: str) -> bool:
    if key not in allowed:
        raise ConfigError(f"unsupported parameter `{key}` in {where} (MergePipe supports {', '.join(allowed)})")
    return True


def _ref(value, where: str) -> str:
    if isinstance(value, dict):
        raise ConfigError(f"{where}: the mapping form of a model reference is not supported; "
                          f"write a path, a catalog id or BASE+ADAPTER")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must be a path or a model id, not {brief(value)}")
    return value.strip()


def _param(value, where: str, name: str):
    """One parameter value. ``weight`` and ``density`` may be mergekit settings: a number, a gradient
    (a list of numbers over the layers) or a list of ``{filter, value}`` conditions; the other
    parameters are one value (a gradient or filter for them is refused)."""
    if isinstance(value, dict) and set(value) <= {"value", "filter"} and "value" in value \
            and value.get("filter") in (None, "*"):
        return _param(value["value"], where, name)  # {value: x} without a filter is just x
    if name in PER_TENSOR or name in GRADIENT_PARAMS or (name == "lambda" and where == "parameters.lambda"):
        return _setting(value, where)
    if name in PER_MODEL_PARAMS and isinstance(value, (list, dict)):
        return _setting(value, where)  # gamma/epsilon per tensor: each value range-checked by the planner
    if name in ("normalize", "rescale") and where == f"parameters.{name}" and isinstance(value, (list, dict)):
        return value  # filters of true/false: checked by _flag_setting
    if isinstance(value, (list, dict)):
        kind = "per-tensor filters" if isinstance(value, dict) or any(isinstance(v, dict) for v in value) \
            else "a gradient across layers"
        raise ConfigError(f"{where} is {kind}: not supported for {name}; MergePipe applies one {name} to every "
                          f"tensor (filters and gradients work for weight, density, gamma and epsilon, and "
                          f"merge-wide for lambda, normalize and rescale)")
    if name == "int8_mask" or PARAMS[name].kind is bool:
        return _flag(value, where)
    return PARAMS[name].check(_number(value, where), where, ConfigError)


def _setting(value, where: str):
    """A weight/density setting in the planner's JSON form (floats, lists, {filter, value} dicts)."""
    return Setting.parse(value, where, ConfigError).json


def _with_fallback(own, merge_wide):
    """One model's setting with mergekit's fallback to the merge-wide one folded in.

    mergekit takes a model's own value when it yields one for a tensor, else the global value. A
    number or gradient always yields one; a condition list may not, so the global value is appended
    as its last condition(s). The result resolves, tensor by tensor, exactly like the two levels."""
    if own is None:
        return merge_wide
    if merge_wide is None or not isinstance(own, list) or not isinstance(own[0], dict):
        return own
    if isinstance(merge_wide, list) and isinstance(merge_wide[0], dict):
        return own + merge_wide
    return own + [{"filter": None, "value": merge_wide}]


def _raw_fallback(own, merge_wide):
    """A module's parameter over the merge-wide one, as written (a condition list falls back to it)."""
    if isinstance(own, dict):
        own = [own]
    if not isinstance(own, list) or not own or not isinstance(own[0], dict):
        return own
    if isinstance(merge_wide, dict):
        merge_wide = [merge_wide]
    if isinstance(merge_wide, list) and merge_wide and isinstance(merge_wide[0], dict):
        return own + merge_wide
    return own + [{"value": merge_wide}]


def _flag_setting(value, where: str):
    """A merge-wide normalize/rescale: true/false, or filters of true/false (mergekit's per-tensor setting)."""
    if not isinstance(value, (list, dict)):
        return _flag(value, where)
    try:
        return Setting.parse_flag(value, where).json
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, not {brief(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, not {brief(value)}")
    return float(value)


def _flag(value, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{where} must be true or false, not {brief(value)}")


def _dtype(value, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in DTYPE_NAMES:
        raise ConfigError(f"{key}: unknown dtype {brief(value)} (float32, bfloat16, float16)")
    return DTYPE_NAMES[value.lower()]


def _exists(path) -> bool:
    try:
        return Path(path).expanduser().exists()
    except (OSError, ValueError):
        return False
