"""AppTest tests of the daily-use widgets (issue 16): heatmap scales, the outlier-expert warning,
out-of-range URL parameters, the settings as mergekit YAML (validate, apply, download), top-N tensor
bytes, the model card, the recipe download, tags and note, deleting a snapshot, getting started."""

from __future__ import annotations

import json

import pytest

from dashboard_helpers import EXPERTS, open_page
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.dashboard import views
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import snapshots as dash_snapshots

E = list(EXPERTS)


def spec(at, key: str) -> dict:
    for el in at.get("plotly_chart"):
        if el.proto.id and key in el.proto.id:
            return json.loads(el.proto.spec)
    raise AssertionError(f"no chart {key}")


def texts(elements) -> list[str]:
    return [e.value for e in elements]


def downloads(at) -> dict:
    return {el.proto.label: el.proto for el in at.get("download_button")}


def test_catalog_heatmap_scales(env):
    at = open_page("catalog")
    assert at.radio(key="scale").value == "linear" and at.radio(key="norm").value == "absolute"
    at.radio(key="scale").set_value("log").run()
    at.radio(key="norm").set_value("per expert").run()
    s = spec(at, "norm_chart")
    assert "log scale" in s["layout"]["title"]["text"]
    assert s["data"][0]["colorbar"]["title"]["text"] == "log10 ||delta|| / expert max"
    at.radio(key="view").set_value("Blocks").run()
    assert not at.exception and "log scale, per expert" in spec(at, "block_chart")["layout"]["title"]["text"]


def test_models_page_warns_about_an_outlier_expert(env):
    at = open_page("models")
    assert not [w for w in texts(at.warning) if "different base" in w]
    cat = Catalog(env["db"])
    cat.conn.execute("UPDATE tensor_stats SET delta_l2 = delta_l2 * 5000 WHERE model_id = 'expert_3'")
    cat.conn.commit()
    cat.close()
    at = open_page("models")
    assert [w for w in texts(at.warning) if "'expert_3'" in w and "different base" in w]
    at = open_page("plan")  # and the plan carries it
    assert [w for w in texts(at.warning) if "'expert_3'" in w and "different base" in w]


def test_plan_out_of_range_url_parameters_are_reported(env):
    at = open_page("plan", {"op": "ties", "budget": "500", "density": "7"})
    w = texts(at.warning)
    assert "URL parameter budget=500 is outside 0 to 100; replaced by 25." in w, w
    assert any(x.startswith("URL parameter density=7 is outside") and "replaced by 0.5" in x for x in w), w
    assert at.slider(key="budget").value == 25
    at.slider(key="budget").set_value(30).run()  # said once, not on every rerun
    assert not [x for x in texts(at.warning) if x.startswith("URL parameter")]


def test_plan_wording_bound_reason_and_expert_names(env):
    at = open_page("plan")
    assert at.slider(key="budget").label == "Expert-read budget (% of the changed expert bytes)"
    assert any(c.startswith("3 experts: expert_1, expert_2, expert_3") for c in texts(at.caption))
    table = [d.value for d in at.dataframe if "changed blocks" in d.value.columns][0]
    assert "read_text" not in table.columns and table["read"].str.endswith("B").all()
    at.selectbox(key="op").select("ties").run()
    bound = {m.label: m.value for m in at.metric}["Error bound"]
    assert bound != "n/a" and float(bound) > 0  # TIES' sound, loose bound (kind sparsified)
    assert not any(c.startswith("Error bound n/a") for c in texts(at.caption))
    mask = spec(at, "mask_chart")
    assert mask["data"][0]["showscale"] is False and len(mask["data"]) == 4  # heatmap + 3 legend entries
    assert mask["layout"]["xaxis"]["ticktext"][0] == "embed"


