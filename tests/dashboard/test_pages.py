"""AppTest tests of every dashboard page: widgets drive real catalog data (a tiny analyzed family with
one merge), and user errors show a message, never an exception."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from dashboard_helpers import EXPERTS, open_page, wait_until
from mergepipe.dashboard import views
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import snapshots as dash_snapshots
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.engine.runs import get_run

E = list(EXPERTS)


def metrics(at) -> dict:
    return {m.label: m.value for m in at.metric}


def arr(x) -> np.ndarray:
    """A Plotly JSON array: a list, or a typed array {'dtype', 'bdata' (base64), 'shape'}."""
    if isinstance(x, dict) and "bdata" in x:
        a = np.frombuffer(base64.b64decode(x["bdata"]), dtype=np.dtype(x["dtype"]))
        shape = x.get("shape")
        if shape:
            a = a.reshape([int(n) for n in str(shape).split(",")])
        return a.astype(float)
    return np.array(x, dtype=float)


def chart_spec(at, key: str) -> dict:
    for el in at.get("plotly_chart"):
        spec = json.loads(el.proto.spec)
        if el.proto.id and key in el.proto.id:
            return spec
    raise AssertionError(f"no chart {key}")


# Display-only tables have no widget id in AppTest: find them by a column only they have.
TABLE_COLUMN = {"home_snaps": "snapshot", "home_runs": "run", "model_summary": "field", "tensor_table": "numel",
                "block_table": "row_start", "conflict_table": "expert_1", "runs_table": "elapsed",
                "manifest_summary": "field", "node_summary": "field"}


def table(at, key: str):
    for el in at.dataframe:
        if getattr(el, "key", None) == key:
            return el.value
    col = TABLE_COLUMN[key]
    for el in at.dataframe:
        if col in el.value.columns:
            return el.value
    raise AssertionError(f"no table {key}")


def errors(at) -> list[str]:
    return [e.value for e in at.error]


def cat_of(env) -> Catalog:
    return Catalog(env["db"])


# --- home -------------------------------------------------------------------------------------------------
def test_home(env, built):
    at = open_page("home")
    m = metrics(at)
    assert m["Models"] == "5" and m["Experts analyzed"] == "3" and m["Blocks"] == "327"
    assert m["Model bytes"] == views.fmt_bytes(5 * 427264)
    assert m["Plans"] == "1" and m["Snapshots"] == "1" and m["Runs"] == "1"  # the merge, made outside a run
    snaps = table(at, "home_snaps")
    assert snaps["snapshot"].tolist() == [built.snapshot_id]
    assert at.title[0].value == "MergePipe"


def test_home_empty_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_DB", str(tmp_path / "empty.sqlite"))
    at = open_page("home")
    assert metrics(at)["Models"] == "0"
    assert any("catalog is empty" in i.value for i in at.info)
    for page in ("catalog", "plan", "run", "snapshots", "lineage"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception and at.info, page


@pytest.mark.parametrize("page", ["home", "models", "catalog", "plan", "run", "snapshots", "lineage"])
def test_bad_catalog_path_is_a_message(page, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_DB", str(tmp_path / "missing" / "catalog.sqlite"))
    at = open_page(page)
    assert any("directory does not exist" in e for e in errors(at)), errors(at)


# --- models ---------------------------------------------------------------------------------------------
def test_models_register_errors_and_success(env, built):
    at = open_page("models")
    assert table(at, "models_table")["id"].tolist() == ["base", *E, "merged-1"]
    at.text_input(key="reg_path").input("/etc")
    at.button[0].click().run()
    assert any("outside the allowed folders" in e for e in errors(at)) and not at.exception
    at.text_input(key="reg_path").input(str(built.root / "nope"))
    at.button[0].click().run()
    assert any("does not exist" in e for e in errors(at))
    # an id already registered with other content
    at.text_input(key="reg_path").input(str(built.family / "expert_2"))
    at.text_input(key="reg_id").input("expert_1")
    at.selectbox(key="reg_base").select("base")
    at.button[0].click().run()
    assert any("already registered with different content" in e for e in errors(at))
    at.text_input(key="reg_path").input(str(built.family / "expert_2"))
    at.text_input(key="reg_id").input("again2")
    at.selectbox(key="reg_base").select("base")
    at.button[0].click().run()
    assert any(s.value.startswith("registered: again2") for s in at.success), [s.value for s in at.success]
    df = table(at, "models_table")
    assert "again2" in df["id"].tolist()
    assert df.set_index("id").at["again2", "analyzed"] == "no"
    assert "again2" in at.multiselect(key="an_models").value


def test_models_analyze_with_progress(env, built):
    c = cat_of(env)
    register(c, "fresh", str(built.family / "expert_3"), base_id="base")
    at = open_page("models")
    assert at.multiselect(key="an_models").value == ["fresh"]
    assert at.number_input(key="an_kib").value == 4  # the base's grid
    at.button(key="analyze_btn").click().run()
    assert any("analyze run" in i.value for i in at.info), [i.value for i in at.info]
    run_id = views.latest_run(c, "analyze")["id"]
    wait_until(lambda: get_run(c, run_id)["status"] not in ("queued", "running"), timeout=90, what="analyze run")
    assert get_run(c, run_id)["status"] == "succeeded", get_run(c, run_id)
    assert c.is_analyzed("fresh")
    at.run()
    assert not at.exception
    texts = [p.proto.text for p in at.get("progress")]
    assert any("succeeded" in t and "100%" in t for t in texts), texts
    assert table(at, "models_table").set_index("id").at["fresh", "analyzed"] == "yes"
    c.close()


def test_models_analyze_nothing_selected(env):
    at = open_page("models")
    at.multiselect(key="an_models").set_value([])
    at.button(key="analyze_btn").click().run()
    assert "choose at least one expert to analyze" in errors(at)


def test_models_details_from_url(env, built):
    at = open_page("models", {"model": "merged-1"})
    assert at.selectbox(key="model").value == "merged-1"
    summary = dict(zip(*table(at, "model_summary").T.values))
    assert summary["snapshot"] == built.snapshot_id and summary["role"] == "snapshot"
    assert any("Parents: base (base)" in m.value for m in at.markdown)


# --- catalog --------------------------------------------------------------------------------------------
def test_catalog_views(env, built):
    at = open_page("catalog")
    assert at.selectbox(key="base").value == "base" and at.multiselect(key="experts").value == E
    spec = chart_spec(at, "norm_chart")
    z = arr(spec["data"][0]["z"])
    c = cat_of(env)
    want = views.norm_matrix(views.tensor_stats_df(c, E), "layer", E)
    assert z.shape == (5, 3) and np.allclose(z, want.to_numpy())
    assert spec["data"][1]["customdata"][0][:2] == ["embed", "expert_1"]  # clickable overlay

    at.radio(key="rows").set_value("block").run()
    assert arr(chart_spec(at, "norm_chart")["data"][0]["z"]).shape == (109, 3)

    at.radio(key="view").set_value("Tensors").run()
    assert len(table(at, "tensor_table")) == 63

    at.radio(key="view").set_value("Blocks").run()
    assert at.selectbox(key="layer").value == "layer 0"
    at.selectbox(key="layer").select("layer 1").run()
    blocks = table(at, "block_table")
    assert set(blocks["group"]) == {"layer 1"} and len(blocks) == 3 * 38
    assert arr(chart_spec(at, "block_chart")["data"][0]["z"]).shape == (38, 3)

    at.radio(key="view").set_value("Conflicts").run()
    assert at.radio(key="metric").value == "sign conflict" and at.selectbox(key="clayer").value == "layer 0"
    at.selectbox(key="clayer").select("layer 1").run()
    at.selectbox(key="clayer").select("layer 0").run()
    tensors = views.tensors_in_group(views.block_layout(c, "base"), "layer 0")
    got = table(at, "conflict_table")
    assert np.allclose(got.to_numpy(), views.conflict_matrix(c, E, tensors, "conflict").round(4).to_numpy())
    at.radio(key="metric").set_value("cosine").run()
    at.radio(key="scope").set_value("tensor").run()
    at.selectbox(key="ctensor").select("lm_head.weight").run()
    got = table(at, "conflict_table")
    assert np.allclose(got.to_numpy(), views.conflict_matrix(c, E, ["lm_head.weight"], "cosine").round(4).to_numpy())
    at.multiselect(key="experts").set_value(["expert_1"]).run()
    assert any("at least two experts" in w.value for w in at.warning)
    assert not at.exception
    c.close()


# --- plan -------------------------------------------------------------------------------------------------
def _mask_selected(at) -> int:
    z = arr(chart_spec(at, "mask_chart")["data"][0]["z"])
    return int((z == 1).sum())


def test_plan_slider_save_and_errors(env):
    at = open_page("plan")
    c = cat_of(env)
    ctx = views.plan_context(c, "base", E, "linear")
    assert at.slider(key="budget").value == 25
    s25 = views.plan_summary(dash_plan.make_plan(ctx, 25))
    assert metrics(at)["Estimated expert read"] == s25["expert_read"]
    assert metrics(at)["Base read"] == s25["base_read"] and metrics(at)["Error bound"] == f"{s25['bound_abs']:.4g}"
    assert _mask_selected(at) == s25["blocks_selected"]
    at.slider(key="budget").set_value(40).run()
    s40 = views.plan_summary(dash_plan.make_plan(ctx, 40))
    assert metrics(at)["Estimated expert read"] == s40["expert_read"] != s25["expert_read"]
    assert _mask_selected(at) == s40["blocks_selected"] > s25["blocks_selected"]
    frontier = chart_spec(at, "frontier_chart")
    # the frontier and its point draw the additive bound (the headline metric is the blockwise one)
    assert arr(frontier["data"][1]["y"])[0] == pytest.approx(
        dash_plan.make_plan(ctx, 40)["error_bound"]["additive_relative"])
    # budget 0 is a user error: a message, not a traceback
    at.slider(key="budget").set_value(0).run()
    assert any("must be positive" in e for e in errors(at)) and not at.exception
    at.slider(key="budget").set_value(40).run()
    at.button(key="save_plan").click().run()
    saved = [s.value for s in at.success]
    assert saved == [f"Saved {s40['plan_id']}."]
    assert s40["plan_id"] in views.plans_df(c)["plan"].tolist()
    c.close()


def test_plan_widgets_come_from_the_operator_declarations(env):
    """The Plan page draws each operator's declared parameters (ops/spec.py): label, range, default."""
    from mergepipe.api import operators
    at = open_page("plan")
    for spec in operators():
        at.selectbox(key="op").select(spec.name).run()
        assert not at.exception
        keys = {w.key for w in at.number_input} | {w.key for w in at.selectbox}
        for p in views.op_info(spec.name)["params"]:
            if p["place"] == "weights":
                assert all(f"w_{e}" in keys for e in at.multiselect(key="experts").value)
                continue
            assert p["key"] in keys, (spec.name, p["name"])
            if p["kind"] == "float":
                w = at.number_input(key=p["key"])
                assert (w.label, w.min, w.max) == (p["label"], p["min"], p["max"]), (spec.name, p["name"])
        extra = {"density", "gamma", "epsilon"} - {p.name for p in spec.parameters}
        assert not extra & keys, (spec.name, extra & keys)


