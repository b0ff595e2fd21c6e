"""An incremental merge's request: add, remove or reweight one expert of a published snapshot
(planned by planner/extend.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mergepipe.errors import PlanError
from mergepipe.planner.budget import Budget
from mergepipe.planner.settings import check_setting

ACTIONS = ("add", "remove", "reweight")


@dataclass(frozen=True)
class ExtendRequest:
    """Change one expert of a published snapshot: ``action`` add (with ``weight``, default 1), remove,
    or reweight (to ``weight``). ``budget``: the added expert's read budget (a fraction of its full
    read, as from-scratch plans spell it); default the parent's fraction."""

    snapshot: str
    action: str
    expert: str
    weight: float | None = None
    budget: Budget | None = None
    out: str | None = None
    model_id: str | None = None

    @classmethod
    def build(cls, snapshot: str, action: str, expert: str, weight=None, budget=None, out=None,
              model_id: str | None = None) -> ExtendRequest:
        if action not in ACTIONS:
            raise PlanError(f"unknown change {action!r} (choose from {', '.join(ACTIONS)})")
        if action == "reweight" and weight is None:
            raise PlanError("--reweight needs the expert's new weight")
        if action == "remove" and weight is not None:
            raise PlanError("--weight goes with --add or --reweight, not --remove")
        if weight is not None:
            weight = float(check_setting(weight, f"weight of {expert}"))
            if not math.isfinite(weight):
                raise PlanError(f"weight of {expert} must be finite, not {weight!r}")
        if budget is not None:
            budget = Budget.of(budget)
            if budget.is_target:
                raise PlanError("an incremental merge takes a byte or fraction budget, not a target bound")
            if action != "add":
                raise PlanError("--budget goes with --add (a removed or reweighted expert keeps the blocks it had)")
        return cls(snapshot, action, expert, weight, budget, None if out is None else str(out), model_id)
