"""Per-tensor values as mergekit settings: the first value a precedence chain of settings yields for one
tensor (:func:`_resolve`), and one value per tensor written back as a setting (:func:`_exact`)."""

from __future__ import annotations

from mergepipe.config.model import ConfigError
from mergepipe.ops.setting import Setting


def _resolve(settings, tensor: str, t: float):
    for s in settings:
        if s is not None:
            v = Setting.from_json(s).at(tensor, t)
            if v is not None:
                return float(v)
    return None


def _exact(per: dict[str, float | None], default: float | None):
    """One value per tensor as a setting: a number when they agree, else one exact-name condition per
    tensor (longest names first: a name that is a substring of another must not match it first). A tensor
    without a value takes ``default`` (None: the parameter is required)."""
    values = set(per.values())
    if values == {None}:
        return None
    if None in values:
        if default is None:
            missing = sorted(n for n, v in per.items() if v is None)[0]
            raise ConfigError(f"a per-slice parameter is given for some slices only, and not for {missing}; give it "
                              f"for every slice or under the top-level `parameters:`")
        per = {n: default if v is None else v for n, v in per.items()}
        values = set(per.values())
    if len(values) == 1:
        return values.pop()
    return [{"filter": n, "value": v} for n, v in sorted(per.items(), key=lambda kv: (-len(kv[0]), kv[0]))]
