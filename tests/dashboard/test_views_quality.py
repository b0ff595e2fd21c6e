"""Views added for issue 16's second half: the cached per-budget plan view and per-snapshot view, task
suites in Evaluate, and Compare of plans with quality scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.dashboard import views
from mergepipe.dashboard import compare as dash_compare
from mergepipe.dashboard import formatting as dash_formatting
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import snapshots as dash_snapshots
from mergepipe.errors import MergePipeError
from dashboard_helpers import build_catalog, copy_catalog


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("quality"))


@pytest.fixture
def cat(built, tmp_path):
    c = Catalog(copy_catalog(built.db, tmp_path / "c.sqlite"))
    yield c
    c.close()


def test_plan_view_is_the_plan_and_its_figures(cat, built):
    ctx = views.plan_context(cat, "base", list(built.experts), "linear")
    v = views.plan_view(ctx, budget_pct=40)
    p = dash_plan.make_plan(ctx, budget_pct=40)
    assert v.plan.id == p.id and v.plan["access"] == p["access"]
    mask = dash_plan.mask_matrix(ctx, p)
    z = np.asarray(v.mask.data[0].z)
    assert z.dtype == np.float32 and np.array_equal(z, mask.to_numpy(dtype=np.float32))
    x, y = dash_plan.current_point(ctx, p, True)
    assert v.frontier.data[-1].x[0] == pytest.approx(x) and v.frontier.data[-1].y[0] == pytest.approx(y)
    assert v.explain == p.explain()
    t = views.plan_view(ctx, target_rel=0.5)
    assert t.plan.id == dash_plan.make_plan(ctx, target_rel=0.5).id


def test_snapshot_view_matches_the_single_views(cat, built):
    v = views.snapshot_view(cat, built.snapshot_id)
    m = dash_snapshots.load_manifest(cat, built.snapshot_id)
    assert v.manifest.manifest_hash == m.manifest_hash and v.manifest_json == m.to_json()
    assert v.recipe == dash_snapshots.snapshot_recipe(cat, built.snapshot_id) and v.recipe_error is None
    assert v.summary.equals(dash_snapshots.manifest_summary(m))
    assert v.by_tensor.equals(dash_snapshots.bytes_by_tensor_df(m, dash_snapshots.manifest_plan(cat, m)))
    tm = dash_snapshots.touched_matrix(cat, m)
    assert np.array_equal(np.asarray(v.touched.data[0].z), tm.to_numpy(dtype=np.float32))
    assert [b.name for b in v.by_expert.data] == [b.name for b in views.bytes_bars(dash_snapshots.bytes_by_expert_df(m),
                                                                                    "expert").data]



def _suite(path):
    path.write_text(json.dumps({"task": "pick", "prompt": "t5 t6", "choices": ["t50", "t60"], "answer": 0}) + "\n")
    return path


def test_evaluation_inputs(tmp_path):
    text = tmp_path / "held.txt"
    text.write_text("t5 t6 t7")
    suite = _suite(tmp_path / "s.jsonl")
    roots = [tmp_path]
    assert views.evaluation_inputs(str(text), "", roots) == (text.resolve(), None)
    assert views.evaluation_inputs("", str(suite), roots) == (None, suite.resolve())
    assert views.evaluation_inputs(str(text), str(suite), roots) == (text.resolve(), suite.resolve())
    with pytest.raises(MergePipeError, match="^give a held-out text file or a task suite"):
        views.evaluation_inputs(" ", "", roots)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "a", "prompt": "p", "choices": ["x", "y"], "answer": 5}\n')
    with pytest.raises(MergePipeError, match="bad.jsonl:1: .*answer index 5 is not one of the 2 choices"):
        views.evaluation_inputs("", str(bad), roots)
    with pytest.raises(MergePipeError, match="outside the allowed folders"):
        views.evaluation_inputs("", "/etc/hostname", roots)
    with pytest.raises(MergePipeError, match="is not a file"):
        views.evaluation_inputs(str(tmp_path), "", roots)


def test_scores_next_to_bytes_and_bound(cat, built):
    from mergepipe.api import record_evaluation
    fp = {m["id"]: m["fingerprint"] for m in cat.models()}
    for mid, acc in (("merged-1", 0.75), ("base", 0.5), ("expert_1", 0.25), ("expert_2", 1.0)):
        record_evaluation(cat, mid, fp[mid], "sha256:aa", "suite.jsonl", "accuracy", acc, 4)
        record_evaluation(cat, mid, fp[mid], "sha256:aa", "suite.jsonl", "accuracy:pick", acc, 4)
    record_evaluation(cat, "merged-1", fp["merged-1"], "sha256:bb", "held.txt", "perplexity", 12.5, 100)
    assert dash_snapshots.latest_scores(cat, "accuracy") == {"merged-1": 0.75, "base": 0.5, "expert_1": 0.25, "expert_2": 1.0}
    row = views.snapshots_df(cat).iloc[0]
    plan = cat.query("SELECT error_bound FROM plans WHERE id = ?", [built.plan_id])[0]["error_bound"]
    assert row["accuracy"] == 0.75 and row["perplexity"] == 12.5 and row["error_bound"] == pytest.approx(plan)
    m = dash_snapshots.load_manifest(cat, built.snapshot_id)
    evals = views.evaluation_df(cat, m)
    assert evals[evals["metric"] == "accuracy:pick"]["model"].tolist() == ["merged-1", "base", "expert_1", "expert_2"]
    line = views.budget_quality(m, evals)
    assert line.endswith(" · perplexity 12.5 on held.txt · accuracy 0.75 (base 0.5, experts 0.25 to 1) on suite.jsonl")
    assert line.startswith("read ")


def _ranges_total(access: dict) -> int:
    return sum(hi - lo for ts in access.values() for rs in ts.values() for lo, hi in rs)


def test_compare_a_plan_with_its_snapshot(cat, built):
    ids, captions = views.choices(cat)
    assert ids == [built.snapshot_id, built.plan_id]
    assert captions[built.plan_id].startswith("saved plan: linear on base, would read ")
    p, s = views.side(cat, built.plan_id), views.side(cat, built.snapshot_id)
    d = views.settings_diff(p, s).set_index("field")
    assert d.at["model", "A"] == dash_compare.NOT_MERGED and d.at["model", "B"] == "merged-1"
    assert set(d[d["same"] == "no"].index) == {"model"}  # the same settings: the snapshot did what the plan said
    n = views.numbers_df(p, s).set_index("quantity")
    assert n.at["expert read (realized)", "A"] == dash_compare.NOT_MERGED
    assert n.at["expert read (estimated)", "A"] == n.at["expert read (estimated)", "B"]
    assert n.at["error bound", "A"] == n.at["error bound", "B"]
    acc = views.access_diff(p, s)
    assert acc["only A"].sum() == 0 and acc["only B"].sum() == 0  # the merge read exactly the plan's access set
    assert acc["A"].sum() == _ranges_total(dash_snapshots.load_manifest(cat, built.snapshot_id).core["touched"])
    assert views.lineage_note(p, s)[0] == f"Both come from plan {built.plan_id}."


def test_compare_two_plans_and_scores(cat, built):
    from mergepipe.api import record_evaluation, save_plan
    from mergepipe.planner.plan import load_plan
    ties = dash_plan.make_plan(views.plan_context(cat, "base", list(built.experts), "ties", density=0.5), 60)
    save_plan(cat, ties)
    a, b = views.side(cat, built.plan_id), views.side(cat, ties.id)
    d = views.settings_diff(a, b, only_different=True).set_index("field")
    assert d.at["operator", "A"] == "linear" and d.at["operator", "B"] == "ties" and "base" not in d.index
    n = views.numbers_df(a, b).set_index("quantity")
    assert n.at["error bound", "B"] == dash_formatting.fmt_bound(ties["error_bound"], "ties")
    assert n.at["error bound", "B"].startswith(f"{ties['error_bound']['absolute']:.4g} (relative ")
    assert n.at["expert read (estimated)", "B"] == views.fmt_bytes(ties["estimate"]["expert_read"])
    acc = views.access_diff(a, b)
    assert acc["A"].sum() == _ranges_total(load_plan(cat, built.plan_id)["access"])
    assert acc["B"].sum() == _ranges_total(ties["access"])
    assert views.scores_df(cat, a, b).empty
    fp = {m["id"]: m["fingerprint"] for m in cat.models()}
    record_evaluation(cat, "merged-1", fp["merged-1"], "sha256:aa", "suite.jsonl", "accuracy", 0.75, 4)
    record_evaluation(cat, "merged-1", fp["merged-1"], "sha256:bb", "held.txt", "perplexity", 12.5, 100)
    sc = views.scores_df(cat, views.side(cat, built.snapshot_id), b)
    assert sc.to_dict("records") == [
        {"metric": "perplexity", "data": "held.txt", "A": "12.5", "B": dash_compare.NOT_MERGED},
        {"metric": "accuracy", "data": "suite.jsonl", "A": "0.75", "B": dash_compare.NOT_MERGED}]