def test_plan_operator_params_and_target(env):
    at = open_page("plan")
    at.selectbox(key="op").select("ties").run()
    assert at.number_input(key="density").value == 0.5
    c = cat_of(env)
    ties = views.plan_context(c, "base", E, "ties", density=0.5)
    # TIES has a sound, loose bound (planner/bounds.py: kind sparsified)
    assert metrics(at)["Error bound"] == f"{dash_plan.make_plan(ties, 25)['error_bound']['absolute']:.4g}"
    assert metrics(at)["Estimated expert read"] == views.plan_summary(dash_plan.make_plan(ties, 25))["expert_read"]
    at.selectbox(key="op").select("linear").run()
    at.radio(key="mode").set_value("target bound").run()
    at.number_input(key="target").set_value(1.0).run()
    ctx = views.plan_context(c, "base", E, "linear")
    want = views.plan_summary(dash_plan.make_plan(ctx, target_rel=1.0))
    assert [s.value for s in at.success] == [f"Smallest budget for a relative bound <= 1: {want['budget']}"]
    at.number_input(key="w_expert_1").set_value(3.0).run()
    weighted = views.plan_context(c, "base", E, "linear", weights=[3.0, 1.0, 1.0])
    assert metrics(at)["Estimated expert read"] == views.plan_summary(dash_plan.make_plan(weighted, target_rel=1.0))["expert_read"]
    c.close()


