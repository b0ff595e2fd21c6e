"""The typed reads of a Plan (planner/plan.py) agree with its data, and EXPLAIN is its sections in order."""

from __future__ import annotations

import pytest

from merge_helpers import open_copy, shared_family
from mergepipe import api
from mergepipe.planner import explain
from mergepipe.planner.plan import Plan, as_plan
from mergepipe.planner.settings import params_on

EXPERTS = ["e1", "e2", "e3"]


@pytest.fixture
def catalog(tmp_path_factory, tmp_path):
    cat = open_copy(shared_family(tmp_path_factory, "tiny-fp32"), tmp_path / "catalog.sqlite")
    yield cat
    cat.close()


def test_accessors_read_the_plan_format(catalog):
    plan = api.plan_merge(catalog, "base", EXPERTS, operator="ties", budget="40%", save=False,
                          lam=[{"filter": "mlp", "value": 0.5}, {"value": 1.0}])
    d = plan.data
    assert (plan.operator, plan.params, plan.seed, plan.strategy) == (d["operator"], d["params"], d["seed"],
                                                                      d["strategy"])
    assert plan.base_id == d["base"]["id"] and plan.block_bytes == d["grid"]["block_bytes"]
    assert plan.expert_ids == EXPERTS and plan.experts is d["experts"]
    assert plan.budget_bytes == d["budget"]["bytes"] and plan.estimated is d["estimate"]
    assert plan.estimated_by_expert == d["expert_read_by_expert"] and plan.error_bound == d["error_bound"]
    for e in EXPERTS:
        assert plan.access_for(e) is d["access"][e]
    for t in {t for ts in d["access"].values() for t in ts}:
        assert plan.params_for(t) == params_on(d["params"], d.get("tensor_params"), t)
    assert any(plan.params_for(t)["lambda"] == 0.5 for t in d["tensor_params"])
    assert plan.inputs() == [d["base"], *d["experts"]] and not plan.is_extend
    assert plan.layout is None and plan.vocab is None and plan.composed_tensors == set()
    assert as_plan(d).data is d and as_plan(plan) is plan


def test_explain_is_its_sections_in_order(catalog):
    plan = api.plan_merge(catalog, "base", EXPERTS, operator="ties", budget="40%", save=False)
    p = Plan(plan.data)
    sections = (explain.header_lines(p) + [explain.budget_line(p.data), explain.estimate_line(p)]
                + explain.tier_lines(p) + explain.transfer_lines(p) + explain.bound_section(p)
                + explain.shape_lines(p) + explain.expert_lines(p) + explain.tensor_lines(p))
    assert explain.explain_plan(plan.data) == plan.explain() == "\n".join(sections)
    assert explain.explain_plan(plan.data).startswith(f"PLAN {plan.id}  ({plan.digest})\n  operator   ties")
