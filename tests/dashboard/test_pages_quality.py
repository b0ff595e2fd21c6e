"""AppTest tests of issue 16's second half: Evaluate with a task suite (background run, stored results
beside bytes and bound), and Compare of two plans or snapshots with their quality scores."""

from __future__ import annotations

import json

import pytest

from dashboard_helpers import EXPERTS, open_page, wait_until
from mergepipe.catalog.db import Catalog
from mergepipe.api import evaluations
from mergepipe.dashboard import views
from mergepipe.dashboard import compare as dash_compare
from mergepipe.dashboard import plan as dash_plan
from mergepipe.dashboard import snapshots as dash_snapshots

E = list(EXPERTS)


def texts(elements) -> list[str]:
    return [e.value for e in elements]


def test_snapshots_evaluate_a_task_suite(env):
    from mergepipe.engine.runs import get_run
    suite = env["tmp"] / "suite.jsonl"
    rows = [{"task": "pick", "prompt": f"t{5 + i} t{6 + i}", "choices": ["t50", "t60", "t70"], "answer": i % 3}
            for i in range(6)] + [{"task": "echo", "prompt": "t5", "answer": "t5"}]
    suite.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = env["tmp"] / "bad.jsonl"
    bad.write_text('{"task": "a", "prompt": "p"}\n')
    at = open_page("snapshots")
    at.button(key="evaluate").click().run()
    assert "give a held-out text file or a task suite (or both)" in texts(at.error)
    at.text_input(key="eval_tasks").input(str(bad))
    at.button(key="evaluate").click().run()
    assert any(e.startswith(f"{bad}:1: expected a JSON object") for e in texts(at.error)), texts(at.error)
    c = Catalog(env["db"])
    assert views.latest_run(c, "evaluate") is None  # refused before any run started
    at.text_input(key="eval_tasks").input(str(suite))
    at.button(key="evaluate").click().run()
    assert any("evaluate run" in i for i in texts(at.info)), texts(at.info)
    run_id = views.latest_run(c, "evaluate")["id"]
    wait_until(lambda: get_run(c, run_id)["status"] not in ("queued", "running"), timeout=240, what="evaluate run")
    assert get_run(c, run_id)["status"] == "succeeded", get_run(c, run_id)
    stored = {(e["model_id"], e["metric"]): e["value"] for e in evaluations(c)}
    c.close()
    assert {m for m, _ in stored} == {"merged-1", "base", *E}
    for m in ("merged-1", "base", *E):  # the mean of the two tasks, as the child process stored it
        assert stored[(m, "accuracy")] == pytest.approx((stored[(m, "accuracy:pick")] + stored[(m, "accuracy:echo")]) / 2)
    at.run()
    assert not at.exception
    evals = [d.value for d in at.dataframe if "data sha256" in d.value.columns][0]
    assert set(evals["metric"]) == {"accuracy", "accuracy:pick", "accuracy:echo"} and (evals["data"] == "suite.jsonl").all()
    line = [s for s in texts(at.success) if s.startswith("read ")][0]
    assert f"accuracy {stored[('merged-1', 'accuracy')]:.4g} (base" in line and line.endswith("on suite.jsonl")
    snaps = [d.value for d in at.dataframe if "accuracy" in d.value.columns and "snapshot" in d.value.columns][0]
    assert snaps.iloc[0]["accuracy"] == pytest.approx(stored[("merged-1", "accuracy")])
    assert snaps.iloc[0]["error_bound"] > 0


def spec(at, key: str) -> dict:
    for el in at.get("plotly_chart"):
        if el.proto.id and key in el.proto.id:
            return json.loads(el.proto.spec)
    raise AssertionError(f"no chart {key}")