def test_plan_non_analyzed_expert_is_a_first_merge(env, built):
    c = cat_of(env)
    register(c, "raw", str(built.family / "expert_1"), base_id="base")
    c.close()
    at = open_page("plan")
    assert at.multiselect(key="experts").value == E
    at.multiselect(key="experts").select("raw").run()
    assert not errors(at) and not at.exception
    infos = [i.value for i in at.info]
    assert any(i.startswith("First merge: raw (not analyzed)") and "analyzes it on the way" in i for i in infos), infos
    c = cat_of(env)
    summary = views.plan_summary(dash_plan.make_plan(views.plan_context(c, "base", E + ["raw"], "linear"), budget_pct=25))
    c.close()
    assert summary["expert_read_bytes"] == summary["budget_bytes"]  # every expert read in full
    assert metrics(at)["Estimated expert read"] == summary["expert_read"]
    at.multiselect(key="experts").set_value([]).run()
    assert "choose at least one expert" in errors(at)


def test_plan_settings_from_url(env):
    at = open_page("plan", {"op": "task_arithmetic", "budget": "60", "lam": "0.5"})
    assert at.selectbox(key="op").value == "task_arithmetic"
    assert at.slider(key="budget").value == 60 and at.number_input(key="lam").value == 0.5
    c = cat_of(env)
    ctx = views.plan_context(c, "base", E, "task_arithmetic", lam=0.5)
    assert metrics(at)["Error bound"] == f"{views.plan_summary(dash_plan.make_plan(ctx, 60))['bound_abs']:.4g}"
    c.close()