def test_plan_yaml_validate_apply_download(env):
    at = open_page("plan")
    area = at.text_area[0]
    text = area.value
    assert "merge_method: linear" in text and "mergepipe:" in text and "budget: 25%" in text
    assert any(c.startswith("The current settings: edit them here") for c in texts(at.caption))
    c = Catalog(env["db"])  # the shown YAML is valid and describes these settings
    assert views.check_plan_yaml(c, text, [env["built"].root, env["tmp"]])[1] == \
        "linear of expert_1, expert_2, expert_3 on base, budget 25%"
    c.close()
    assert "Download YAML" in downloads(at)
    # an error shows inline, and Apply stays off
    area.set_value(text.replace("merge_method: linear", "merge_method: nonsense")).run()
    assert any(e.startswith("Not valid:") for e in texts(at.error)) and not at.exception
    assert at.button(key="yaml_apply").disabled
    # a valid edit: another operator, density and budget; applying moves the widgets
    edited = (text.replace("merge_method: linear", "merge_method: ties").replace("budget: 25%", "budget: 40%")
              .replace("    weight: 1.0\n", "    weight: 1.0\n    density: 0.4\n"))
    at.text_area[0].set_value(edited).run()
    assert any(s.startswith("Valid: ties of expert_1, expert_2, expert_3 on base, budget 40%") for s in texts(at.success))
    at.button(key="yaml_apply").click().run()
    assert not at.exception
    assert at.selectbox(key="op").value == "ties" and at.number_input(key="density").value == 0.4
    assert at.slider(key="budget").value == 40
    assert any(s.startswith("Applied the YAML: ties of") for s in texts(at.success))
    assert "merge_method: ties" in at.text_area[0].value  # follows the settings again


def test_snapshots_tensor_bytes_card_recipe(env, built):
    at = open_page("snapshots")
    c = Catalog(env["db"])
    man = dash_snapshots.load_manifest(c, built.snapshot_id)
    n = len(dash_snapshots.bytes_by_tensor_df(man, dash_snapshots.manifest_plan(c, man)))
    c.close()
    s = spec(at, "bytes_tensor")
    assert s["data"][0]["orientation"] == "h" and len(s["data"][0]["y"]) == min(20, n)
    assert any(c.startswith(f"{min(20, n)} of {n} matching tensors") for c in texts(at.caption))
    at.number_input(key="tensor_top").set_value(5).run()
    at.radio(key="tensor_sort").set_value("|difference|").run()
    at.text_input(key="tensor_search").input("layers.1 mlp").run()
    s = spec(at, "bytes_tensor")
    assert 1 <= len(s["data"][0]["y"]) <= 3 and all("layers.1." in n and "mlp" in n for n in s["data"][0]["y"])
    at.text_input(key="tensor_search").input("no-such-tensor").run()
    assert any("No tensor name contains" in i for i in texts(at.info))
    md = "\n".join(m.value for m in at.markdown)
    assert "## Recipe" in md and "merge_method: linear" in md and "## Inputs" in md
    assert any("base_model: base, expert_1, expert_2, expert_3" in c and "mergepipe" in c for c in texts(at.caption))
    d = downloads(at)
    assert "Download the recipe (mergekit YAML)" in d


def test_snapshots_tags_note_and_delete(env, built):
    import shutil
    own = env["tmp"] / "m1"  # deletion removes the folder: give this catalog its own copy
    shutil.copytree(built.merged, own)
    c = Catalog(env["db"])
    c.conn.execute("UPDATE snapshots SET out = ?", [str(own)])
    c.conn.execute("UPDATE models SET uri = ? WHERE id = 'merged-1'", [str(own)])
    c.conn.commit()
    c.close()
    at = open_page("snapshots")
    at.text_input(key="snap_tags").input("best, ties best").run()
    at.text_area(key="snap_note").input("keep this one").run()
    at.button(key="save_labels").click().run()
    assert any(s.startswith("Saved the tags and note") for s in texts(at.success))
    cat = Catalog(env["db"])
    row = views.snapshots_df(cat).iloc[0]
    assert row["tags"] == "best, ties" and row["note"] == "keep this one"
    # a model registered on the snapshot needs it: refused without force
    register(cat, "child", str(built.family / "expert_1"), base_id="merged-1")
    cat.close()
    at = open_page("snapshots")
    assert at.text_input(key="snap_tags").value == "best, ties"
    assert at.button(key="delete").disabled
    assert any("Needed by child" in w for w in texts(at.warning))
    at.checkbox(key="del_confirm").check().run()
    at.button(key="delete").click().run()
    assert any("needed by child" in e for e in texts(at.error)) and not at.exception
    at.checkbox(key="del_confirm").check().run()
    at.checkbox(key="del_force").check().run()
    at.button(key="delete").click().run()
    assert not at.exception
    assert any(s.startswith(f"Deleted {built.snapshot_id} (merged-1)") for s in texts(at.success)), texts(at.success)
    assert any("No snapshots yet" in i for i in texts(at.info))
    cat = Catalog(env["db"])
    assert not cat.has_model("merged-1") and not own.exists() and built.merged.is_dir()
    cat.close()


