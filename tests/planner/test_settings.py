"""Per-tensor weights and densities (mergekit's filters and gradients): resolution rules, and merges
that equal, tensor by tensor, the plain merge with that tensor's values."""

from __future__ import annotations

import pytest
import torch

from mergepipe.api import merge
from mergepipe.errors import PlanError
from mergepipe.planner.context import Planner
from mergepipe.planner.settings import check_setting, evaluate, layer_t, num_layers, resolve

from merge_helpers import l2_dist, load_dir, open_copy, shared_family

ATTN_LOW = [{"filter": "self_attn", "value": 0.3}, {"value": 0.7}]


# --- resolution rules --------------------------------------------------------------------------------------
def test_scalars_gradients_and_filters_follow_mergekit():
    assert evaluate(0.5, "x", 0.3) == 0.5
    grad = [0.0, 1.0, 0.5]
    assert [evaluate(grad, "x", t) for t in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0.0, 0.5, 1.0, 0.75, 0.5]
    conds = check_setting([{"filter": "mlp", "value": [0.2, 0.4]}, {"filter": "*", "value": 0.9}], "w")
    assert evaluate(conds, "model.layers.1.mlp.up_proj.weight", 1.0) == pytest.approx(0.4)
    assert evaluate(conds, "model.layers.1.self_attn.q_proj.weight", 1.0) == 0.9
    first_match = check_setting([{"filter": "proj", "value": 1.0}, {"filter": "q_proj", "value": 2.0}], "w")
    assert evaluate(first_match, "a.q_proj.weight", 0) == 1.0  # the first matching condition wins
    no_default = check_setting([{"filter": "mlp", "value": 0.2}], "w")
    assert evaluate(no_default, "model.norm.weight", 0) is None
    assert resolve([no_default, 0.6], "model.norm.weight", 0, 1.0) == 0.6  # falls back to the merge-wide value
    assert resolve([None, None], "model.norm.weight", 0, 1.0) == 1.0


def test_layer_position():
    assert num_layers(["model.layers.0.a", "model.layers.3.a"], {}) == 4
    assert num_layers([], {"num_hidden_layers": 28}) == 28
    assert layer_t("model.layers.0.mlp.up_proj.weight", 5) == 0.0
    assert layer_t("model.layers.4.mlp.up_proj.weight", 5) == 1.0
    assert layer_t("model.layers.2.mlp.up_proj.weight", 5) == 0.5
    assert layer_t("model.embed_tokens.weight", 5) == 0.0 and layer_t("lm_head.weight", 5) == 0.0


@pytest.mark.parametrize("value,message", [
    ("abc", r"weight of e1 must be a number, a list of numbers"),
    ([{"filter": "mlp", "value": [{"value": 1}]}], r"weight of e1\[0\].value: conditions cannot be nested"),
    ([{"filter": 3, "value": 1}], r"weight of e1\[0\].filter must be a substring of tensor names, not 3"),
    ([{"filter": "mlp", "val": 1}], "keys filter and value"),
    (float("nan"), "finite"),
    ([], "is an empty list"),
    ([0.5, {"value": 1}], r"weight of e1\[0\] must be a \{filter, value\} condition"),
    ({"filter": "mlp", "value": [0.1, "x"]}, r"weight of e1\[0\].value\[1\] must be a number"),
])
def test_bad_settings_are_refused(value, message):
    with pytest.raises(PlanError, match=message):
        check_setting(value, "weight of e1")


# --- merges --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


@pytest.fixture
def cat(fam, tmp_path):
    c = open_copy(fam, tmp_path / "c.sqlite")
    yield c
    c.close()


def _merge(cat, tmp_path, tag, experts, op, **kw):
    plan, _, _ = merge(cat, "base", experts, tmp_path / tag, operator=op, model_id=tag, **kw)
    return plan, load_dir(tmp_path / tag)