# --- run ----------------------------------------------------------------------------------------------------
def test_run_launch_and_watch(env, built):
    at = open_page("run")
    assert at.selectbox(key="plan").value == built.plan_id
    out = at.text_input(key="out").value
    assert out.startswith(str(env["tmp"] / "merged" / "merge-"))
    at.text_input(key="out").input("/etc/merged")
    at.button(key="launch").click().run()
    assert any("outside the allowed folders" in e for e in errors(at))
    at.text_input(key="out").input(str(built.merged))
    at.button(key="launch").click().run()
    assert any("already exists" in e for e in errors(at))
    at.text_input(key="out").input(out)
    at.text_input(key="model_id").input("merged-1")
    at.button(key="launch").click().run()
    assert any("already registered" in e for e in errors(at))
    at.text_input(key="model_id").input("merged-2")
    at.button(key="launch").click().run()
    assert not errors(at) and not at.exception
    c = cat_of(env)
    run = views.latest_run(c, "merge")
    assert at.selectbox(key="run").value == str(run["id"])
    wait_until(lambda: get_run(c, run["id"])["status"] not in ("queued", "running"), timeout=90, what="merge run")
    at.run()
    done = get_run(c, run["id"])
    assert done["status"] == "succeeded", done
    assert [s.value for s in at.success] == [f"Published {done['snapshot_id']} as model merged-2 at {out}"]
    assert metrics(at)["Blocks"] == f"{done['blocks_total']}/{done['blocks_total']}"
    assert metrics(at)["Expert bytes read"] == views.fmt_bytes(done["expert_bytes_planned"])
    assert table(at, "runs_table")["status"].tolist() == ["succeeded"]
    assert "published" in at.code[-1].value
    assert done["snapshot_id"] in views.snapshots_df(c)["snapshot"].tolist()
    c.close()


def test_run_without_plans(tmp_path, monkeypatch, built):
    db = tmp_path / "c.sqlite"
    c = Catalog(db)
    register(c, "base", str(built.family / "base"))
    c.close()
    monkeypatch.setenv("MERGEPIPE_DB", str(db))
    at = open_page("run")
    assert any("No saved plans yet" in i.value for i in at.info)


# --- snapshots -------------------------------------------------------------------------------------------
def test_snapshots_manifest_and_verify(env, built):
    at = open_page("snapshots")
    assert at.selectbox(key="snapshot").value == built.snapshot_id
    summary = dict(zip(*table(at, "manifest_summary").T.values))
    assert summary["snapshot"] == built.snapshot_id and summary["model"] == "merged-1"
    c = cat_of(env)
    man = dash_snapshots.load_manifest(c, built.snapshot_id)
    bars = chart_spec(at, "bytes_expert")
    want = [man.core["realized_by_expert"][e] for e in E]
    assert bars["data"][0]["y"] == E  # horizontal bars: names on the y axis, bytes on x
    assert arr(bars["data"][0]["x"]).tolist() == arr(bars["data"][1]["x"]).tolist() == want
    touched = arr(chart_spec(at, "touched_chart")["data"][0]["z"])
    assert touched.shape == (3, 109) and int(touched.sum()) == dash_snapshots.manifest_plan(c, man).selected_blocks
    assert at.json[0].proto.body and json.loads(at.json[0].proto.body)["manifest_hash"] == man.manifest_hash
    at.button(key="verify").click().run()
    assert [s.value for s in at.success][0].startswith(f"OK: {built.snapshot_id}")
    c.close()


