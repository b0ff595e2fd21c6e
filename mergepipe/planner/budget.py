"""Budgets: ``10%``, ``0.1`` (fractions of the full expert read), ``512MiB``, ``8GB``, ``1e9B``, a number
of MiB (``--io-budget-mb``, ``budget_mb=``), a slider percentage, or a target error bound.

:class:`Budget` parses every spelling once, into a fraction of the full expert read or a number of
bytes (or a target bound), and keeps the text that plans record as their budget spec; the full
expert read is only known to the planner, which asks :meth:`Budget.bytes_of`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mergepipe.errors import PlanError
from mergepipe.units import human_bytes

UNITS = {"": None, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
         "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": 1024**3}
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[a-z]*)\s*$", re.IGNORECASE)
MAX_NUMBER = 1e30  # a budget number beyond this is a typo (1e30 B is a million exabytes)


@dataclass(frozen=True, eq=False)
class Budget:
    """An expert-read budget, parsed once. ``spec`` is the text a plan records (``100%``, ``10%``,
    ``0.1``, ``512MiB``, ``target-bound 0.05``); exactly one of ``fraction`` (of the full expert
    read), ``nbytes`` and ``target_bound`` is set."""

    spec: str = "100%"
    fraction: float | None = 1.0
    nbytes: float | None = None
    target_bound: float | None = None

    @classmethod
    def of(cls, value=None, mb: float | None = None, target_bound: float | None = None) -> Budget:
        """Every spelling: a Budget, None (100%), a string or number (``parse``), ``mb`` MiB, or a
        target bound (which wins over a budget, as the planner always did)."""
        if target_bound is not None:
            return cls.target(target_bound)
        if isinstance(value, Budget):
            return value
        if mb is not None:  # MiB wins over a budget given too (the API always did so)
            return cls.parse(mib(mb))
        return cls() if value is None else cls.parse(value)

    @classmethod
    def parse(cls, value) -> Budget:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (isinstance(value, int) and abs(value) <= MAX_NUMBER or isinstance(value, float)):
                raise PlanError("bad budget: the number is too large")
            text, spec = repr(value), str(value)
        elif isinstance(value, str):
            text = spec = value
        else:
            raise PlanError(f"budget must be a string or number, not {type(value).__name__}")
        kind, amount = _parse(text)
        return cls(spec, amount if kind == "fraction" else None, amount if kind == "bytes" else None)

    @classmethod
    def percent(cls, pct: float) -> Budget:
        """A slider's value, in percent of the full expert read."""
        pct = _number(pct, "the budget percentage")
        if not pct > 0:
            raise PlanError("the budget must be positive: move the slider above 0%")
        return cls.parse(f"{pct:g}%")

    @classmethod
    def target(cls, bound: float) -> Budget:
        """The smallest budget whose relative error bound is at most ``bound`` (additive operators)."""
        bound = _number(bound, "--target-bound")
        if not bound >= 0:
            raise PlanError("--target-bound must be a non-negative number")
        return cls(f"target-bound {bound:g}", None, None, bound)

    @property
    def is_target(self) -> bool:
        return self.target_bound is not None

    def bytes_of(self, full_bytes: int) -> int:
        """Bytes of expert reads allowed out of ``full_bytes``; capped at ``full_bytes``."""
        if self.is_target:
            raise PlanError("a target bound has no fixed byte budget")
        nbytes = self.fraction * full_bytes if self.fraction is not None else self.nbytes
        return min(int(nbytes), full_bytes)

    def __str__(self) -> str:
        return self.spec

    def _key(self) -> tuple:
        return (self.spec, self.fraction, self.nbytes, self.target_bound)

    def __eq__(self, other) -> bool:
        """Equal to a Budget with the same value and spec, and to its spec text (``cfg.budget == "25%"``)."""
        if isinstance(other, str):
            return self.spec == other
        return isinstance(other, Budget) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self.spec)


def parse_budget(spec, full_bytes: int) -> int:
    """Bytes of expert reads allowed by ``spec``; capped at ``full_bytes``."""
    return Budget.parse(spec).bytes_of(full_bytes)


def _parse(text: str) -> tuple[str, float]:
    """("fraction", f) or ("bytes", n) for a budget string."""
    m = _PATTERN.match(text)
    shown = _show(text)
    if not m:
        raise PlanError(
            f"bad budget {shown}: use a percentage (10%), a fraction (0.1) or a size (512MiB, 8GB)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value) or abs(value) > MAX_NUMBER:  # 1e309 is inf as a float
        raise PlanError(f"bad budget {shown}: the number is too large")
    if value <= 0:
        raise PlanError(f"bad budget {shown}: the budget must be positive")
    if unit == "%":
        if value > 100:
            raise PlanError(f"bad budget {shown}: a percentage must be at most 100%")
        result = ("fraction", value / 100)
    elif unit == "":
        if value > 1:
            raise PlanError(f"bad budget {shown}: a bare number is a fraction in (0, 1]; add a unit for bytes "
                            f"(e.g. {m.group(1)}MiB)")
        result = ("fraction", value)
    elif unit in UNITS:
        result = ("bytes", value * UNITS[unit])
    else:
        raise PlanError(f"bad budget {shown}: unknown unit {_show(m.group(2))} (B, KB, MB, GB, KiB, MiB, GiB)")
    return result


def mib(n: float) -> str:
    """The budget string for ``n`` MiB (the original CLI's --io-budget-mb and the API's budget_mb=)."""
    if _number(n, "the budget in MiB") <= 0:
        raise PlanError(f"bad budget {n} MiB: the budget must be positive")
    return f"{n}MiB"


def _number(value, what: str) -> float:
    """A finite number of a sensible size as a float, or one PlanError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            try:
                return _number(float(value), what)
            except ValueError:
                pass
        raise PlanError(f"{what} must be a number, not {type(value).__name__}")
    if isinstance(value, int) and abs(value) > MAX_NUMBER or not math.isfinite(value) or abs(value) > MAX_NUMBER:
        raise PlanError(f"{what} must be a finite number of at most {MAX_NUMBER:g}")
    return float(value)


def _show(text: str, limit: int = 40) -> str:
    """A budget string as given, cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


human_bytes = human_bytes  # re-exported: mergepipe.units is where it lives
