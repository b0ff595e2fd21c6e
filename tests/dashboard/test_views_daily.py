"""Unit tests of the dashboard's daily-use views (issue 16): norm scales, the outlier-expert warning,
discrete access masks with axis labels, top-N tensor bytes with the difference, URL replacements,
plan wording."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dashboard_helpers import EXPERTS, copy_catalog
from mergepipe.catalog import analyses
from mergepipe.catalog.db import Catalog
from mergepipe.dashboard import views
from mergepipe.dashboard import figures as dash_figures
from mergepipe.dashboard import formatting as dash_formatting
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import snapshots as dash_snapshots

E = list(EXPERTS)


@pytest.fixture
def cat(built, tmp_path):
    c = Catalog(copy_catalog(built.db, tmp_path / "c.sqlite"))
    yield c
    c.close()


def test_norm_transform_log_and_per_expert():
    m = pd.DataFrame({"a": [1.0, 10.0, 0.0], "b": [1000.0, 100.0, 10.0]}, index=["x", "y", "z"])
    lin, label = views.norm_transform(m, "linear", "absolute")
    assert label == "||delta||" and lin.equals(m)
    lg, label = views.norm_transform(m, "log", "absolute")
    assert label == "log10 ||delta||"
    assert lg.at["y", "a"] == pytest.approx(1.0) and lg.at["x", "b"] == pytest.approx(3.0)
    assert np.isnan(lg.at["z", "a"])  # unchanged: blank, not -inf
    per, label = views.norm_transform(m, "linear", "per expert")
    assert label == "||delta|| / expert max"
    assert per["a"].tolist() == pytest.approx([0.1, 1.0, 0.0]) and per["b"].tolist() == pytest.approx([1.0, 0.1, 0.01])
    both, label = views.norm_transform(m, "log", "per expert")
    assert label == "log10 ||delta|| / expert max" and both.at["y", "b"] == pytest.approx(-1.0)
    zero = pd.DataFrame({"a": [0.0, 0.0]})
    assert views.norm_transform(zero, "linear", "per expert")[0]["a"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        views.norm_transform(m, "cubic")
    fig = views.norm_heatmap(m, "layer", "log", "per expert")
    assert "log scale" in fig.layout.title.text and fig.data[0].colorbar.title.text == "log10 ||delta|| / expert max"


def _inflate(cat, expert: str, factor: float) -> None:
    cat.conn.execute("UPDATE tensor_stats SET delta_l2 = delta_l2 * ? WHERE model_id = ?", [factor, expert])
    cat.conn.commit()


def test_outlier_expert_warning_from_stored_statistics(cat):
    rms = analyses.delta_rms_by_expert(cat, "base")
    assert sorted(rms) == E and all(v > 0 for v in rms.values())
    assert analyses.outlier_warnings(cat, "base") == [] and views.expert_warnings(cat) == []
    _inflate(cat, "expert_2", 1000.0)
    found = analyses.outlier_experts(analyses.delta_rms_by_expert(cat, "base"))
    assert list(found) == ["expert_2"] and found["expert_2"] > 100
    w = views.expert_warnings(cat)
    assert len(w) == 1 and "'expert_2'" in w[0] and "different base" in w[0]
    assert analyses.outlier_warnings(cat, "base", ["expert_1"]) == []  # only the experts asked about
    # the plan carries it (EXPLAIN prints plan warnings)
    plan = dash_plan.make_plan(views.plan_context(cat, "base", E, "linear"), 25)
    assert any("expert_2" in x and "different base" in x for x in plan.data["warnings"])
    assert "warning    expert 'expert_2'" in plan.explain()
    plan = dash_plan.make_plan(views.plan_context(cat, "base", ["expert_1", "expert_3"], "linear"), 25)
    assert not plan.data.get("warnings")
    assert analyses.outlier_experts({"a": 1.0}) == {}  # no sibling: nothing to compare with
    assert analyses.outlier_experts({"a": 1.0, "b": 0.0, "c": 150.0}) == {"c": 150.0}


def test_mask_heatmap_is_discrete_with_axis_labels(built):
    c = Catalog(built.db)
    try:
        ctx = views.plan_context(c, "base", E, "linear")
        mask = dash_plan.mask_matrix(ctx, dash_plan.make_plan(ctx, 25))
    finally:
        c.close()
    fig = dash_plan.mask_heatmap(mask)
    heat = fig.data[0]
    assert heat.type == "heatmap" and heat.showscale is False
    legend = [t.name for t in fig.data[1:]]
    assert sorted(legend) == sorted(label for _, label, _ in dash_plan.MASK_STATES) and len(legend) == 3
    assert fig.layout.xaxis.title.text.startswith("blocks in model order")
    assert fig.layout.yaxis.title.text == "expert" and list(heat.y) == E
    texts = list(fig.layout.xaxis.ticktext)
    assert texts[0] == "embed" and "layer 0" in texts and "layer 1" in texts
    vals = list(fig.layout.xaxis.tickvals)
    assert vals[0] == mask.columns[0] and all(v in set(mask.columns) for v in vals)
    assert dash_figures.group_ticks(["model.layers.2.x#0..model.layers.3.y#1", "model.layers.3.y#2..lm_head.weight#0"]) == (
        ["model.layers.2.x#0..model.layers.3.y#1", "model.layers.3.y#2..lm_head.weight#0"], ["layer 2", "layer 3"])


def test_top_tensors_and_difference():
    df = pd.DataFrame({"tensor": ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                  "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"],
                       "estimated": [100, 4096, 50, 0], "realized": [150, 4096, 10, 20]})
    top, n = views.top_tensors(df, 2, "bytes")
    assert n == 4 and top["tensor"].tolist() == ["model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    top, n = views.top_tensors(df, 3, "|difference|")
    assert top["tensor"].tolist()[:2] == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    assert top["difference"].tolist()[:2] == [50, -40] and top["ratio"].tolist()[:2] == pytest.approx([1.5, 0.2])
    top, n = views.top_tensors(df, 10, "bytes", "LAYERS.1 mlp")
    assert n == 1 and top["tensor"].tolist() == ["model.layers.1.mlp.up_proj.weight"]
    assert views.top_tensors(df, 10, "bytes", "nothing")[1] == 0
    with pytest.raises(ValueError):
        views.top_tensors(df, 5, "name")
    d = dash_snapshots.with_difference(df)
    assert np.isnan(d.loc[3, "ratio"]) and d.loc[3, "difference"] == 20  # nothing estimated: no ratio
    table = views.bytes_table(d)
    assert table.loc[0].tolist() == ["model.layers.0.mlp.up_proj.weight", "100 B", "150 B", "+50 B", "1.500x"]
    assert table.loc[2, "difference"] == "-40 B" and table.loc[3, "ratio"] == "-"
    fig = views.bytes_bars(d, "tensor")
    assert [t.orientation for t in fig.data] == ["h", "h"] and list(fig.data[1].y) == d["tensor"].tolist()
    assert fig.data[1].text[0] == "+50 B (1.50x)" and fig.layout.height >= 90 + 34 * 4
    assert dash_snapshots.signed_bytes(-1536) == "-1.50 KiB" and dash_snapshots.signed_bytes(0) == "0 B"


def test_url_replacements():
    ranges = {"budget": (0, 100), "density": (0.01, 1.0)}
    msgs = views.url_replacements({"budget": "500", "density": "7", "op": "ties", "lam": "1.0"},
                                  {"budget": 25, "density": 0.5, "op": "ties", "lam": 1.0}, ranges)
    assert msgs == ["URL parameter budget=500 is outside 0 to 100; replaced by 25.",
                    "URL parameter density=7 is outside 0.01 to 1; replaced by 0.5."]
    assert views.url_replacements({"op": "nope"}, {"op": "linear"}) == [
        "URL parameter op=nope is not one of the choices; replaced by linear."]
    assert views.url_replacements({"budget": "abc"}, {"budget": 25}, ranges) == [
        "URL parameter budget=abc is not a number; replaced by 25."]
    assert views.url_replacements({"budget": "40", "other": "x"}, {"budget": 40}, ranges) == []


def test_plan_wording_and_experts_table(built):
    c = Catalog(built.db)
    try:
        plan = dash_plan.make_plan(views.plan_context(c, "base", E, "ties", density=0.3), 50)
        size = sum(c.model(e)["bytes"] for e in E)
    finally:
        c.close()
    s = views.plan_summary(plan, size)
    assert s["full_text"] == (f"{views.fmt_bytes(plan['full_expert_bytes'])} changed (delta != 0) expert bytes of "
                              f"{views.fmt_bytes(size)} expert size")
    assert s["bound_why"] is None and plan["error_bound"]["kind"] == "sparsified"  # TIES has a (loose) bound now
    assert dash_formatting.fmt_bound(None, "ties").startswith("n/a: ties is not additive")
    t = views.plan_experts_table(plan)
    assert "read_text" not in t.columns and t["read"].tolist() == [
        views.fmt_bytes(plan["expert_read_by_expert"][e]) for e in E]
    fig = dash_plan.frontier_figure(dash_plan.frontier_df(views.plan_context(Catalog(built.db), "base", E, "linear")),
                                10, 0.5, True, "linear")
    assert fig.layout.margin.t >= 60 and fig.layout.title.yanchor == "top"


def test_group_ticks_skip_crowded_groups():
    cols = [f"model.layers.0.x#{i}" for i in range(80)] + ["model.norm.weight#0", "lm_head.weight#0"]
    assert dash_figures.group_ticks(cols)[1] == ["layer 0", "other, head"]  # head starts 1 column after other: one tick
    assert dash_figures.group_ticks(cols, min_gap=1)[1] == ["layer 0", "other", "head"]


@pytest.fixture(scope="module")
def two(built, tmp_path_factory):
    """The built catalog plus a second snapshot: ties, 60 %, merged from merged-1 and two experts."""
    from mergepipe.api import merge
    root = tmp_path_factory.mktemp("two")
    db = copy_catalog(built.db, root / "c.sqlite")
    c = Catalog(db)
    try:
        _, sid, _ = merge(c, "base", ["expert_1", "expert_2", "merged-1"], root / "m2", operator="ties",
                          model_id="merged-2", density=0.5, budget="60%")
    finally:
        c.close()
    return db, built.snapshot_id, sid


def test_compare_two_snapshots(two):
    db, s1, s2 = two
    c = Catalog(db)
    try:
        a, b = dash_snapshots.load_manifest(c, s1), dash_snapshots.load_manifest(c, s2)
    finally:
        c.close()
    d = views.settings_diff(a, b)
    row = d.set_index("field")
    assert row.at["operator", "A"] == "linear" and row.at["operator", "B"] == "ties" and row.at["operator", "same"] == "no"
    assert row.at["base", "same"] == "yes" and "merged-1" in row.at["experts", "B"]
    only = views.settings_diff(a, b, only_different=True)
    assert "base" not in only["field"].tolist() and "operator" in only["field"].tolist()
    n = views.numbers_df(a, b).set_index("quantity")
    assert n.at["expert read (realized)", "A"] == views.fmt_bytes(a.core["realized"]["expert_read"])
    assert n.at["error bound", "B"] == "n/a (ties is not additive)"
    assert n.at["error bound", "A"].startswith(f"{a.core['error_bound']['absolute']:.4g}")
    acc = views.access_diff(a, b)
    assert set(acc.columns) == {"tensor", "A", "B", "both", "only A", "only B"}
    assert (acc["A"] == acc["both"] + acc["only A"]).all() and (acc["B"] == acc["both"] + acc["only B"]).all()
    total_a = sum(hi - lo for ts in a.core["touched"].values() for rs in ts.values() for lo, hi in rs)
    assert acc["A"].sum() == total_a
    k = (acc["only A"] + acc["only B"]).tolist()
    assert k == sorted(k, reverse=True)
    fig = views.access_figure(acc, top=5)
    assert [t.name for t in fig.data] == ["both", "only A", "only B"] and len(fig.data[0].y) == min(5, len(acc))
    notes = views.lineage_note(a, b)
    assert notes[0] == "B (merged-2) was merged from A (merged-1)."
    assert "Shared inputs: base, expert_1, expert_2." in notes and "Only A: expert_3." in notes
