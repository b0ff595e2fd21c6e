"""A plan is data: canonical JSON with a digest over the inputs' fingerprints, operator, parameters,
grid and access set (compact block ranges per expert and tensor); saved in and loaded from the catalog."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mergepipe.catalog import plans
from mergepipe.catalog.db import Catalog
from mergepipe.errors import PlanError
from mergepipe.planner.explain import explain_plan
from mergepipe.planner.extend_format import explain_extend, is_extend


PLAN_FORMAT = "mergepipe.plan/1"


@dataclass
class Plan:
    """A content-addressed merge plan. ``data`` is the canonical, JSON-serialisable form."""

    data: dict

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def digest(self) -> str:
        return self.data["digest"]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.data, sort_keys=True, indent=indent, separators=None if indent else (",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(json.loads(text))

    def __getitem__(self, key):
        return self.data[key]

    @property
    def selected_blocks(self) -> int:
        return sum(r[1] - r[0] for tensors in self.data["access"].values() for rs in tensors.values() for r in rs)

    def explain(self) -> str:
        if is_extend(self.data):
            return explain_extend(self.data)
        return explain_plan(self.data)


def compact_ranges(indices) -> list[list[int]]:
    """[0,1,2,5,6] -> [[0,3],[5,7]] (half-open ranges)."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def expand_ranges(ranges) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


def save_plan(catalog: Catalog, plan: Plan) -> None:
    plans.upsert_plan(catalog, {
        "id": plan.id, "base_id": plan["base"]["id"], "operator": plan["operator"],
        "budget_bytes": plan["budget"]["bytes"], "full_expert_bytes": plan["full_expert_bytes"],
        "expert_read_bytes": plan["estimate"]["expert_read"],
        "error_bound": (plan["error_bound"] or {}).get("absolute"), "json": plan.to_json(),
    })


def load_plan(catalog: Catalog, plan_id: str) -> Plan:
    text = plans.plan_json(catalog, plan_id)
    if text is None:
        raise PlanError(f"unknown plan id {plan_id!r}")
    return Plan.from_json(text)
