"""Unit tests of mergepipe.dashboard.views (everything the dashboard shows), on a real catalog built from a tiny
family (3 experts, fp32, 4 KiB grid) with one budgeted merge. No browser, no Streamlit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from dashboard_helpers import BLOCK_BYTES, EXPERTS, copy_catalog
from mergepipe.dashboard import server as dashboard, views
from mergepipe.dashboard import catalog as dash_catalog
from mergepipe.dashboard import figures as dash_figures
from mergepipe.dashboard import formatting as dash_formatting
from mergepipe.dashboard import paths as dash_paths
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import runs as dash_runs
from mergepipe.dashboard import snapshots as dash_snapshots
from mergepipe.api import plan_merge
from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError, MergePipeError, PlanError
from mergepipe.manifest.verify import verify
from mergepipe.planner.plan import load_plan
from mergepipe.catalog.models import register
from mergepipe.catalog.sketch import conflict_rate, cosine

E = list(EXPERTS)


@pytest.fixture(scope="module")
def cat(built):
    c = Catalog(built.db)
    yield c
    c.close()


@pytest.fixture(scope="module")
def ctx(cat):
    return views.plan_context(cat, "base", E, "linear")


@pytest.fixture
def cat_copy(built, tmp_path):
    c = Catalog(copy_catalog(built.db, tmp_path / "copy.sqlite"))
    yield c
    c.close()


# --- formatting -------------------------------------------------------------------------------------
def test_formatting():
    assert views.fmt_bytes(0) == "0 B"
    assert views.fmt_bytes(1023) == "1023 B"
    assert views.fmt_bytes(1536) == "1.50 KiB"
    assert views.fmt_bytes(3 << 20) == "3.00 MiB"
    assert views.fmt_bytes(None) == "-"
    assert dash_formatting.fmt_pct(0.253) == "25.3%"
    assert dash_formatting.fmt_pct(None) == "-"
    assert dash_formatting.fmt_bound(None) == "n/a (not an additive operator)"
    assert dash_formatting.fmt_bound({"absolute": 0.5, "relative": 0.25, "full_delta_norm": 2.0}) == "0.5 (relative 0.25)"
    assert dash_formatting.fmt_seconds(12.4) == "12 s"
    assert dash_formatting.fmt_seconds(75) == "1 min 15 s"
    assert dash_formatting.fmt_seconds(3 * 3600 + 125) == "3 h 02 min"
    assert dash_formatting.fmt_seconds(None) == "-"
    assert views.short_fp("sha256:0123456789abcdef") == "0123456789ab"
    assert views.short_fp(None) == "-"


# --- paths --------------------------------------------------------------------------------------------
def test_db_path_and_allowed_roots(tmp_path):
    assert views.db_path({"MERGEPIPE_DB": str(tmp_path / "x.sqlite")}) == tmp_path / "x.sqlite"
    assert views.db_path({}) == Path.cwd() / "mergepipe.sqlite"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    env = {"MERGEPIPE_ALLOWED_ROOTS": os.pathsep.join([str(a), str(b), str(a)])}
    assert views.allowed_roots(tmp_path / "db.sqlite", env) == [a.resolve(), b.resolve()]
    roots = views.allowed_roots(b / "db.sqlite", {}, cwd=a)
    assert roots == [a.resolve(), b.resolve()]
    assert views.allowed_roots(a / "db.sqlite", {}, cwd=a) == [a.resolve()]


def test_check_path(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ckpt").mkdir(parents=True)
    outside.mkdir()
    roots = [root.resolve()]
    assert views.check_path(str(root / "ckpt"), roots) == (root / "ckpt").resolve()
    assert views.check_path(f"  {root / 'ckpt'}  ", roots) == (root / "ckpt").resolve()
    with pytest.raises(MergePipeError, match="outside the allowed folders"):
        views.check_path(str(outside), roots)
    with pytest.raises(MergePipeError, match="outside the allowed folders"):
        views.check_path(str(root / ".." / "outside"), roots)
    (root / "escape").symlink_to(outside)
    with pytest.raises(MergePipeError, match="outside the allowed folders"):
        views.check_path(str(root / "escape"), roots)
    with pytest.raises(MergePipeError, match="does not exist"):
        views.check_path(str(root / "missing"), roots)
    with pytest.raises(MergePipeError, match="enter a path"):
        views.check_path("  ", roots)
    with pytest.raises(MergePipeError, match="NUL"):
        views.check_path("a\x00b", roots)


def test_check_out_path(tmp_path):
    root = tmp_path / "root"
    (root / "exists").mkdir(parents=True)
    roots = [root.resolve()]
    assert views.check_out_path(str(root / "new" / "deeper"), roots) == (root / "new" / "deeper").resolve()
    with pytest.raises(MergePipeError, match="already exists"):
        views.check_out_path(str(root / "exists"), roots)
    with pytest.raises(MergePipeError, match="outside the allowed folders"):
        views.check_out_path(str(tmp_path / "elsewhere"), roots)
    (root / "file").write_text("x")
    with pytest.raises(MergePipeError, match="not a directory"):
        views.check_out_path(str(root / "file" / "out"), roots)


def test_log_dir_and_default_out(tmp_path):
    assert views.log_dir(tmp_path / "cat.sqlite") == tmp_path / "cat-logs"
    assert dash_paths.default_out(tmp_path / "cat.sqlite", "plan-0123456789abcdef", 3) == tmp_path / "merged" / "merge-01234567-3"


# --- models ---------------------------------------------------------------------------------------------
def test_models_df(cat, built):
    df = views.models_df(cat)
    assert df["id"].tolist() == ["base", *E, "merged-1"]
    assert df.set_index("id")["role"].to_dict() == {"base": "base", "expert_1": "expert", "expert_2": "expert",
                                                    "expert_3": "expert", "merged-1": "snapshot"}
    assert df.set_index("id")["analyzed"].to_dict() == {"base": "-", "expert_1": "yes", "expert_2": "yes",
                                                        "expert_3": "yes", "merged-1": "no"}
    # tiny fp32 family: 106816 parameters of 4 bytes
    assert set(df["params"]) == {106816}
    assert set(df["bytes"]) == {427264}
    assert set(df["size"]) == {"417.25 KiB"}
    assert df.loc[df["id"] == "expert_2", "base"].item() == "base"
    assert df.loc[df["id"] == "base", "fingerprint"].item() == cat.model("base")["fingerprint"][7:19]


def test_model_details(cat, built):
    d = views.model_details(cat, "merged-1")
    assert d["role"] == "snapshot"
    assert {p["parent_id"]: p["role"] for p in d["parents"]} == {"base": "base", **{e: "expert" for e in E}}
    assert d["config"]["model_type"] == "llama"
    summary = dict(zip(d["summary"]["field"], d["summary"]["value"]))
    assert summary["snapshot"] == built.snapshot_id
    assert summary["size"] == "417.25 KiB"
    e1 = views.model_details(cat, "expert_1")
    assert e1["analyzed"] is True and e1["children"] == ["merged-1"]
    assert dict(zip(e1["summary"]["field"], e1["summary"]["value"]))["analyzed"].startswith("yes (109 blocks of 4.00 KiB")
    with pytest.raises(CatalogError, match="unknown model id"):
        views.model_details(cat, "nope")


def test_model_lists(cat_copy, built):
    assert views.bases(cat_copy) == ["base"]
    assert views.experts_of(cat_copy, "base") == [*E, "merged-1"]
    assert views.analyzed_experts(cat_copy, "base") == E
    assert views.unanalyzed_experts(cat_copy) == []
    register(cat_copy, "fresh", str(built.family / "expert_1"), base_id="base")
    assert views.unanalyzed_experts(cat_copy) == ["fresh"]
    assert views.totals(cat_copy)["models"] == 6
    assert views.totals(cat_copy)["model_size"] == views.fmt_bytes(6 * 427264)


def test_stats_version_ignores_run_progress(cat_copy, built):
    v0 = views.stats_version(cat_copy)
    c0 = cat_copy.change_counter()
    with cat_copy.transaction():
        cat_copy.conn.execute("INSERT INTO runs (kind, status, blocks_done) VALUES ('merge', 'running', 3)")
    assert cat_copy.change_counter() > c0
    assert views.stats_version(cat_copy) == v0
    register(cat_copy, "fresh", str(built.family / "expert_2"), base_id="base")
    assert views.stats_version(cat_copy) != v0


# --- runs -------------------------------------------------------------------------------------------------
def _run(**kw):
    row = {"id": 7, "kind": "merge", "status": "running", "pid": os.getpid(), "model_id": "m", "plan_id": "plan-x",
           "out": "/tmp/o", "blocks_done": 5, "blocks_total": 20, "expert_bytes_done": 2048,
           "expert_bytes_planned": 8192, "started_at": "2026-01-01T00:00:00Z", "finished_at": None,
           "snapshot_id": None, "error": None, "log_path": None}
    row.update(kw)
    return row


def test_run_progress():
    t0 = dash_runs._parse_ts("2026-01-01T00:00:00Z")
    p = views.run_progress(_run(), now_ts=t0 + 65)
    assert p["status"] == "running" and p["running"]
    assert p["fraction"] == 0.25
    assert p["text"] == "5/20 blocks"
    assert p["detail"] == "expert read 2.00 KiB of 8.00 KiB planned"
    assert p["elapsed"] == 65 and p["elapsed_text"] == "1 min 05 s"
    done = views.run_progress(_run(status="succeeded", blocks_done=20, finished_at="2026-01-01T00:00:09Z",
                                   snapshot_id="snap-1"), now_ts=t0 + 999)
    assert done["fraction"] == 1.0 and done["elapsed"] == 9 and not done["running"] and done["snapshot_id"] == "snap-1"
    an = views.run_progress(_run(kind="analyze", model_id="a,b", blocks_done=1500, blocks_total=2000), now_ts=t0)
    assert an["fraction"] == 0.75
    assert an["text"] == "analyze a,b: 75% (2 models)"
    # a running row whose process is gone is reported as failed
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert views.run_progress(_run(pid=dead.pid), now_ts=t0)["status"] == "failed"
    assert views.run_progress(_run(blocks_total=0, status="queued", pid=None), now_ts=t0)["text"] == "starting..."


def test_runs_df(cat_copy):
    with cat_copy.transaction():
        for kind, status in [("merge", "succeeded"), ("analyze", "failed"), ("merge", "cancelled")]:
            cat_copy.conn.execute(
                "INSERT INTO runs (kind, status, model_id, blocks_done, blocks_total, started_at, finished_at) "
                "VALUES (?, ?, 'm', 2, 4, '2026-01-01T00:00:00Z', '2026-01-01T00:00:03Z')", [kind, status])
    df = views.runs_df(cat_copy)
    assert df["kind"].tolist() == ["merge", "analyze", "merge"]
    assert df["status"].tolist() == ["cancelled", "failed", "succeeded"]
    assert df["progress"].tolist() == [50.0, 50.0, 100.0]
    assert df["elapsed"].tolist() == ["3 s"] * 3
    assert views.runs_df(cat_copy, kind="analyze")["status"].tolist() == ["failed"]
    assert views.latest_run(cat_copy, "merge")["status"] == "cancelled"
    assert views.latest_run(cat_copy, "nothing") is None


# --- layout, groups, aggregation ---------------------------------------------------------------------------
def test_groups_and_order():
    assert dash_figures.layer_of("model.layers.12.mlp.up_proj.weight") == 12
    assert dash_figures.layer_of("model.embed_tokens.weight") is None
    assert dash_figures.group_of("model.layers.3.self_attn.q_proj.weight") == "layer 3"
    assert dash_figures.group_of("model.embed_tokens.weight") == "embed"
    assert dash_figures.group_of("lm_head.weight") == "head"
    assert dash_figures.group_of("model.norm.weight") == "other"
    names = ["lm_head.weight", "model.layers.10.x", "model.norm.weight", "model.layers.2.x", "model.embed_tokens.weight"]
    assert sorted(names, key=dash_figures.tensor_sort_key) == ["model.embed_tokens.weight", "model.layers.2.x",
                                                       "model.layers.10.x", "model.norm.weight", "lm_head.weight"]


def test_block_layout(cat, built):
    lay = views.block_layout(cat, "base")
    plan = load_plan(cat, built.plan_id)
    assert int(lay["blocks"].sum()) == plan["blocks_total"] == 109
    assert lay["first"].tolist() == [0, *np.cumsum(lay["blocks"]).tolist()[:-1]]
    assert lay["tensor"].iloc[0] == "model.embed_tokens.weight" and lay["tensor"].iloc[-1] == "lm_head.weight"
    # the grid: 4 KiB of fp32 rows of 64 -> 16 rows per block
    assert lay.set_index("tensor").at["model.embed_tokens.weight", "blocks"] == 256 // 16
    assert views.groups(lay) == ["embed", "layer 0", "layer 1", "other", "head"]
    assert len(views.tensors_in_group(lay, "layer 0")) == 9
    assert views.block_layout(cat, "base", 1 << 20)["blocks"].tolist() == [1] * 21
    with pytest.raises(CatalogError, match="no block grid"):
        views.block_layout(cat, "expert_1")


def test_aggregate():
    m = pd.DataFrame(np.arange(12, dtype=float).reshape(2, 6), index=["a", "b"], columns=list("uvwxyz"))
    assert dash_figures.aggregate(m, 12) is m
    assert dash_figures.aggregate(m, 6, axis=1).columns.tolist() == ["u..v", "w..x", "y..z"]
    mean = dash_figures.aggregate(m, 4, axis=1, how="mean")
    assert mean.columns.tolist() == ["u..w", "x..z"]
    assert mean.to_numpy().tolist() == [[1.0, 4.0], [7.0, 10.0]]
    assert dash_figures.aggregate(m, 4, axis=1, how="max").to_numpy().tolist() == [[2.0, 5.0], [8.0, 11.0]]
    assert dash_figures.aggregate(m, 4, axis=1, how="sum").to_numpy().tolist() == [[3.0, 12.0], [21.0, 30.0]]
    l2 = dash_figures.aggregate(m, 4, axis=1, how="l2")
    assert l2.iloc[0, 0] == pytest.approx(math.sqrt(0 + 1 + 4))
    rows = dash_figures.aggregate(m.T, 4, axis=0, how="mean")
    assert rows.index.tolist() == ["u..w", "x..z"] and rows.columns.tolist() == ["a", "b"]
    with pytest.raises(ValueError):
        dash_figures.aggregate(m, 2, how="median")


def test_heatmap_figure_clickable():
    m = pd.DataFrame([[1.0, 2.0], [3.0, 4.0]], index=["r1", "r2"], columns=["c1", "c2"])
    fig = views.heatmap_figure(m, "t", "v", clickable=True)
    assert isinstance(fig.data[0], go.Heatmap) and np.asarray(fig.data[0].z).tolist() == [[1, 2], [3, 4]]
    overlay = fig.data[1]
    assert overlay.marker.opacity == 0
    assert [list(c) for c in overlay.customdata] == [["r1", "c1", 1.0], ["r1", "c2", 2.0], ["r2", "c1", 3.0],
                                                     ["r2", "c2", 4.0]]
    assert fig.data[0].hoverinfo == "skip" and overlay.hoverinfo is None  # the overlay must get click events
    assert len(views.heatmap_figure(m, "t", "v").data) == 1


# --- catalog statistics ------------------------------------------------------------------------------------
def test_tensor_stats_df(cat):
    df = views.tensor_stats_df(cat, E)
    assert len(df) == 21 * 3
    ref = cat.tensor_stats("expert_2")
    row = df[(df["expert"] == "expert_2") & (df["tensor"] == "model.layers.1.mlp.up_proj.weight")].iloc[0]
    st = ref["model.layers.1.mlp.up_proj.weight"]
    assert row["delta_l2"] == st["delta_l2"] and row["delta_nnz"] == st["delta_nnz"]
    assert row["density"] == pytest.approx(st["delta_nnz"] / st["numel"])
    assert row["group"] == "layer 1"
    assert df["tensor"].iloc[0] == "model.embed_tokens.weight" and df["expert"].tolist()[:3] == E
    assert views.tensor_stats_df(cat, []).empty


def test_block_stats_df(cat):
    df = views.block_stats_df(cat, E)
    assert len(df) == 327
    t = "model.layers.0.mlp.gate_proj.weight"
    sub = views.block_stats_df(cat, ["expert_3"], [t])
    ref = cat.blocks("expert_3", t)
    assert sub["block"].tolist() == [r["block"] for r in ref] == list(range(8))
    assert sub["delta_l2"].tolist() == [r["delta_l2"] for r in ref]
    assert views.block_stats_df(cat, E, []).empty


def test_norm_matrix(cat):
    ts = views.tensor_stats_df(cat, E)
    layer = views.norm_matrix(ts, "layer", E)
    assert layer.index.tolist() == ["embed", "layer 0", "layer 1", "other", "head"]
    assert layer.columns.tolist() == E
    stats = cat.tensor_stats("expert_1")
    want = math.sqrt(sum(s["delta_l2"] ** 2 for n, s in stats.items() if ".layers.1." in n))
    assert layer.at["layer 1", "expert_1"] == pytest.approx(want)
    tensor = views.norm_matrix(ts, "tensor", E)
    assert tensor.shape == (21, 3)
    assert tensor.at["lm_head.weight", "expert_2"] == pytest.approx(cat.tensor_stats("expert_2")["lm_head.weight"]["delta_l2"])
    bs = views.block_stats_df(cat, E)
    block = views.norm_matrix(bs, "block", E)
    assert block.shape == (109, 3)
    b = cat.blocks("expert_3", "model.layers.1.self_attn.q_proj.weight")[2]
    assert block.at["model.layers.1.self_attn.q_proj.weight#2", "expert_3"] == pytest.approx(b["delta_l2"])
    agg = views.norm_matrix(bs, "block", E, max_cells=60)
    assert agg.shape[0] <= 20 and agg.shape[1] == 3
    # norms combine as sqrt of sums of squares: the column norm is unchanged by aggregation
    assert np.sqrt((agg ** 2).sum()).to_numpy() == pytest.approx(np.sqrt((block ** 2).sum()).to_numpy())
    # block-level norms agree with the per-tensor ones
    assert np.sqrt((block ** 2).sum()).to_numpy() == pytest.approx(np.sqrt((tensor ** 2).sum()).to_numpy(), rel=1e-5)
    assert views.norm_matrix(ts.iloc[0:0], "tensor", E).empty
    with pytest.raises(ValueError):
        views.norm_matrix(ts, "block", E)
    fig = views.norm_heatmap(layer, "layer")
    assert len(fig.data) == 2 and np.asarray(fig.data[0].z).shape == (5, 3)


def test_sketches_and_conflicts(cat):
    tensors = views.tensors_in_group(views.block_layout(cat, "base"), "layer 0")
    mat = dash_catalog.sketch_matrix(cat, E, tensors)
    n_blocks = sum(len(cat.blocks("expert_1", t)) for t in tensors)
    size = cat.analysis("expert_1")["sketch_size"]
    # 4 KiB fp32 blocks hold 1024 elements: every element is sampled
    assert mat.shape == (3, n_blocks * min(size, BLOCK_BYTES // 4))
    conflict = views.conflict_matrix(cat, E, tensors, "conflict")
    cos = views.conflict_matrix(cat, E, tensors, "cosine")
    for i in range(3):
        for j in range(3):
            assert conflict.iat[i, j] == pytest.approx(conflict_rate(mat[i], mat[j]), abs=1e-9)
            assert cos.iat[i, j] == pytest.approx(cosine(mat[i], mat[j]), abs=1e-6)
    assert np.allclose(np.diag(conflict), 0) and np.allclose(np.diag(cos), 1)
    assert conflict.equals(conflict.T)
    assert ((conflict.to_numpy() >= 0) & (conflict.to_numpy() <= 1)).all()
    assert 0.1 < conflict.at["expert_1", "expert_2"] < 0.9
    assert dash_catalog.sketch_matrix(cat, E, []).shape == (3, 0)
    assert dash_catalog.pairwise(np.zeros((2, 4)), "conflict").tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError):
        dash_catalog.pairwise(mat, "jaccard")
    fig = views.conflict_heatmap(conflict, "conflict", "layer 0")
    assert fig.data[0].zmin == 0 and fig.data[0].zmax == 1
    assert views.conflict_heatmap(cos, "cosine", "layer 0").data[0].zmin == -1


# --- plans --------------------------------------------------------------------------------------------------
def test_op_info():
    assert set(views.operators()) >= {"linear", "task_arithmetic", "ties", "dare_ties", "della"}
    assert views.op_info("linear")["additive"] and not views.op_info("linear")["uses_density"]
    ties = views.op_info("TIES")
    assert ties["name"] == "ties" and ties["uses_density"] and not ties["additive"] and ties["normalize"]
    assert views.op_info("breadcrumbs")["extra"] == {"gamma": 0.01}
    with pytest.raises(PlanError, match="unknown operator"):
        views.op_info("nope")


def test_make_plan_matches_planner(cat, ctx):
    plan = dash_plan.make_plan(ctx, budget_pct=25)
    ref = plan_merge(cat, "base", E, "linear", budget="25%", save=False)
    assert plan.id == ref.id
    assert plan["estimate"]["expert_read"] <= plan["budget"]["bytes"] == int(0.25 * ctx.candidates.full_bytes)
    more = dash_plan.make_plan(ctx, budget_pct=26)
    assert more["estimate"]["expert_read"] > plan["estimate"]["expert_read"]
    with pytest.raises(PlanError, match="must be positive"):
        dash_plan.make_plan(ctx, budget_pct=0)
    with pytest.raises(PlanError, match="give a budget"):
        dash_plan.make_plan(ctx)
    tgt = dash_plan.make_plan(ctx, target_rel=1.0)
    # the target is met by the headline (blockwise) bound, the smallest greedy budget that meets it
    assert tgt["budget"]["bytes"] == ctx.smallest_budget_for(1.0 * ctx.full_norm_estimate())
    assert tgt["error_bound"]["relative"] <= 1.0


def test_plan_context_errors(cat_copy, built):
    with pytest.raises(PlanError, match="choose at least one expert"):
        views.plan_context(cat_copy, "base", [], "linear")
    register(cat_copy, "raw", str(built.family / "expert_3"), base_id="base")
    # not an error any more: a first merge, which analyzes "raw" on the way
    plan = dash_plan.make_plan(views.plan_context(cat_copy, "base", ["expert_1", "raw"], "linear"), budget_pct=25)
    note = views.plan_summary(plan)["first_merge"]
    assert note.startswith("First merge: raw (not analyzed).") and "the 25% budget applies from the next merge" in note
    assert views.plan_summary(dash_plan.make_plan(views.plan_context(cat_copy, "base", ["expert_1"], "linear"),
                                              budget_pct=25))["first_merge"] is None


def test_plan_summary(ctx):
    plan = dash_plan.make_plan(ctx, budget_pct=25)
    s = views.plan_summary(plan)
    p = plan.data
    assert s["expert_read"] == views.fmt_bytes(p["estimate"]["expert_read"])
    assert s["base_read"] == s["write"] == "417.25 KiB"
    assert s["budget"] == f"{views.fmt_bytes(p['budget']['bytes'])} (25%)"
    assert s["expert_read_pct"] == dash_formatting.fmt_pct(p["estimate"]["expert_read"] / p["full_expert_bytes"])
    assert s["blocks_selected"] == plan.selected_blocks
    assert s["blocks_candidate"] == len(ctx.candidates.expert)
    assert s["blocks"] == f"{plan.selected_blocks} of {len(ctx.candidates.expert)} candidate blocks (109 per model)"
    assert s["bound_abs"] == p["error_bound"]["absolute"]
    assert s["bound"] == dash_formatting.fmt_bound(p["error_bound"])
    df = dash_plan.plan_experts_df(plan)
    assert df["expert"].tolist() == E
    assert df["read"].sum() == p["estimate"]["expert_read"] and df["blocks"].sum() == plan.selected_blocks


def test_mask_matrix(ctx):
    plan = dash_plan.make_plan(ctx, budget_pct=25)
    mask = dash_plan.mask_matrix(ctx, plan)
    assert mask.shape == (3, 109) and mask.index.tolist() == E
    v = mask.to_numpy()
    assert int((v == 1).sum()) == plan.selected_blocks
    assert int((v >= 0.5).sum()) == len(ctx.candidates.expert)
    # the embedding of expert_1 is frozen: no candidate there
    assert (mask.loc["expert_1", [c for c in mask.columns if c.startswith("model.embed_tokens")]] == 0).all()
    t, b = next((t, rs[0][0]) for t, rs in plan["access"]["expert_2"].items())
    assert mask.at["expert_2", f"{t}#{b}"] == 1
    more = dash_plan.mask_matrix(ctx, dash_plan.make_plan(ctx, budget_pct=60))
    assert int((more.to_numpy() == 1).sum()) > plan.selected_blocks
    agg = dash_plan.mask_matrix(ctx, plan, max_cells=30)
    assert agg.shape == (3, 10)
    assert agg.to_numpy().mean(axis=1) == pytest.approx(v[:, :110].mean(axis=1), rel=0.2)
    fig = dash_plan.mask_heatmap(mask)
    assert np.asarray(fig.data[0].z).shape == (3, 109)


def test_frontier(ctx):
    fr = dash_plan.frontier_df(ctx)
    total = float(ctx.candidates.bound_term.sum())
    norm = ctx.full_norm_estimate()
    assert fr["budget_bytes"].iloc[0] == 0 and fr["bound_abs"].iloc[0] == pytest.approx(total)
    assert fr["budget_pct"].iloc[-1] == pytest.approx(100) and fr["bound_abs"].iloc[-1] == pytest.approx(0, abs=1e-9)
    assert (np.diff(fr["bound_abs"]) <= 1e-12).all() and (np.diff(fr["budget_bytes"]) >= 0).all()
    assert fr["bound_rel"].tolist() == pytest.approx((fr["bound_abs"] / norm).tolist())
    plan = dash_plan.make_plan(ctx, budget_pct=25)
    # the frontier draws the additive bound (the sum of the left-out terms); the headline is the blockwise one
    assert dash_plan.omitted_term(ctx, plan) == pytest.approx(plan["error_bound"]["additive"])
    assert plan["error_bound"]["absolute"] == plan["error_bound"]["blockwise"] <= plan["error_bound"]["additive"]
    x, y = dash_plan.current_point(ctx, plan, relative=True)
    assert x == pytest.approx(100 * plan["estimate"]["expert_read"] / ctx.candidates.full_bytes)
    assert y == pytest.approx(plan["error_bound"]["additive_relative"])
    assert dash_plan.current_point(ctx, plan, relative=False)[1] == pytest.approx(plan["error_bound"]["additive"])
    fig = dash_plan.frontier_figure(fr, x, y, True, "linear")
    assert len(fig.data) == 2 and list(fig.data[1].x) == [x] and list(fig.data[1].y) == [y]
    assert fig.layout.yaxis.title.text == "relative error bound"


def test_frontier_non_additive(cat):
    ties = views.plan_context(cat, "base", E, "ties", density=0.3)
    fr = dash_plan.frontier_df(ties)
    assert fr["bound_rel"].isna().all()
    plan = dash_plan.make_plan(ties, budget_pct=50)
    assert plan["error_bound"]["kind"] == "sparsified"  # sound but loose (planner/bounds.py); not on the frontier
    x, y = dash_plan.current_point(ties, plan, relative=True)
    assert y == pytest.approx(dash_plan.omitted_term(ties, plan))
    fig = dash_plan.frontier_figure(fr, x, y, False, "ties")
    assert "not a bound for ties" in fig.layout.yaxis.title.text
    assert views.plan_summary(plan)["bound"] == dash_formatting.fmt_bound(plan["error_bound"], "ties")


def test_plans_df(cat, built):
    df = views.plans_df(cat)
    row = df[df["plan"] == built.plan_id].iloc[0]
    plan = load_plan(cat, built.plan_id)
    assert row["operator"] == "linear" and row["budget"] == "30%" and row["experts"] == ", ".join(E)
    assert row["expert_read"] == views.fmt_bytes(plan["estimate"]["expert_read"])
    assert row["bound"] == f"{plan['error_bound']['absolute']:.4g}"


# --- snapshots ------------------------------------------------------------------------------------------------
def test_snapshots_and_manifest(cat, built):
    df = views.snapshots_df(cat)
    assert df["snapshot"].tolist() == [built.snapshot_id] and df["model"].tolist() == ["merged-1"]
    man = dash_snapshots.load_manifest(cat, built.snapshot_id)
    s = dict(zip(*dash_snapshots.manifest_summary(man).T.values))
    assert s["snapshot"] == built.snapshot_id and s["plan"] == built.plan_id and s["operator"] == "linear"
    assert s["manifest hash"] == man.manifest_hash
    assert s["experts"] == "expert_1 (w=1), expert_2 (w=1), expert_3 (w=1)"
    assert s["grid"] == "4.00 KiB blocks"
    real = man.core["realized"]["expert_read"]
    assert s["expert read"].startswith(f"{views.fmt_bytes(real)} realized / {views.fmt_bytes(real)} estimated")
    by_e = dash_snapshots.bytes_by_expert_df(man)
    assert by_e["expert"].tolist() == E
    assert by_e["realized"].tolist() == [man.core["realized_by_expert"][e] for e in E]
    assert (by_e["estimated"] == by_e["realized"]).all()  # budget-sound: realized == planned
    plan = dash_snapshots.manifest_plan(cat, man)
    by_t = dash_snapshots.bytes_by_tensor_df(man, plan)
    assert by_t["realized"].sum() == real and (by_t["estimated"] == by_t["realized"]).all()
    assert dash_snapshots.bytes_by_tensor_df(man)["estimated"].isna().all()
    fig = dash_snapshots.bytes_figure(by_e, "expert")
    assert [t.name for t in fig.data] == ["estimated", "realized"]
    assert len(dash_snapshots.bytes_figure(dash_snapshots.bytes_by_tensor_df(man), "tensor").data) == 1
    touched = dash_snapshots.touched_matrix(cat, man)
    assert touched.shape == (3, 109) and int(touched.to_numpy().sum()) == plan.selected_blocks
    assert dash_snapshots.touched_matrix(cat, man, max_cells=30).shape == (3, 10)
    assert np.asarray(dash_snapshots.touched_heatmap(touched).data[0].z).shape == (3, 109)
    assert dash_snapshots.load_manifest(cat, "merged-1").snapshot_id == built.snapshot_id
    with pytest.raises(MergePipeError, match="unknown snapshot"):
        dash_snapshots.load_manifest(cat, "snap-nope")


def test_verify_text(cat, built):
    res = verify(cat, built.snapshot_id)
    assert views.verify_text(res) == f"OK: {built.snapshot_id}, {res['files_checked']} files checked"
    bad = dict(res, ok=False, problems=["model.safetensors: missing"])
    assert views.verify_text(bad).splitlines() == [f"MISMATCH: {built.snapshot_id}, {res['files_checked']} files checked",
                                                   "- model.safetensors: missing"]


# --- lineage ----------------------------------------------------------------------------------------------------
def test_lineage(cat, built):
    dot = views.lineage_dot(cat)
    assert dot.startswith("digraph lineage {")
    for e in E:
        assert f'"{e}" -> "merged-1" [label="expert w=1"];' in dot
    assert f'"merged-1" [label="merged-1\\n{built.snapshot_id}", shape=doubleoctagon];' in dot
    nodes = views.lineage_nodes_df(cat)
    assert nodes["node"].tolist() == ["base", *E, "merged-1"]
    assert nodes.set_index("node").at["merged-1", "kind"] == "snapshot"
    assert nodes.set_index("node").at["merged-1", "parents"] == "base (base), " + ", ".join(f"{e} (expert w=1)" for e in E)
    assert views.node_target(cat, "merged-1") == ("snapshot", built.snapshot_id)
    assert views.node_target(cat, "expert_2") == ("model", "expert_2")
    assert "merged-1" in views.lineage_dot(cat, "expert_1")


# --- the launcher ---------------------------------------------------------------------------------------------
def test_dashboard_command_and_env(tmp_path):
    cmd = dashboard.dashboard_command(8600)
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(cmd[4]) == dashboard.APP and dashboard.APP.name == "app.py" and dashboard.APP.exists()
    assert cmd[5:] == ["--server.port", "8600", "--server.address", "127.0.0.1", "--server.headless", "true"]
    env = dashboard.dashboard_env("rel.sqlite", [tmp_path / "a", tmp_path / "b"], base_env={"KEEP": "1"})
    assert env["MERGEPIPE_DB"] == str(Path("rel.sqlite").absolute())
    # no roots of the caller's: its working directory (also the catalog's folder) plus the extra ones
    assert env["MERGEPIPE_ALLOWED_ROOTS"] == os.pathsep.join([str(Path.cwd().resolve()), str(tmp_path / "a"),
                                                              str(tmp_path / "b")])
    assert env["KEEP"] == "1"
    assert dashboard.dashboard_env(tmp_path / "d" / "x.sqlite", None, base_env={})["MERGEPIPE_ALLOWED_ROOTS"] == \
        os.pathsep.join([str(Path.cwd().resolve()), str(tmp_path / "d")])


def test_dashboard_inherits_the_callers_allowed_roots(tmp_path):
    mine = os.pathsep.join([str(tmp_path / "models"), str(tmp_path / "out")])
    env = dashboard.dashboard_env(tmp_path / "x.sqlite", None, base_env={"MERGEPIPE_ALLOWED_ROOTS": mine})
    assert env["MERGEPIPE_ALLOWED_ROOTS"] == mine  # honoured, not replaced nor widened
    env = dashboard.dashboard_env(tmp_path / "x.sqlite", [tmp_path / "extra"], base_env={"MERGEPIPE_ALLOWED_ROOTS": mine})
    assert env["MERGEPIPE_ALLOWED_ROOTS"] == mine + os.pathsep + str(tmp_path / "extra")  # added only when asked
    out = subprocess.run([sys.executable, "-m", "mergepipe.cli", "dashboard", "--help"], capture_output=True, text=True)
    assert "--allow-root DIR" in out.stdout
    with pytest.raises(MergePipeError, match="bad port"):
        dashboard.run_dashboard(tmp_path / "x.sqlite", port=0)
    with pytest.raises(MergePipeError, match="does not exist"):
        dashboard.run_dashboard(tmp_path / "missing" / "x.sqlite", port=8600)


def test_views_never_import_streamlit():
    code = "import sys, mergepipe.dashboard.views, mergepipe.dashboard.server, mergepipe.cli; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_streamlit_config():
    import tomllib
    cfg = tomllib.loads((dashboard.APP.parent / ".streamlit" / "config.toml").read_text())
    assert cfg["server"] == {"address": "127.0.0.1", "allowedHosts": ["localhost", "127.0.0.1"],
                             "enableXsrfProtection": True, "maxUploadSize": 1, "fileWatcherType": "none",
                             "runOnSave": False}
    assert cfg["browser"] == {"gatherUsageStats": False}
    assert cfg["client"] == {"toolbarMode": "viewer", "showErrorDetails": "type"}
    assert json.dumps(cfg)  # plain data


# --- registration kinds and mergekit YAML on the Plan page -------------------------------------------------
def test_registration_base():
    assert views.REGISTER_KINDS == ("full", "delta", "lora")
    assert views.registration_base("full", None) is None and views.registration_base("full", "b") == "b"
    assert views.registration_base("lora", "base") == "base" and views.registration_base("delta", "base") == "base"
    with pytest.raises(MergePipeError, match="LoRA adapter needs a base"):
        views.registration_base("lora", None)
    with pytest.raises(MergePipeError, match="delta checkpoint needs a base"):
        views.registration_base("delta", "")
    with pytest.raises(MergePipeError, match="unknown kind"):
        views.registration_base("qlora", "base")


def _yaml(built, body: str) -> str:
    return f"base_model: {built.family / 'base'}\n" + body


def test_mergekit_plan_settings(cat, built, tmp_path):
    roots = [built.root.resolve()]
    text = _yaml(built, "merge_method: ties\nmodels:\n"
                        f"  - model: {built.family / 'expert_1'}\n    parameters: {{weight: 2, density: 0.3}}\n"
                        "  - model: expert_2\n    parameters: {weight: 1, density: 0.3}\n"
                        "parameters: {normalize: false, lambda: 0.5}\nmergepipe: {budget: 40%, seed: 4}\n")
    s = views.mergekit_plan_settings(cat, text, "m.yml", roots)
    assert s == {"base": "base", "experts": ["expert_1", "expert_2"], "op": "ties", "lam": 0.5, "normalize": "off",
                 "rescale": "default", "seed": 4, "strategy": "norm", "w_expert_1": 2.0, "w_expert_2": 1.0,
                 "density": 0.3, "mode": "budget", "budget": 40}
    # Defaults of the operator's extra parameter; a target bound; a fraction budget.
    s = views.mergekit_plan_settings(cat, _yaml(built, "merge_method: breadcrumbs\nmodels: [expert_3]\n"
                                                       "mergepipe: {budget: 0.25}\n"), "b.yml", roots)
    assert s["gamma"] == 0.01 and s["density"] == 1.0 and s["budget"] == 25 and s["experts"] == ["expert_3"]
    s = views.mergekit_plan_settings(cat, _yaml(built, "merge_method: linear\nmodels: [expert_1]\n"
                                                       "mergepipe: {target_bound: 0.3}\n"), "t.yml", roots)
    assert s["mode"] == "target bound" and s["target"] == 0.3 and "budget" not in s


@pytest.mark.parametrize("body, words", [
    (("merge_method: ties\nmodels:\n  - model: expert_1\n    parameters: {density: 0.3}\n"
      "  - model: expert_2\n    parameters: {density: 0.5}\n"), "densities differ"),
    ("merge_method: ties\nmodels: [expert_1]\nparameters: {density: 0.375}\n", "steps of 0.01"),
    ("merge_method: linear\nmodels: [expert_1]\nmergepipe: {budget: 512MiB}\n", "not a whole percentage"),
    ("merge_method: ties\nmodels: [expert_1]\nmergepipe: {target_bound: 0.1}\n", "additive"),
    ("merge_method: linear\nmodels: [expert_1]\nslices: []\n", "slices"),
    ("merge_method: passthrough\nslices:\n  - sources: [{model: FAMILY/base, layer_range: [0, 2]}]\n"
     "  - sources: [{model: FAMILY/base, layer_range: [1, 2]}]\n", "Plan page cannot show"),
    ("merge_method: slerp\nmodels: [expert_1]\n", "slerp"),
    ("merge_method: ties\nmodels: [expert_1]\nparameters: {density: [0.3, 0.5]}\n", "varies per tensor"),
    ("merge_method: linear\nmodels: [/etc]\n", "outside the allowed folders"),
    ("merge_method: linear\nmodels: [FAMILY/..]\n", "not registered in the catalog"),
])
def test_mergekit_plan_settings_refusals(cat, built, body, words):
    before = cat.totals()
    with pytest.raises(MergePipeError, match=words):
        views.mergekit_plan_settings(cat, _yaml(built, body.replace("FAMILY", str(built.family))), "m.yml",
                                     [built.root.resolve()])
    assert cat.totals() == before


def test_read_config_source(tmp_path):
    roots = [tmp_path.resolve()]
    assert views.read_config_source(b"x: 1", None, roots) == (b"x: 1", "uploaded config")
    assert views.read_config_source(b"x: 1", None, roots, "m.yml") == (b"x: 1", "m.yml")
    (tmp_path / "m.yml").write_text("merge_method: linear\n")
    assert views.read_config_source(None, str(tmp_path / "m.yml"), roots) == (b"merge_method: linear\n", "m.yml")
    with pytest.raises(MergePipeError, match="enter a path"):
        views.read_config_source(None, "", roots)
    with pytest.raises(MergePipeError, match="not a file"):
        views.read_config_source(None, str(tmp_path), roots)
    with pytest.raises(MergePipeError, match="outside the allowed folders"):
        views.read_config_source(None, "/etc/hostname", roots)
    (tmp_path / "big.yml").write_bytes(b"#" * (2 << 20))
    with pytest.raises(MergePipeError, match="too large"):
        views.read_config_source(None, str(tmp_path / "big.yml"), roots)
