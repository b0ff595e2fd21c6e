"""Budget strings: ``10%``, ``0.1`` (fractions of the full expert read), ``512MiB``, ``8GB``, ``1e9B``."""

from __future__ import annotations

import re

from mergepipe.errors import PlanError

UNITS = {"": None, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
         "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": 1024**3}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[a-z]*)\s*$", re.IGNORECASE)


def parse_budget(spec, full_bytes: int) -> int:
    """Bytes of expert reads allowed by ``spec``; capped at ``full_bytes``."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        text = repr(spec)
    elif isinstance(spec, str):
        text = spec
    else:
        raise PlanError(f"budget must be a string or number, not {type(spec).__name__}")
    m = _PATTERN.match(text)
    if not m:
        raise PlanError(
            f"bad budget {text!r}: use a percentage (10%), a fraction (0.1) or a size (512MiB, 8GB)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if value > 100:
            raise PlanError(f"bad budget {text!r}: a percentage must be at most 100%")
        nbytes = value / 100 * full_bytes
    elif unit == "":
        if value > 1:
            raise PlanError(f"bad budget {text!r}: a bare number is a fraction in (0, 1]; add a unit for bytes (e.g. {text}MiB)")
        nbytes = value * full_bytes
    elif unit in UNITS:
        nbytes = value * UNITS[unit]
    else:
        raise PlanError(f"bad budget {text!r}: unknown unit {m.group(2)!r} (B, KB, MB, GB, KiB, MiB, GiB)")
    if value <= 0:
        raise PlanError(f"bad budget {text!r}: the budget must be positive")
    return min(int(nbytes), full_bytes)


def mib(n: float) -> str:
    """The budget string for ``n`` MiB (the original CLI's --io-budget-mb and the API's budget_mb=)."""
    if n <= 0:
        raise PlanError(f"bad budget {n} MiB: the budget must be positive")
    return f"{n}MiB"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