def test_snapshots_from_url_unknown_is_ignored(env, built):
    at = open_page("snapshots", {"snapshot": "snap-nope"})
    assert at.selectbox(key="snapshot").value == built.snapshot_id


# --- lineage ----------------------------------------------------------------------------------------------
def test_lineage_opens_manifest_and_model(env, built):
    at = open_page("lineage")
    dot = at.get("graphviz_chart")[0].proto.spec
    assert '"expert_2" -> "merged-1"' in dot
    assert table(at, "lineage_table")["node"].tolist() == ["base", *E, "merged-1"]
    at.selectbox(key="node").select("merged-1").run()
    at.button(key="open_manifest").click().run()
    assert at.title[0].value == "Snapshots"
    assert at.selectbox(key="snapshot").value == built.snapshot_id

    at = open_page("lineage", {"node": "expert_2"})
    assert at.selectbox(key="node").value == "expert_2"
    at.button(key="open_model").click().run()
    assert at.title[0].value == "Models" and at.selectbox(key="model").value == "expert_2"


def test_run_cancel(env):
    """The Cancel button signals the run's process group (a stand-in process here: a real merge of the
    tiny family finishes before a click could reach it)."""
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        c = cat_of(env)
        with c.transaction():
            cur = c.conn.execute(
                "INSERT INTO runs (kind, plan_id, out, model_id, status, pid, started_at, blocks_done, blocks_total, "
                "expert_bytes_planned) VALUES ('merge', 'plan-x', '/tmp/x', 'slow', 'running', ?, "
                "'2026-01-01T00:00:00Z', 3, 10, 4096)", [child.pid])
        run_id = cur.lastrowid
        at = open_page("run", {"run": str(run_id)})
        assert at.selectbox(key="run").value == str(run_id)
        assert metrics(at)["Status"] == "running" and metrics(at)["Blocks"] == "3/10"
        at.button(key="cancel").click().run()
        assert any(f"run {run_id}: cancel requested" in w.value for w in at.warning)
        assert child.wait(timeout=10) == -15  # SIGTERM
        at.run()
        assert metrics(at)["Status"] == "failed"  # the process is gone without recording an end
        c.close()
    finally:
        if child.poll() is None:
            child.kill()


def test_catalog_deep_links(env):
    at = open_page("catalog", {"view": "Blocks", "layer": "layer 1"})
    assert at.radio(key="view").value == "Blocks" and at.selectbox(key="layer").value == "layer 1"
    assert set(table(at, "block_table")["group"]) == {"layer 1"}
    at = open_page("catalog", {"view": "Conflicts", "clayer": "head", "metric": "cosine", "experts": ["expert_1", "expert_3"]})
    assert at.selectbox(key="clayer").value == "head" and at.radio(key="metric").value == "cosine"
    assert table(at, "conflict_table").index.tolist() == ["expert_1", "expert_3"]


# --- registration kinds, mergekit YAML --------------------------------------------------------------------
def _register(at, path, model_id, kind, base=None):
    at.text_input(key="reg_path").input(str(path))
    at.text_input(key="reg_id").input(model_id)
    at.selectbox(key="reg_kind").select(kind)
    at.selectbox(key="reg_base").select(base or "(none: this is a base model)")
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]


