"""Recipes (issue 17): named, versioned merges re-planned against the catalog; a run chooses the
incremental merge or the from-scratch one by estimated reads, and EXPLAIN shows both."""

from __future__ import annotations

import json

import pytest

from conftest import dump_catalog, load_checkpoint_tensors
from dashboard_helpers import build_catalog, copy_catalog
from merge_helpers import run_cli
from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.errors import PlanError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("recipe"), merged=False)


@pytest.fixture
def cat(built, tmp_path):
    c = Catalog(copy_catalog(built.db, tmp_path / "catalog.sqlite"))
    yield c
    c.close()


def test_versions_change_only_with_the_content(cat, tmp_path):
    assert api.recipe_save(cat, "daily", "base", ["expert_[12]"], "task_arithmetic", out=str(tmp_path / "{name}-{n}")) == 1
    assert api.recipe_save(cat, "daily", "base", ["expert_[12]"], "task_arithmetic", out=str(tmp_path / "{name}-{n}")) == 1
    assert api.recipe_save(cat, "daily", "base", ["expert_*"], "task_arithmetic", out=str(tmp_path / "{name}-{n}")) == 2
    assert api.recipe_show(cat, "daily", 1)["experts"] == ["expert_[12]"]
    assert api.recipe_show(cat, "daily")["version"] == 2
    assert [(r["name"], r["version"], r["runs"]) for r in api.recipe_list(cat)] == [("daily", 2, 0)]


def test_run_chooses_incremental_when_one_expert_arrives_and_equals_from_scratch(cat, tmp_path):
    out = str(tmp_path / "out" / "{name}-{n}")
    api.recipe_save(cat, "r", "base", ["expert_1", "expert_2"], "task_arithmetic", weights={"expert_2": 0.5}, out=out)
    first = api.recipe_run(cat, "r")
    assert first["choice"] == "scratch" and "incremental n/a: the recipe has no snapshot yet" in first["explain"]
    api.recipe_save(cat, "r", "base", ["expert_*"], "task_arithmetic", weights={"expert_2": 0.5}, out=out)
    text = api.recipe_explain(cat, "r")
    scratch_line = next(line for line in text.splitlines() if line.startswith("  scratch"))
    incr_line = next(line for line in text.splitlines() if line.startswith("  incremental"))
    assert "add expert_3 on snapshot " + first["snapshot_id"] in incr_line and "reads" in scratch_line
    second = api.recipe_run(cat, "r")
    assert second["choice"] == "incremental" and second["out"].endswith("r-2")
    manifest = api.load_manifest(cat, second["snapshot_id"]).core
    assert manifest["extends"]["snapshot_id"] == first["snapshot_id"]
    # the same set from scratch, by hand: equal to fp32 rounding
    api.merge(cat, "base", ["expert_1", "expert_2", "expert_3"], tmp_path / "ref", operator="task_arithmetic",
              weights=[1.0, 0.5, 1.0])
    a, b = load_checkpoint_tensors(second["out"]), load_checkpoint_tensors(tmp_path / "ref")
    assert max(float((a[n].double() - b[n].double()).abs().max()) for n in a) < 1e-6
    third = api.recipe_run(cat, "r")
    assert third["choice"] == "none" and third["snapshot_id"] is None
    assert [r["runs"] for r in api.recipe_list(cat)] == [2]


def test_run_goes_from_scratch_when_that_reads_less_or_the_operator_is_not_additive(cat, tmp_path):
    out = str(tmp_path / "{name}-{n}")
    api.recipe_save(cat, "t", "base", ["expert_1"], "ties", params={"density": 0.5}, out=out)
    api.recipe_run(cat, "t")
    api.recipe_save(cat, "t", "base", ["expert_1", "expert_2"], "ties", params={"density": 0.5}, out=out)
    res = api.recipe_run(cat, "t")
    assert res["choice"] == "scratch" and "incremental n/a: ties is not additive" in res["explain"]
    # linear at 30 %: the rescale reads the snapshot and nearly all of the base; from scratch reads the
    # base and 30 % of two experts' changes
    api.recipe_save(cat, "s", "base", ["expert_1"], "linear", budget="30%", out=out)
    api.recipe_run(cat, "s")
    api.recipe_save(cat, "s", "base", ["expert_1", "expert_2"], "linear", budget="30%", out=out)
    opts = api.recipe_explain(cat, "s")
    assert "incremental reads" in opts and opts.rstrip().endswith("choice      from scratch")


