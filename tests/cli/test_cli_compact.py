"""The compact tier from the command line and configs: `analyze --compact`, `plan`/`merge --compact CODEC` and
`--no-compact`, `mergepipe: compact:` in a YAML config, EXPLAIN's tier lines, the merge summary's budget used,
a first merge storing compacts on the way, and refusals as one `error:` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.catalog import compacts
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family

from merge_helpers import run_cli

BLOCK = 8192


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("clifam")
    return make_family(root / "fam", experts=3, size="tiny", dtype="bf16", shard_bytes=32 << 10, seed=9)


def catalog(tmp_path, fam) -> str:
    db = tmp_path / "c.sqlite"
    cat = Catalog(db)
    register(cat, "base", fam["base"])
    for i, e in enumerate(fam["experts"], start=1):
        register(cat, f"e{i}", e, base_id="base")
    cat.close()
    return str(db)


def cli(db, *args, ok=True):
    res = run_cli(["--db", db, *args])
    assert (res.returncode == 0) == ok, res.stderr
    return res


MERGE = ["--base", "base", "--experts", "e1", "e2", "e3", "--op", "ties", "--density", "0.5"]


def test_plan_and_merge_tiers_from_the_cli(tmp_path, fam):
    db = catalog(tmp_path, fam)
    cli(db, "analyze", "--block-bytes", str(BLOCK), "--compact")
    tiered = json.loads(cli(db, "--json", "plan", *MERGE, "--budget", "10%").stdout)
    assert tiered["estimated"]["compact_read"] > 0
    assert tiered["estimated"]["expert_read"] + tiered["estimated"]["compact_read"] <= tiered["budget_bytes"]
    assert tiered["tiers"]["compact"]["blocks"] > 0 and tiered["error_bound"]["kind"] == "sparsified"
    off = json.loads(cli(db, "--json", "plan", *MERGE, "--budget", "10%", "--no-compact").stdout)
    assert off["estimated"]["compact_read"] == 0 and off["plan_id"] != tiered["plan_id"]
    q2 = json.loads(cli(db, "--json", "plan", *MERGE, "--budget", "10%", "--compact", "q2").stdout)
    assert set(q2["tiers"]["compact"]["by_bits"]) == {"2"}
    text = cli(db, "plan", *MERGE, "--budget", "25%").stdout
    assert "  tiers      exact " in text and "compact read" in text and "~4:" in text
    out = tmp_path / "m"
    summary = json.loads(cli(db, "--json", "merge", *MERGE, "--budget", "10%", "--out", str(out)).stdout)
    real = summary["realized"]
    assert real["compact_read"] == summary["estimated"]["compact_read"] > 0
    assert summary["budget_used_pct"] == pytest.approx(
        100 * (real["expert_read"] + real["compact_read"]) / summary["full_expert_bytes"], abs=0.01)
    assert summary["budget_used_pct"] <= 10
    text = cli(db, "merge", *MERGE, "--budget", "10%", "--out", str(tmp_path / "m2")).stdout
    assert "+ compact" in text and "(budget 10% = " in text
    assert cli(db, "verify", "m").returncode == 0


def test_first_merge_stores_compacts_on_the_way_and_reports_the_budget_used(tmp_path, fam):
    db = catalog(tmp_path, fam)
    text = cli(db, "merge", *MERGE, "--budget", "10%", "--compact", "q4", "--out", str(tmp_path / "first")).stdout
    assert "(first merge: read in full, 100 %; the 10% asked for applies from the next merge)" in text
    cat = Catalog(db)
    assert {r["model_id"]: r["codec"] for r in compacts.compact_rows(cat)} == {"e1": "q4", "e2": "q4", "e3": "q4"}
    cat.close()
    plan = json.loads(cli(db, "--json", "plan", *MERGE, "--budget", "10%").stdout)
    assert set(plan["tiers"]["compact"]["by_bits"]) == {"4"} and plan["estimated"]["compact_read"] > 0


def test_failed_first_merge_stores_no_compact(tmp_path, fam):
    db = catalog(tmp_path, fam)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    res = cli(db, "merge", *MERGE, "--compact", "q4", "--out", str(tmp_path / "taken"), ok=False)
    assert res.stderr.startswith("error:")
    cat = Catalog(db)
    assert compacts.compact_rows(cat) == []
    folder = compacts.compact_dir(cat)
    assert not folder.exists() or list(folder.iterdir()) == []
    cat.close()


def test_config_compact_key_and_refusals(tmp_path, fam):
    db = catalog(tmp_path, fam)
    cli(db, "analyze", "--block-bytes", str(BLOCK), "--compact", "sign1")
    cfg = tmp_path / "m.yml"
    cfg.write_text(f"merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: e1\n  - model: e2\n"
                   f"mergepipe:\n  budget: 10%\n  compact: 'off'\n")
    off = json.loads(cli(db, "--json", "plan", "--config", str(cfg)).stdout)
    assert off["estimated"]["compact_read"] == 0
    cfg.write_text(cfg.read_text().replace("'off'", "sign1"))
    on = json.loads(cli(db, "--json", "plan", "--config", str(cfg)).stdout)
    assert set(on["tiers"]["compact"]["by_bits"]) == {"1"}
    assert on["error_bound"]["absolute"] < off["error_bound"]["absolute"]
    cfg.write_text(cfg.read_text().replace("sign1", "q9"))
    bad = cli(db, "plan", "--config", str(cfg), ok=False)
    assert bad.stderr.splitlines() == ["error: m.yml: mergepipe.compact 'q9' is unknown (choose from auto, off, sign1, q2, q4, "
                                       "progressive)"]
    bad = cli(db, "plan", *MERGE, "--budget", "10%", "--compact", "q4", ok=False)
    assert bad.stderr.splitlines()[-1] == ("error: --compact q4: the compacts of e1 hold 1 bit(s) per entry (sign1); "
                                           "run `mergepipe analyze --compact q4 --force e1`")