def test_compare_two_plans_and_a_scored_snapshot(env, built):
    from mergepipe.api import record_evaluation, save_plan
    c = Catalog(env["db"])
    ties = dash_plan.make_plan(views.plan_context(c, "base", E, "ties", density=0.5), 60)
    save_plan(c, ties)
    c.close()
    at = open_page("compare", {"cmp_a": built.plan_id, "cmp_b": ties.id})
    assert (at.selectbox(key="cmp_a").value, at.selectbox(key="cmp_b").value) == (built.plan_id, ties.id)
    assert any(x.startswith("saved plan: ties on base, would read ") for x in texts(at.caption))
    settings = [d.value for d in at.dataframe if "same" in d.value.columns][0].set_index("field")
    assert settings.at["operator", "B"] == "ties" and settings.at["model", "A"] == dash_compare.NOT_MERGED
    numbers = [d.value for d in at.dataframe if "quantity" in d.value.columns][0].set_index("quantity")
    assert numbers.at["expert read (realized)", "B"] == dash_compare.NOT_MERGED
    assert any(x.startswith("No stored scores") for x in texts(at.caption))
    bars = spec(at, "cmp_access")["data"]
    assert [t["name"] for t in bars] == ["both", "only A", "only B"]
    c = Catalog(env["db"])
    fp = {m["id"]: m["fingerprint"] for m in c.models()}
    record_evaluation(c, "merged-1", fp["merged-1"], "sha256:aa", "suite.jsonl", "accuracy", 0.625, 8)
    c.close()
    at.selectbox(key="cmp_a").select(built.snapshot_id).run()
    assert not at.exception
    scores = [d.value for d in at.dataframe if "metric" in d.value.columns][0]
    assert scores.to_dict("records") == [{"metric": "accuracy", "data": "suite.jsonl", "A": "0.625",
                                          "B": dash_compare.NOT_MERGED}]


def test_delete_one_of_two_snapshots_shows_the_other(env, built):
    import shutil
    from mergepipe.api import merge
    own = env["tmp"] / "m1"  # deletion removes the folder: give this catalog its own copy
    shutil.copytree(built.merged, own)
    c = Catalog(env["db"])
    c.conn.execute("UPDATE snapshots SET out = ?", [str(own)])
    c.conn.execute("UPDATE models SET uri = ? WHERE id = 'merged-1'", [str(own)])
    c.conn.commit()
    _, sid2, _ = merge(c, "base", E, env["tmp"] / "m2", operator="linear", model_id="merged-2", budget="60%")
    c.close()
    at = open_page("snapshots", {"snapshot": built.snapshot_id})
    assert at.selectbox(key="snapshot").value == built.snapshot_id
    at.checkbox(key="del_confirm").check().run()
    at.button(key="delete").click().run()
    assert not at.exception
    assert any(s.startswith(f"Deleted {built.snapshot_id} (merged-1)") for s in texts(at.success))
    assert at.selectbox(key="snapshot").value == sid2 and at.selectbox(key="snapshot").options == [sid2]
    assert "model merged-2" in texts(at.caption)


def _distance(dir_a, dir_b) -> float:
    """||A - B|| over every float tensor, from the safetensors files (independent of the harness)."""
    import math
    import torch
    from safetensors.torch import load_file
    ta = {k: v for f in sorted(dir_a.glob("*.safetensors")) for k, v in load_file(f).items()}
    tb = {k: v for f in sorted(dir_b.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(ta) == set(tb)
    return math.sqrt(sum(float(((ta[k].double() - tb[k].double()) ** 2).sum()) for k in ta
                         if ta[k].is_floating_point()))


def test_compare_measures_the_realized_deviation_against_the_bound(env, built):
    import re
    from mergepipe.api import merge
    from mergepipe.engine.runs import get_run
    c = Catalog(env["db"])
    _, full, _ = merge(c, "base", E, env["tmp"] / "full", operator="linear", model_id="merged-full", budget="100%")
    bound = dash_snapshots.load_manifest(c, built.snapshot_id).core["error_bound"]["absolute"]
    c.close()
    at = open_page("compare", {"cmp_a": built.snapshot_id, "cmp_b": full})
    assert not [i for i in texts(at.info) if i.startswith("Realized")]
    at.button(key="cmp_measure").click().run()
    assert any(i.startswith("evaluate run") and "||merged-1 - merged-full||" in i for i in texts(at.info))
    c = Catalog(env["db"])
    run_id = views.latest_run(c, "evaluate")["id"]
    wait_until(lambda: get_run(c, run_id)["status"] not in ("queued", "running"), timeout=240, what="evaluate run")
    assert get_run(c, run_id)["status"] == "succeeded", get_run(c, run_id)
    c.close()
    at.run()
    note = [i for i in texts(at.info) if i.startswith("Realized ||A - B|| = ")][0]
    value = float(re.match(r"Realized \|\|A - B\|\| = (\S+) ", note).group(1))
    want = _distance(built.merged, env["tmp"] / "full")
    assert value == pytest.approx(want, rel=1e-4) and 0 < want <= bound * (1 + 1e-5)
    assert note.endswith(f"B is the full-budget merge of A's settings: A's error bound {bound:.6g} holds.")
    scores = [d.value for d in at.dataframe if "metric" in d.value.columns][0].set_index("metric")
    assert scores.at["deviation", "data"] == "merged-full" and float(scores.at["deviation", "A"]) == \
        pytest.approx(want, rel=1e-3) and scores.at["deviation", "B"] == "-"