def test_home_getting_started(env, built, tmp_path, monkeypatch):
    at = open_page("home")
    code = at.code[0].value
    assert f"export MERGEPIPE_DB={env['db']}" in code and f"mergepipe explain {built.snapshot_id}" in code
    monkeypatch.setenv("MERGEPIPE_DB", str(tmp_path / "empty.sqlite"))
    at = open_page("home")
    assert "mergepipe register" in at.code[0].value


def test_compare_page(env, built):
    at = open_page("compare")  # one snapshot and its plan: A the plan, B the snapshot
    assert (at.selectbox(key="cmp_a").value, at.selectbox(key="cmp_b").value) == (built.plan_id, built.snapshot_id)
    from mergepipe.api import merge
    cat = Catalog(env["db"])
    _, sid2, _ = merge(cat, "base", E, env["tmp"] / "m2", operator="ties", model_id="merged-2", density=0.5,
                       budget="60%")
    cat.close()
    at = open_page("compare")
    assert {at.selectbox(key="cmp_a").value, at.selectbox(key="cmp_b").value} == {built.snapshot_id, sid2}
    at = open_page("compare", {"cmp_a": built.snapshot_id, "cmp_b": sid2})
    assert at.selectbox(key="cmp_a").value == built.snapshot_id and at.selectbox(key="cmp_b").value == sid2
    settings = [d.value for d in at.dataframe if "same" in d.value.columns][0]
    assert settings.set_index("field").at["operator", "B"] == "ties"
    at.toggle(key="cmp_only").set_value(True).run()
    settings = [d.value for d in at.dataframe if "same" in d.value.columns][0]
    assert set(settings["same"]) == {"no"}
    assert any("read differently" in c for c in texts(at.caption))
    assert spec(at, "cmp_access")["data"][0]["orientation"] == "h"
    at.selectbox(key="cmp_b").select(built.snapshot_id).run()
    assert any("two different snapshots or plans" in w for w in texts(at.warning))


def test_snapshot_deep_link_with_two_snapshots(env, built):
    from mergepipe.api import merge
    cat = Catalog(env["db"])
    _, sid2, _ = merge(cat, "base", E, env["tmp"] / "m2", operator="ties", model_id="merged-2", density=0.5,
                       budget="60%")
    cat.close()
    for sid in (built.snapshot_id, sid2):
        at = open_page("snapshots", {"snapshot": sid})
        assert at.selectbox(key="snapshot").value == sid


def test_run_plan_deep_link_with_two_plans(env, built):
    from mergepipe.api import save_plan
    c = Catalog(env["db"])
    plan = dash_plan.make_plan(views.plan_context(c, "base", E, "ties", density=0.5), 40)
    save_plan(c, plan)
    c.close()
    for pid in (built.plan_id, plan.id):
        at = open_page("run", {"plan": pid})
        assert at.selectbox(key="plan").value == pid
        assert any(x.startswith(pid) for x in texts(at.caption))


def test_snapshots_evaluate_with_progress(env, built):
    from dashboard_helpers import wait_until
    from mergepipe.engine.runs import get_run
    text = env["tmp"] / "heldout.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    at = open_page("snapshots")
    at.text_input(key="eval_text").input("/etc/hostname")
    at.button(key="evaluate").click().run()
    assert any("outside the allowed folders" in e for e in texts(at.error))
    at.text_input(key="eval_text").input(str(text))
    at.button(key="evaluate").click().run()
    assert any("evaluate run" in i for i in texts(at.info)), texts(at.info)
    c = Catalog(env["db"])
    run_id = views.latest_run(c, "evaluate")["id"]
    wait_until(lambda: get_run(c, run_id)["status"] not in ("queued", "running"), timeout=180, what="evaluate run")
    assert get_run(c, run_id)["status"] == "succeeded", get_run(c, run_id)
    c.close()
    at.run()
    assert not at.exception
    assert any("succeeded" in p.proto.text and "100%" in p.proto.text for p in at.get("progress"))
    evals = [d.value for d in at.dataframe if "data sha256" in d.value.columns][0]
    assert set(evals["model"]) == {"merged-1", "base", *E} and (evals["metric"] == "perplexity").all()
    assert evals.iloc[0]["role"] == "snapshot" and (evals["value"] > 1).all()
    line = [s for s in texts(at.success) if s.startswith("read ")][0]
    assert "perplexity" in line and "base" in line and "experts" in line and "heldout.txt" in line
    snaps = [d.value for d in at.dataframe if "perplexity" in d.value.columns and "snapshot" in d.value.columns][0]
    assert snaps.iloc[0]["perplexity"] == pytest.approx(evals.iloc[0]["value"], rel=1e-3)
