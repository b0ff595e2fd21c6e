"""Merge sweeps: a 6-point grid on a real local Ray cluster (6 snapshots, the table, outputs equal to
local merges of the same points), a local sweep through the CLI with perplexity scored on each output
(equal to an independent evaluation), refused configs that change nothing, and the dashboard's frontier."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest
import ray

from mergepipe import api
from mergepipe.dashboard import sweeps as dash
from mergepipe.engine.engine import Engine
from mergepipe.engine.ray_executor import runtime_env
from mergepipe.config.model import ConfigError
from mergepipe.errors import PlanError
from mergepipe.planner.context import Planner
from mergepipe.planner.request import MergeRequest
from mergepipe.research.evaluate import perplexity

from merge_helpers import cli_cmd, dir_hashes, manifest_of, open_copy, rows, shared_family

HELDOUT = "the quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


@pytest.fixture
def cat(fam, tmp_path):
    c = open_copy(fam, tmp_path / "c.sqlite")
    yield c
    c.close()


def write_config(path: Path, doc: str) -> Path:
    path.write_text(doc)
    return path


GRID = """
name: grid
base: base
experts: [e1, e2, e3]
out: outs
executor: ray
concurrency: 2
settings: {density: 0.3, seed: 3}
grid:
  operator: [ties, dare_ties]
  budget: ["30%", "60%", "100%"]
"""


def test_a_six_point_sweep_on_ray_publishes_six_snapshots_and_a_table(fam, cat, tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), log_to_driver=False)
    try:
        res = api.run_sweep(cat, api.load_sweep(write_config(tmp_path / "grid.yml", GRID)))
    finally:
        ray.shutdown()
    points = res["points"]
    expected = [{"density": 0.3, "seed": 3, "operator": op, "budget": b}
                for op, b in itertools.product(["ties", "dare_ties"], ["30%", "60%", "100%"])]
    assert [p["settings"] for p in points] == expected
    assert [p["status"] for p in points] == ["published"] * 6
    assert [p["model_id"] for p in points] == [f"grid-{i}" for i in range(6)]
    snaps = {r["id"]: r for r in rows(Path(cat.path), "SELECT * FROM snapshots")}
    assert sorted(p["snapshot_id"] for p in points) == sorted(snaps) and len(snaps) == 6
    assert rows(Path(cat.path), "SELECT name, executor, status, points FROM sweeps") == [
        {"name": "grid", "executor": "ray", "status": "done", "points": 6}]
    reads = []
    for p in points:
        m = manifest_of(tmp_path / "outs" / p["model_id"])
        assert m["run"]["snapshot_id"] == p["snapshot_id"] and m["run"]["range_tasks"] >= 1
        assert p["expert_read"] == m["core"]["realized"]["expert_read"] == sum(m["core"]["estimated_by_expert"].values())
        assert p["budget_bytes"] >= p["expert_read"] and p["seconds"] > 0
        reads.append(p["expert_read"])
    assert reads[0] < reads[1] < reads[2] and reads[3] < reads[4] < reads[5]
    for i in (0, 5):  # the same points merged locally: the same bytes
        s = points[i]["settings"]
        kw = {k: v for k, v in s.items() if k != "operator"}
        plan = Planner(cat).plan(MergeRequest.build("base", ["e1", "e2", "e3"], s["operator"], **kw), save=False)
        assert plan.id == points[i]["plan_id"]
        Engine(cat).execute(plan, out=tmp_path / f"local-{i}")
        assert dir_hashes(tmp_path / f"local-{i}") == dir_hashes(tmp_path / "outs" / f"grid-{i}")


LOCAL = """
base: base
experts: [e1, e2]
out: evals
settings: {operator: ties, density: 0.5}
points:
  - {budget: "20%"}
  - {budget: "100%"}
  - {operator: linear}
evaluate: {text: heldout.txt, window: 64, max_tokens: 400}
"""


def test_a_local_sweep_from_the_cli_scores_each_output(fam, cat, tmp_path):
    (tmp_path / "heldout.txt").write_text(HELDOUT)
    cfg = write_config(tmp_path / "evalsweep.yml", LOCAL)
    cat.close()
    proc = subprocess.run([*cli_cmd(), "--db", str(cat.path), "--json", "sweep", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["name"] == "evalsweep" and [p["status"] for p in res["points"]] == ["published"] * 3
    for p in res["points"]:
        out = tmp_path / "evals" / p["model_id"]
        assert p["metric"] == "perplexity"
        assert p["quality"] == perplexity(str(out), HELDOUT, window=64, max_tokens=400)["perplexity"]
    c = api.Catalog(cat.path)
    try:
        assert rows(Path(cat.path), "SELECT executor, status FROM sweeps") == [{"executor": "local", "status": "done"}]
        df = dash.points_df(c, res["sweep_id"])
        assert list(df["quality"]) == [p["quality"] for p in res["points"]]
        # the frontier: no other point reads at most as many bytes with a lower perplexity
        q, b = list(df["quality"]), list(df["expert_read"])
        expected = [not any(b[j] <= b[i] and q[j] <= q[i] and (b[j] < b[i] or q[j] < q[i]) for j in range(3))
                    for i in range(3)]
        assert list(df["frontier"]) == expected and any(expected)
        fig = dash.frontier_figure(df)
        assert {t.name for t in fig.data} == {"ties", "linear", "frontier"}
    finally:
        c.close()


@pytest.mark.parametrize("doc, error", [
    ("base: base\nexperts: [e1]\nout: o\npoints: [{}]\nbudgets: [1]\n",
     "error: unknown sweep key(s): budgets (known: address, base, concurrency, evaluate, executor, experts, grid, name, "
     "out, points, settings)\n"),
    ("base: base\nexperts: [e1]\nout: o\ngrid: {budget: []}\n", "error: grid.budget: a non-empty list of values\n"),
    ("base: base\nexperts: [e1]\nout: o\nconcurrency: 3\npoints: [{}]\n",
     "error: concurrency goes with executor: ray (the local executor runs points one at a time)\n"),
    ("name: bad\nbase: base\nexperts: [e1, e2]\nout: o\npoints: [{operator: ties, density: 0.3}, "
     "{operator: ties, density: 7}]\n",
     "error: sweep point 1 {'operator': 'ties', 'density': 7}: density 7 of e1 is outside (0, 1], the range of density\n"),
])
def test_a_refused_sweep_config_changes_nothing(fam, cat, tmp_path, doc, error):
    cfg = write_config(tmp_path / "bad.yml", doc)
    cat.close()
    before = {t: rows(Path(cat.path), f"SELECT * FROM {t}") for t in ("sweeps", "snapshots", "plans", "models")}
    proc = subprocess.run([*cli_cmd(), "--db", str(cat.path), "sweep", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert (proc.returncode, proc.stderr) == (2, error)
    assert not (tmp_path / "o").exists()
    assert {t: rows(Path(cat.path), f"SELECT * FROM {t}") for t in ("sweeps", "snapshots", "plans", "models")} == before


def test_sweep_errors_are_typed(fam, cat, tmp_path):
    with pytest.raises(ConfigError):
        api.load_sweep(write_config(tmp_path / "x.yml", "- 1\n"))
    cfg = api.load_sweep(write_config(tmp_path / "y.yml", "base: base\nexperts: [e1]\nout: o\n"
                                                          "points: [{operator: ties, density: 2}]\n"))
    with pytest.raises(PlanError):
        api.run_sweep(cat, cfg)