def test_bad_recipes_are_refused_and_change_nothing(cat, tmp_path):
    before = dump_catalog(cat)
    with pytest.raises(PlanError, match=r"^output pattern '\{who\}': only \{name\}, \{n\}, \{version\} and \{date\}"):
        api.recipe_save(cat, "x", "base", ["expert_1"], out="{who}")
    with pytest.raises(PlanError, match="unknown operator"):
        api.recipe_save(cat, "x", "base", ["expert_1"], "nope")
    with pytest.raises(PlanError, match="^unknown recipe 'x'"):
        api.recipe_run(cat, "x")
    api_before_runs = dump_catalog(cat)
    assert api_before_runs == before
    api.recipe_save(cat, "y", "base", ["nobody-*"], out=str(tmp_path / "{name}"))
    with pytest.raises(PlanError, match="^recipe y: no registered expert on 'base' matches nobody-\\*$"):
        api.recipe_run(cat, "y")


def test_cli_recipe_save_run_list(built, tmp_path):
    db = copy_catalog(built.db, tmp_path / "catalog.sqlite")
    r = run_cli(["--db", db, "recipe", "save", "c", "--base", "base", "--experts", "expert_1", "expert_2",
                 "--op", "linear", "--weight", "expert_2=2", "--out", str(tmp_path / "{name}-v{version}-{n}")])
    assert r.returncode == 0 and r.stdout == "recipe c v1 saved\n", r.stderr
    r = run_cli(["--db", db, "--json", "recipe", "run", "c"])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["choice"] == "scratch" and res["out"] == str(tmp_path / "c-v1-1")
    plan = api.load_manifest(Catalog(db), res["snapshot_id"]).core
    assert [(e["id"], e["weight"]) for e in plan["inputs"]["experts"]] == [("expert_1", 1.0), ("expert_2", 2.0)]
    bad = run_cli(["--db", db, "recipe", "save", "c", "--base", "base", "--experts", "expert_1", "--weight", "oops"])
    assert bad.returncode != 0 and bad.stderr == "error: --weight takes PATTERN=W (e.g. 'math-*=0.5'), not 'oops'\n"
    missing = run_cli(["--db", db, "recipe", "show"])
    assert missing.stderr == "error: recipe show needs a recipe NAME\n"


def test_a_v7_catalog_gets_the_recipe_tables(tmp_path):
    from mergepipe.catalog.schema import SCHEMA_VERSION
    db = tmp_path / "old.sqlite"
    cat = Catalog(db)
    for table in ("recipes", "recipe_snapshots", "watch_seen"):
        cat.conn.execute(f"DROP TABLE {table}")
    cat.conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    cat.conn.commit()
    cat.close()
    cat = Catalog(db)
    try:
        assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION) == "13"
        assert api.recipe_list(cat) == []
    finally:
        cat.close()


def test_the_first_matching_weight_pattern_wins(cat, tmp_path):
    from mergepipe.config.recipe import load_recipe, resolve_experts
    api.recipe_save(cat, "w", "base", ["expert_*"], weights={"expert_2": 2.0, "expert_*": 0.5})
    assert [(e["model"], e["weight"]) for e in resolve_experts(cat, load_recipe(cat, "w")[0])] == [
        ("expert_1", 0.5), ("expert_2", 2.0), ("expert_3", 0.5)]
    api.recipe_save(cat, "w", "base", ["expert_*"], weights={"expert_*": 0.5, "expert_2": 2.0})
    assert [e["weight"] for e in resolve_experts(cat, load_recipe(cat, "w")[0])] == [0.5, 0.5, 0.5]
    assert api.recipe_show(cat, "w", 1)["weights"] == {"expert_2": 2.0, "expert_*": 0.5}
