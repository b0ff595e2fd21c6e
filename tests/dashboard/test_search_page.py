"""The Search page (AppTest): the launch form (an example from the catalog, checked live: one error line and
Launch disabled while invalid), a finished search's trials, score chart, parameter importance and best recipe,
and "Publish the best", from a real search (api.search) over the dashboard test family."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess

import pytest

from mergepipe import api

from dashboard_helpers import build_catalog, copy_catalog, open_page, page_env, wait_until

OBJECTIVE = '''
from pathlib import Path
from safetensors.torch import load_file

REF = {}
for f in sorted(Path({ref!r}).glob("*.safetensors")):
    REF.update(load_file(f))


def score(sd):
    """Closeness of the merged weights to expert_1's (higher: closer)."""
    return -sum(float((sd[k].double() - v.double()).norm()) for k, v in REF.items() if v.is_floating_point())
'''
SEARCH = {"trials": 4, "sampler": "random", "seed": 0, "objective": {"python": "objective.py:score"},
          "fidelities": ["30%", "100%"], "pruner": "none"}
SPACE = """merge_method: task_arithmetic
base_model: base
models:
  - model: expert_1
    parameters: {weight: {range: [0.1, 1.0]}}
  - model: expert_2
    parameters: {weight: {range: [0.1, 1.0]}}
"""


def write_objective(folder, built) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "objective.py").write_text(OBJECTIVE.replace("{ref!r}", repr(str(built.family / "expert_1"))))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("search-page"), merged=False)


@pytest.fixture(scope="module")
def searched(family):
    """The family with one finished search (4 trials at 30 % then 100 %) in a copy of its catalog."""
    write_objective(family.root, family)
    space = family.root / "space.yml"
    space.write_text(SPACE + f"search: {json.dumps({**SEARCH, 'name': 'page'})}\n")
    db = copy_catalog(family.db, family.root / "searched.sqlite")
    cat = api.Catalog(db)
    try:
        api.search(cat, api.load_search(space))
    finally:
        cat.close()
    return dataclasses.replace(family, db=db)


@pytest.fixture
def shown(searched, tmp_path, monkeypatch):
    """The page's private copy of the searched catalog (an objective in its working folder) and its search as
    api.search_show gives it."""
    env = page_env(searched, tmp_path, monkeypatch)
    write_objective(tmp_path / "catalog-searches", searched)
    cat = api.Catalog(env["db"])
    try:
        search_id = api.searches(cat)[0]["id"]
        return {**env, "search": api.search_show(cat, search_id)}
    finally:
        cat.close()


def launch_button(at):
    return at.button(key="search_launch")


def test_the_example_is_checked_until_its_objective_is_in_the_working_folder(family, tmp_path, monkeypatch):
    page_env(family, tmp_path, monkeypatch)
    at = open_page("search")
    assert "No searches yet" in at.info[0].value
    example = at.text_area(key="search_yaml").value
    assert "base_model: base" in example and "model: expert_1" in example and "model: expert_2" in example
    work = tmp_path / "catalog-searches"
    assert [e.value for e in at.error] == [f"Not valid: search.objective: {work / 'objective.py'}: no such file"]
    assert launch_button(at).disabled
    write_objective(work, family)
    at.text_area(key="search_yaml").set_value(example + "\n").run()
    assert not at.error and not at.exception
    assert at.success[0].value.startswith("Valid: 20 trials (tpe, seed 0) of task_arithmetic or ties on base")
    assert not launch_button(at).disabled


@pytest.mark.parametrize("text,words", [
    ("merge_method: [ties\n", "Not valid: not valid YAML"),
    (SPACE + "search: {trails: 3, objective: {python: objective.py:score}}\n", "unknown key 'trails' in search"),
    (SPACE.replace("expert_2", "nobody") + "search: {objective: {python: objective.py:score}}\n",
     "'nobody' is neither a registered model id nor an existing path"),
    (SPACE + "search: {objective: {python: objective.py:score}, fidelities: [50%, 10%]}\n",
     "search.fidelities must rise"),
])
def test_an_invalid_yaml_is_one_error_line_and_launch_is_disabled(shown, text, words):
    at = open_page("search")
    at.text_area(key="search_yaml").set_value(text).run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and words in errors[0] and "\n" not in errors[0], errors
    assert launch_button(at).disabled


@pytest.mark.slow  # a `mergepipe search` process: seconds
def test_a_launch_that_stops_before_its_first_trial_shows_why(shown):
    """The page's checks pass (the objective file is there); the search process imports the objective, which
    raises: it stops before recording anything, and the page says why in one line."""
    work = shown["tmp"] / "catalog-searches"
    (work / "broken.py").write_text("raise RuntimeError('no GPU here')\n\ndef score(sd):\n    return 0.0\n")
    at = open_page("search")
    text = SPACE + 'search: {trials: 2, objective: {python: "broken.py:score"}}\n'
    at.text_area(key="search_yaml").set_value(text).run()
    assert at.success[0].value.startswith("Valid: 2 trials (tpe, seed 0) of task_arithmetic on base")
    launch_button(at).click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.info[0].value.startswith("Starting the search of `") and (work / "search-1.yml").read_text() == text
    wait_until(lambda: at.run().error, timeout=120, interval=0.5, what="the search process's error")
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and errors[0].startswith(f"{work / 'search-1.yml'}: ") and "no GPU here" in errors[0], errors
    assert "\n" not in errors[0] and not at.exception
    assert "error: " in (work / "search-1.log").read_text()
    cat = api.Catalog(shown["db"])
    try:
        assert [r["id"] for r in api.searches(cat)] == [shown["search"]["id"]]  # nothing recorded
    finally:
        cat.close()


def test_a_finished_search_shows_its_trials_chart_importance_and_best_recipe(shown):
    res = shown["search"]
    at = open_page("search")
    assert not at.error and at.success[0].value.startswith("Valid: 20 trials")
    assert at.selectbox(key="search").value == res["id"]
    trials = at.dataframe[0].value
    assert list(trials["trial"]) == [t["number"] for t in res["trials"]] == [0, 1, 2, 3]
    assert list(trials["status"]) == [t["status"] for t in res["trials"]] == ["complete"] * 4
    assert list(trials["fidelity"]) == ["100%"] * 4
    assert list(trials["score"]) == [t["score"] for t in res["trials"]]
    assert list(trials["expert read (MiB)"]) == [t["expert_read"] / 2 ** 20 for t in res["trials"]]
    assert list(trials["seconds"]) == [t["seconds"] for t in res["trials"]]
    assert list(trials["params"]) == [" ".join(f"{k}={v:.4g}" for k, v in t["params"].items()) for t in res["trials"]]
    assert at.get("progress")[0].proto.text.startswith(f"{res['id']}: finished: 4 trials (4 complete, 0 pruned")
    charts = [c.proto.id for c in at.get("plotly_chart")]
    assert len(charts) == 2  # every step's score vs bytes, and the importance bars
    scores = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert [tr["name"] for tr in scores["data"]] == ["30%", "100%"]
    assert sum(len(tr["y"]) for tr in scores["data"]) == sum(len(t["steps"]) for t in res["trials"]) == 8
    assert at.code[0].value.strip() == res["best"]["recipe"].strip()  # st.code drops the final newline
    best = f"trial {res['best']['trial']}: score {res['best']['score']:.4g} at 100%"
    assert any(c.value.startswith(best) for c in at.caption)
    assert at.get("download_button") and not at.button(key="search_publish").disabled


def test_a_running_search_whose_process_is_gone_says_so(shown):
    gone = subprocess.Popen(["true"])
    gone.wait()
    with sqlite3.connect(shown["db"]) as conn:  # as a killed search leaves its row
        conn.execute("UPDATE searches SET status = 'running', pid = ?", [gone.pid])
    at = open_page("search")
    search_id = shown["search"]["id"]
    assert at.get("progress")[0].proto.text == (
        f"{search_id}: stopped: its process {gone.pid} is gone after 4 of 4 trials; resume it with "
        f"`mergepipe --db {shown['db']} search --resume {search_id}`")
    assert not at.exception


@pytest.mark.slow  # a `mergepipe search publish` process: seconds
def test_publish_the_best_creates_a_snapshot_and_shows_its_id(shown):
    res = shown["search"]
    at = open_page("search")
    at.button(key="search_publish").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.button(key="search_publish").disabled  # while its process runs
    snapshot = wait_until(lambda: published(shown["db"], res), timeout=120, what="the published snapshot")
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.success[-1].value == f"Published trial {res['best']['trial']} as snapshot {snapshot}"
    assert at.button(key="search_publish").disabled
    assert (shown["tmp"] / "merged" / f"page-{res['id'].removeprefix('search-')[:6]}-best").is_dir()
    cat = api.Catalog(shown["db"])
    try:
        assert snapshot in [s["id"] for s in api.snapshots(cat)]
    finally:
        cat.close()


def published(db, res) -> str | None:
    cat = api.Catalog(db)
    try:
        return api.search_show(cat, res["id"])["trials"][res["best"]["trial"]]["snapshot_id"]
    finally:
        cat.close()