def test_models_register_delta_and_lora(env, built):
    from safetensors.torch import save_file

    from merge_helpers import load_dir
    from config.test_mergekit_config import make_peft_adapter
    tmp = env["tmp"]
    base, expert = load_dir(built.family / "base"), load_dir(built.family / "expert_1")
    (tmp / "delta_1").mkdir()
    save_file({k: (expert[k] - base[k]).contiguous() for k in base}, str(tmp / "delta_1" / "model.safetensors"))
    adapter = make_peft_adapter(built.family / "base", tmp / "adapter_1")

    at = open_page("models")
    assert at.selectbox(key="reg_kind").options == ["full", "delta", "lora"]
    _register(at, tmp / "delta_1", "d1", "delta")
    assert any("delta checkpoint needs a base" in e for e in errors(at)), errors(at)
    _register(at, adapter, "l1", "lora")
    assert any("LoRA adapter needs a base" in e for e in errors(at)), errors(at)
    _register(at, tmp / "delta_1", "d1", "delta", base="base")
    assert any(s.value.startswith("registered: d1") for s in at.success), [s.value for s in at.success]
    _register(at, adapter, "l1", "lora", base="base")
    assert any(s.value.startswith("registered: l1") for s in at.success), (errors(at), [s.value for s in at.success])
    df = table(at, "models_table").set_index("id")
    assert df.at["d1", "kind"] == "delta" and df.at["l1", "kind"] == "lora"
    assert df.at["d1", "base"] == "base" == df.at["l1", "base"]
    c = cat_of(env)
    assert c.model("l1")["uri"] == str(adapter.resolve())
    c.close()


def _load_yaml(at, path):
    at.text_input(key="mk_path").input(str(path))
    at.button(key="mk_load").click().run()
    assert not at.exception, [e.value for e in at.exception]


def test_plan_loads_a_mergekit_yaml(env, built):
    cfg = env["tmp"] / "merge.yml"
    cfg.write_text(f"merge_method: ties\nbase_model: {built.family / 'base'}\nmodels:\n"
                   f"  - model: {built.family / 'expert_1'}\n    parameters: {{weight: 2.0, density: 0.3}}\n"
                   f"  - model: expert_3\n    parameters: {{weight: 1.0, density: 0.3}}\n"
                   f"parameters: {{lambda: 0.5}}\nmergepipe: {{budget: 40%, seed: 2}}\n")
    at = open_page("plan")
    _load_yaml(at, cfg)
    assert [s.value for s in at.success] == ["Loaded merge.yml: ties of expert_1, expert_3 on base."]
    assert not at.warning and not errors(at), ([w.value for w in at.warning], errors(at))
    assert at.selectbox(key="op").value == "ties" and at.number_input(key="density").value == 0.3
    assert at.multiselect(key="experts").value == ["expert_1", "expert_3"]
    assert at.number_input(key="w_expert_1").value == 2.0 and at.number_input(key="w_expert_3").value == 1.0
    assert at.number_input(key="lam").value == 0.5 and at.number_input(key="seed").value == 2
    assert at.slider(key="budget").value == 40
    c = cat_of(env)
    ctx = views.plan_context(c, "base", ["expert_1", "expert_3"], "ties", weights=[2.0, 1.0], density=0.3, lam=0.5,
                             seed=2)
    want = views.plan_summary(dash_plan.make_plan(ctx, 40))
    assert metrics(at)["Estimated expert read"] == want["expert_read"]
    assert _mask_selected(at) == want["blocks_selected"]
    at.button(key="save_plan").click().run()
    assert f"Saved {want['plan_id']}." in [s.value for s in at.success]
    c.close()


def test_plan_bad_mergekit_yaml_is_an_error(env, built):
    tmp = env["tmp"]
    at = open_page("plan")
    before = metrics(at)
    (tmp / "slices.yml").write_text("merge_method: linear\nbase_model: base\nslices: []\n")
    _load_yaml(at, tmp / "slices.yml")
    assert any("slices.yml" in e and "slices" in e for e in errors(at)), errors(at)
    (tmp / "syntax.yml").write_text("models: [\n")
    _load_yaml(at, tmp / "syntax.yml")
    assert any("not valid YAML" in e for e in errors(at)), errors(at)
    (tmp / "new.yml").write_text(f"merge_method: linear\nbase_model: base\nmodels: [{built.root}]\n")
    _load_yaml(at, tmp / "new.yml")
    assert any("not registered in the catalog" in e for e in errors(at)), errors(at)
    _load_yaml(at, tmp / "missing.yml")
    assert any("does not exist" in e for e in errors(at)), errors(at)
    _load_yaml(at, "/etc/hostname")
    assert any("outside the allowed folders" in e for e in errors(at)), errors(at)
    assert at.selectbox(key="op").value == "linear" and metrics(at) == before  # settings untouched
