"""Analysis on the way (issue 12): a merge over experts that are registered but not analyzed reads them
in full, computes exactly the statistics ANALYZE would store, commits them with the snapshot, and
publishes exactly the full-budget merge. A failed or cancelled first merge stores no statistics."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.engine.inflight import InflightAnalysis
from mergepipe.planner.context import Planner
from mergepipe.catalog.models import register

from merge_helpers import (STAGING_MARK, check_catalog_consistent, dir_hashes, dump_db, rows, run_cli,
                           shared_family, slowed_cli_cmd)

BLOCK = 4096
EXPERTS = ["e1", "e2", "e3"]
OPS = [("ties", {"density": 0.3}), ("dare_ties", {"density": 0.5}), ("linear", {}),
       ("task_arithmetic", {"lam": 0.7}), ("breadcrumbs_ties", {"density": 0.3})]
STAT_TABLES = ("blocks", "tensor_stats")


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


def registered(fam, path, analyzed=()) -> Catalog:
    """A catalog with the family registered; only ``analyzed`` experts analyzed (on a 4 KiB grid)."""
    cat = Catalog(path)
    register(cat, "base", str(fam.base))
    for i, e in enumerate(EXPERTS):
        register(cat, e, str(fam.experts[i]), base_id="base")
    if analyzed:
        analyze(cat, list(analyzed), block_bytes=BLOCK)
    return cat


def stats_of(cat: Catalog, expert: str) -> dict:
    out = {t: cat.query(f"SELECT * FROM {t} WHERE model_id = ? ORDER BY tensor" + (", block" if t == "blocks" else ""),
                        [expert]) for t in STAT_TABLES}
    a = dict(cat.analysis(expert))
    for volatile in ("seconds", "analyzed_at"):
        a.pop(volatile)
    out["analyses"] = a
    return out


@pytest.fixture(scope="module")
def reference(fam, tmp_path_factory):
    """Every expert analyzed by ANALYZE, and the full-budget merge of each operator."""
    root = tmp_path_factory.mktemp("reference")
    cat = registered(fam, root / "c.sqlite", analyzed=EXPERTS)
    outs = {}
    for op, kw in OPS:
        _, _, manifest = merge(cat, "base", EXPERTS, root / op, operator=op, budget="100%", **kw)
        outs[op] = (root / op, manifest)
    return cat, outs


@pytest.mark.parametrize("op, kw", OPS, ids=[o for o, _ in OPS])
def test_first_merge_equals_the_full_budget_merge_and_stores_analyze_statistics(fam, reference, tmp_path, op, kw):
    ref_cat, ref_outs = reference
    cat = registered(fam, tmp_path / "c.sqlite", analyzed=["e1"])  # e2, e3 registered only
    plan = Planner(cat).plan("base", EXPERTS, op, budget="10%", save=False, **kw)
    assert [e.get("analyze") for e in plan["experts"]] == [None, "not analyzed", "not analyzed"]
    assert plan["budget"] == {"spec": "10%", "bytes": plan["full_expert_bytes"], "first_merge": True}
    text = plan.explain()
    assert text.count("not analyzed: read in full and analyzed on the way") == 2
    # the budget it actually uses (everything), and the one asked for
    assert "  budget     100% = " in text and "the 10% asked for applies from the next merge" in text

    _, sid, manifest = merge(cat, "base", EXPERTS, tmp_path / "out", operator=op, budget="10%", **kw)
    ref_dir, ref_manifest = ref_outs[op]
    # bit for bit the full-budget merge, touching the same blocks
    assert dir_hashes(tmp_path / "out", "*.safetensors") == dir_hashes(ref_dir, "*.safetensors")
    assert manifest.core["touched"] == ref_manifest.core["touched"]
    # every expert byte the plan named was read, and the analysis read base + expert
    assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"] == plan["full_expert_bytes"]
    on_the_way = manifest.core["analyzed_on_the_way"]
    assert set(on_the_way) == {"e2", "e3"}
    assert on_the_way["e2"]["bytes_read"] == ref_cat.analysis("e2")["bytes_read"]
    # the catalog rows equal ANALYZE's
    for e in ("e2", "e3"):
        assert cat.is_analyzed(e)
        assert stats_of(cat, e) == stats_of(ref_cat, e)
    assert cat.query("SELECT snapshot_id FROM models WHERE id = 'out'")[0]["snapshot_id"] == sid
    # from the next merge on, the budget applies
    nxt = Planner(cat).plan("base", EXPERTS, op, budget="10%", save=False, **kw)
    assert not any(e.get("analyze") for e in nxt["experts"])
    assert nxt["estimate"]["expert_read"] <= nxt["budget"]["bytes"] < nxt["full_expert_bytes"]
    cat.close()


def test_missing_threshold_is_computed_on_the_way(fam, tmp_path):
    """An analyzed expert lacking the threshold a density needs is re-analyzed by the merge."""
    cat = registered(fam, tmp_path / "c.sqlite", analyzed=EXPERTS)
    plan = Planner(cat).plan("base", ["e1", "e2"], "ties", density=0.333, save=False)
    assert [e["analyze"] for e in plan["experts"]] == ["no magnitude threshold for top-0.333"] * 2
    merge(cat, "base", ["e1", "e2"], tmp_path / "out", operator="ties", density=0.333)
    for e in ("e1", "e2"):
        assert 0.333 in json.loads(cat.analysis(e)["densities"])
    again = Planner(cat).plan("base", ["e1", "e2"], "ties", density=0.333, budget="20%", save=False)
    assert not any(e.get("analyze") for e in again["experts"])
    cat.close()


def test_failed_first_merge_stores_no_statistics(fam, tmp_path, monkeypatch):
    cat = registered(fam, tmp_path / "c.sqlite")
    before = dump_db(tmp_path / "c.sqlite")
    calls = []
    real_use = InflightAnalysis._use

    def fail_midway(self, *a):
        calls.append(1)
        if len(calls) == 20:
            raise RuntimeError("disk on fire")
        return real_use(self, *a)

    monkeypatch.setattr(InflightAnalysis, "_use", fail_midway)
    plan = Planner(cat).plan("base", EXPERTS, "ties", density=0.3, save=False)
    with pytest.raises(RuntimeError, match="disk on fire"):
        Engine(cat).execute(plan, out=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert not [p for p in tmp_path.iterdir() if STAGING_MARK in p.name]
    cat.close()
    after = dump_db(tmp_path / "c.sqlite")
    for table in ("models", "analyses", "blocks", "tensor_stats", "grids", "snapshots", "manifests", "lineage"):
        assert after[table] == before[table], table


def test_cancelled_first_merge_cli(tmp_path_factory, tmp_path):
    """SIGTERM (the dashboard's cancel) during a first merge: exit 130, nothing published, no statistics."""
    small = shared_family(tmp_path_factory, "small-fp32")
    db = tmp_path / "c.sqlite"
    cat = Catalog(db)
    register(cat, "base", str(small.base))
    for i, e in enumerate(small.experts[:2], start=1):
        register(cat, f"e{i}", str(e), base_id="base")
    cat.close()
    before = dump_db(db)
    out = tmp_path / "outs" / "m"
    out.parent.mkdir()
    proc = subprocess.Popen(slowed_cli_cmd() + ["--db", str(db), "merge", "--base", "base", "--experts", "e1",
                                                "e2", "--op", "della", "--density", "0.3", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not any(STAGING_MARK in p.name for p in out.parent.iterdir()):
        assert proc.poll() is None and time.monotonic() - t0 < 60, "the merge ended before it could be cancelled"
        time.sleep(0.002)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not out.exists() and not any(STAGING_MARK in p.name for p in out.parent.iterdir())
    after = dump_db(db)
    for table in ("models", "analyses", "blocks", "tensor_stats", "grids", "snapshots"):
        assert after[table] == before[table], table
    check_catalog_consistent(db)


def test_cli_first_merge_without_analyze(fam, tmp_path):
    """register, then plan/merge straight away: EXPLAIN says what happens; `models` shows the experts
    analyzed afterwards; a bad budget is still refused."""
    db = tmp_path / "c.sqlite"
    registered(fam, db).close()
    res = run_cli(["--db", db, "plan", "--base", "base", "--experts", *EXPERTS, "--op", "ties", "--density", "0.3",
                   "--budget", "25%"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("not analyzed: read in full and analyzed on the way") == 3
    bad = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "--budget", "abc", "--out", tmp_path / "o"])
    assert bad.returncode == 2 and bad.stderr.startswith("error: bad budget 'abc'")
    res = run_cli(["--db", db, "--json", "merge", "--base", "base", "--experts", *EXPERTS, "--op", "ties",
                   "--density", "0.3", "--budget", "25%", "--out", tmp_path / "m"])
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["realized"]["expert_read"] == summary["full_expert_bytes"]
    models = {m["id"]: m for m in json.loads(run_cli(["--db", db, "--json", "models"]).stdout)}
    assert all(models[e]["analyzed"] for e in EXPERTS)
    assert rows(db, "SELECT COUNT(*) AS n FROM analyses")[0]["n"] == 3