@pytest.mark.parametrize("op", ["ties", "dare_ties", "linear", "breadcrumbs"])
def test_filtered_weights_equal_per_tensor_scalar_merges(fam, cat, tmp_path, op):
    e1, e2, e3 = fam.expert_ids
    kw = {"density": 0.5} if op != "linear" else {}
    plan, out = _merge(cat, tmp_path, "filtered", [{"model": e1, "weight": ATTN_LOW}, e2, {"model": e3, "weight": 0.5}], op, **kw)
    _, low = _merge(cat, tmp_path, "low", [{"model": e1, "weight": 0.3}, e2, {"model": e3, "weight": 0.5}], op, **kw)
    _, high = _merge(cat, tmp_path, "high", [{"model": e1, "weight": 0.7}, e2, {"model": e3, "weight": 0.5}], op, **kw)
    attn = [n for n in out if "self_attn" in n]
    assert attn and len(attn) < len(out)
    for name in out:
        ref = low if "self_attn" in name else high
        assert torch.equal(out[name], ref[name]), name
    e1_spec = plan["experts"][0]
    assert e1_spec["weight"] is None and e1_spec["settings"]["weight"] == check_setting(ATTN_LOW, "w")
    assert {w for w, _ in e1_spec["tensors"].values()} == {0.3, 0.7}


def test_density_gradient_over_layers(fam, cat, tmp_path):
    """tiny has 2 layers: layer 0 at t=0 gets 0.3, layer 1 at t=1 gets 0.5; other tensors t=0 -> 0.3."""
    e1, e2, e3 = fam.expert_ids
    plan, out = _merge(cat, tmp_path, "grad", fam.expert_ids, "ties", density=[0.3, 0.9, 0.5])
    _, d3 = _merge(cat, tmp_path, "d3", fam.expert_ids, "ties", density=0.3)
    _, d5 = _merge(cat, tmp_path, "d5", fam.expert_ids, "ties", density=0.5)
    for name in out:
        ref = d5 if ".layers.1." in name else d3
        assert torch.equal(out[name], ref[name]), name
    assert plan["thresholds"][e1]["model.layers.1.mlp.up_proj.weight"][0] == \
        cat.tensor_stats(e1)["model.layers.1.mlp.up_proj.weight"]["thresholds"][0.5]


def test_per_tensor_weights_keep_the_error_bound(fam, cat, tmp_path):
    experts = [{"model": fam.expert_ids[0], "weight": [0.2, 1.5]}, {"model": fam.expert_ids[1], "weight": ATTN_LOW},
               fam.expert_ids[2]]
    full_plan, full = _merge(cat, tmp_path, "full", experts, "task_arithmetic", lam=0.8)
    for budget in ("20%", "50%", "80%"):
        plan, part = _merge(cat, tmp_path, f"b{budget[:-1]}", experts, "task_arithmetic", lam=0.8, budget=budget)
        assert plan["estimate"]["expert_read"] <= plan["budget"]["bytes"]
        assert 0 < l2_dist(full, part) <= plan["error_bound"]["absolute"] * (1 + 1e-5) + 1e-6


def test_plan_digest_depends_on_the_settings(fam, cat):
    planner = Planner(cat)
    a = planner.plan("base", fam.expert_ids, "ties", density=0.5, save=False)
    b = planner.plan("base", fam.expert_ids, "ties", density=[0.5, 0.5], save=False)
    c = planner.plan("base", fam.expert_ids, "ties", density=[0.5, 0.3], save=False)
    assert a["access"] == b["access"] and "tensors" not in a["experts"][0]
    assert b["experts"][0]["density"] == 0.5 and "tensors" in b["experts"][0]
    assert len({a.digest, b.digest, c.digest}) == 3


def test_out_of_range_density_names_the_tensor(fam, cat):
    with pytest.raises(PlanError, match=r"density 1.2 of e1 on model.layers.1.* is outside \(0, 1\]"):
        Planner(cat).plan("base", fam.expert_ids, "ties", density=[0.5, 1.2], save=False)
    with pytest.raises(PlanError, match="must be a number"):
        Planner(cat).plan("base", [{"model": fam.expert_ids[0], "weight": "heavy"}], "ties", save=False)
