"""MergeRequest and Budget (issue 13, part 2): every budget spelling parses once into the same value and
the same plan spec; a request is validated once, whoever builds it; plans made from a request equal the
plans made from the keyword conveniences (same id and digest)."""

from __future__ import annotations

import pytest

from mergepipe import api
from mergepipe.errors import PlanError
from mergepipe.planner.budget import Budget, parse_budget
from mergepipe.planner.context import Planner
from mergepipe.planner.request import MergeRequest

from merge_helpers import open_copy, shared_family

FULL = 100 << 30


# --- Budget -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, spec, nbytes", [
    (None, "100%", FULL),
    ("10%", "10%", int(0.1 * FULL)),
    (" 20% ", " 20% ", int(0.2 * FULL)),
    (0.1, "0.1", int(0.1 * FULL)),
    ("0.1", "0.1", int(0.1 * FULL)),
    (1, "1", FULL),
    ("512MiB", "512MiB", 512 * 2**20),
    ("8GB", "8GB", 8 * 10**9),
    ("1e6B", "1e6B", 10**6),
])
def test_budget_spellings(value, spec, nbytes):
    b = Budget.of(value)
    assert b.spec == spec and str(b) == spec and not b.is_target
    assert b.bytes_of(FULL) == nbytes
    if value is not None:
        assert parse_budget(value, FULL) == nbytes
    assert Budget.of(b) is b  # a Budget passes through: parsed once


def test_budget_mib_slider_and_target():
    assert Budget.of(mb=512).spec == "512MiB" and Budget.of(mb=512).bytes_of(FULL) == 512 * 2**20
    assert Budget.of(mb=0.5).spec == "0.5MiB" and Budget.of(mb=0.5).bytes_of(FULL) == 2**19
    assert Budget.of(mb=512.0).spec == "512.0MiB"  # the spec the CLI's --io-budget-mb always wrote
    assert Budget.of("10%", mb=1).spec == "1MiB"  # MiB wins, as budget_mb= always did
    assert Budget.percent(25) == Budget.of("25%") and Budget.percent(25.0).spec == "25%"
    assert Budget.percent(12.5).bytes_of(1000) == 125
    t = Budget.of("10%", target_bound=0.05)  # a target bound wins over a budget
    assert t.is_target and t.target_bound == 0.05 and t.spec == "target-bound 0.05"
    assert Budget.of(mb=10 << 20).bytes_of(1000) == 1000  # capped at the full read
    with pytest.raises(PlanError):
        t.bytes_of(FULL)


@pytest.mark.parametrize("call, words", [
    (lambda: Budget.of("lots"), "bad budget 'lots'"),
    (lambda: Budget.of("150%"), "at most 100%"),
    (lambda: Budget.of(2), "a bare number is a fraction"),
    (lambda: Budget.of("0%"), "must be positive"),
    (lambda: Budget.of("5 parsecs"), "unknown unit"),
    (lambda: Budget.of(True), "string or number"),
    (lambda: Budget.of([1]), "string or number"),
    (lambda: Budget.of(mb=-1), "must be positive"),
    (lambda: Budget.percent(0), "move the slider above 0%"),
    (lambda: Budget.target(-1), "--target-bound must be a non-negative number"),
    (lambda: Budget.target(float("nan")), "--target-bound must be a finite number of at most 1e+30"),
])
def test_budget_errors(call, words):
    with pytest.raises(PlanError, match=None) as exc:
        call()
    assert words in str(exc.value)


# --- MergeRequest -----------------------------------------------------------------------------------------
def test_request_build_validates_once():
    r = MergeRequest.build("base", ["e1", {"model": "e2", "density": 0.3}], "TIES", weights=[2, 1], density=0.5,
                           lam=0.8, budget="25%", seed=3, strategy="kept", out="/tmp/x", model_id="m")
    assert r.operator == "ties"  # canonical name
    assert r.experts == ({"model": "e1", "weight": 2}, {"model": "e2", "density": 0.3, "weight": 1})
    assert r.params == {"lam": 0.8} and r.density == 0.5 and r.budget == Budget.of("25%")
    assert (r.seed, r.strategy, r.out, r.model_id) == (3, "kept", "/tmp/x", "m")
    assert r.resolved_params() == {"normalize": True, "rescale": False, "lambda": 0.8}
    assert r.validated() == r
    d = MergeRequest.build("base", ["e1"])
    assert (d.operator, d.budget, d.seed, d.strategy) == ("linear", Budget(), 0, "norm")
    assert MergeRequest.build("base", ["e1"], "avg").operator == "linear"
    assert api.merge_request("base", ["e1"], "dare", budget_mb=1).budget.spec == "1MiB"


@pytest.mark.parametrize("kw, words", [
    (dict(operator="task_adapter"), "unknown operator 'task_adapter'"),
    (dict(operator="ties", gamma=0.1), "operator ties takes no parameter gamma"),
    (dict(strategy="best"), "unknown strategy 'best'"),
    (dict(weights=[1, 2, 3]), "3 weights given for 2 experts"),
    (dict(budget="lots"), "bad budget 'lots'"),
    (dict(target_bound=-1), "--target-bound must be a non-negative number"),
    (dict(experts=[{"weight": 1}]), "has no model id"),
])
def test_request_errors(kw, words):
    experts = kw.pop("experts", ["e1", "e2"])
    operator = kw.pop("operator", "linear")
    with pytest.raises(PlanError) as exc:
        MergeRequest.build("base", experts, operator, **kw)
    assert words in str(exc.value)


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


def test_request_plans_equal_keyword_plans(fam, tmp_path):
    """The planner takes one MergeRequest; the keyword conveniences build the same one (same plan)."""
    cat = open_copy(fam, tmp_path / "c.sqlite")
    ids = fam.expert_ids
    cases = [
        (dict(operator="linear", budget="30%"), "30%"),
        (dict(operator="ties", density=0.3, weights=[2.0] + [1.0] * (len(ids) - 1), budget_mb=0.25), "0.25MiB"),
        (dict(operator="task_arithmetic", lam=0.5, target_bound=0.2), "target-bound 0.2"),
        (dict(operator="breadcrumbs", density=0.3, gamma=0.01, budget=0.5, seed=2), "0.5"),
    ]
    for kw, spec in cases:
        op = kw.pop("operator")
        by_kw = api.plan_merge(cat, "base", ids, op, save=False, **kw)
        req = MergeRequest.build("base", ids, op, **kw)
        by_req = api.plan(cat, req, save=False)
        by_planner = Planner(cat).plan(req, save=False)
        assert by_kw.id == by_req.id == by_planner.id and by_kw.digest == by_req.digest
        assert by_req["budget"]["spec"] == spec
    with pytest.raises(PlanError, match="not both"):
        Planner(cat).plan(MergeRequest.build("base", ids), ids)
    cat.close()
