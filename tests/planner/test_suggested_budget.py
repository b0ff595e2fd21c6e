"""The budget the planner suggests (planner/bounds.py): the smallest greedy budget whose blockwise bound is
at most SUGGEST_BOUND_FRACTION x the estimated update norm; recorded outside the digest, printed by EXPLAIN."""

from __future__ import annotations

import pytest

from merge_helpers import open_copy, shared_family
from mergepipe import api
from mergepipe.planner.bounds import SUGGEST_BOUND_FRACTION
from mergepipe.planner.explain import explain_plan

EXPERTS = ["e1", "e2", "e3"]


@pytest.fixture
def catalog(tmp_path_factory, tmp_path):
    cat = open_copy(shared_family(tmp_path_factory, "tiny-fp32"), tmp_path / "catalog.sqlite")
    yield cat
    cat.close()


@pytest.mark.parametrize("operator", ["linear", "task_arithmetic"])
def test_the_suggestion_meets_its_rule_and_a_smaller_budget_does_not(catalog, operator):
    s = api.plan_merge(catalog, "base", EXPERTS, operator=operator, budget="25%", save=False)["suggested_budget"]
    assert 0 < s["bytes"] < api.plan_merge(catalog, "base", EXPERTS, operator=operator, save=False)["budget"]["bytes"]
    target = SUGGEST_BOUND_FRACTION * s["full_delta_norm"]
    at = api.plan_merge(catalog, "base", EXPERTS, operator=operator, budget_mb=s["bytes"] / 2**20, save=False)
    assert at["estimate"]["expert_read"] == s["bytes"]
    assert at["error_bound"]["blockwise"] == pytest.approx(s["blockwise"], rel=1e-9)
    assert s["blockwise"] <= target
    below = api.plan_merge(catalog, "base", EXPERTS, operator=operator, budget_mb=0.9 * s["bytes"] / 2**20,
                           save=False)
    assert below["error_bound"]["blockwise"] > target


def test_the_suggestion_is_outside_the_digest_and_in_explain(catalog):
    a = api.plan_merge(catalog, "base", EXPERTS, operator="task_arithmetic", budget="25%", save=False)
    b = api.plan_merge(catalog, "base", EXPERTS, operator="task_arithmetic", budget="60%", save=False)
    assert a["suggested_budget"] == b["suggested_budget"]  # a property of the experts, not of the budget asked
    text = explain_plan(a.data)
    pct = round(100 * a["suggested_budget"]["fraction_of_full"])
    assert f"  suggest    budget {pct}% (" in text
    assert f"whose bound <= {SUGGEST_BOUND_FRACTION:g} x ||M_full - base||; in the study (" in text
    # what the rule did where it was validated, stated as measured (planner/bounds.py SUGGEST_VALIDATION)
    from mergepipe.planner.bounds import SUGGEST_VALIDATION as v
    assert (f"{v['within']} of {v['of']} held-out configurations at this rule lost at most 1 point against their "
            f"full merge") in " ".join(text.split())
    popped = dict(a.data)
    popped.pop("suggested_budget")
    assert "suggest" not in explain_plan(popped)


def test_no_suggestion_where_the_bound_does_not_apply(catalog):
    ties = api.plan_merge(catalog, "base", EXPERTS, operator="ties", budget="25%", save=False)
    assert "suggested_budget" not in ties.data
