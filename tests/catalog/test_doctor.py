"""`api.doctor` and the catalog's own checks: a corrupted page is caught on open (PRAGMA quick_check) and
by doctor (integrity_check); unfinished transactions, dead runs and stale staging directories are
reported as `recover` would handle them; registered models whose files changed are named. Doctor
changes nothing."""

from __future__ import annotations

import os
import shutil

import pytest

from mergepipe import api
from mergepipe.catalog import runs as runs_table
from mergepipe.catalog.db import QUICK_CHECK_MAX_BYTES, Catalog
from mergepipe.errors import CatalogError

from doctor_helpers import corrupt_page, doctor_family, make_catalog
from merge_helpers import dump_db


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return doctor_family(tmp_path_factory)


def test_healthy_catalog(family, tmp_path):
    db = make_catalog(family, tmp_path)
    before = dump_db(db)
    report = api.doctor(db)
    assert report == {"catalog": str(db), "findings": [], "healthy": True,
                      "checked": {"file": True, "transactions": True, "models": 3, "compacts": 0}}
    assert dump_db(db) == before


def test_corrupted_page_is_caught_on_open_and_by_doctor(family, tmp_path):
    db = make_catalog(family, tmp_path)
    assert db.stat().st_size <= QUICK_CHECK_MAX_BYTES
    corrupt_page(db)
    with pytest.raises(CatalogError, match=rf"catalog {db} is corrupted \(quick_check: .*mergepipe doctor --db {db}"):
        Catalog(db)
    report = api.doctor(db)
    assert not report["healthy"] and report["checked"]["transactions"] is False
    assert any(f"catalog {db} is corrupted" in f for f in report["findings"]), report
    assert all("\n" not in f for f in report["findings"])


def test_not_a_database(tmp_path):
    db = tmp_path / "c.sqlite"
    db.write_bytes(b"this is not sqlite at all" * 200)
    with pytest.raises(CatalogError, match="file is not a database"):
        Catalog(db)
    report = api.doctor(db)
    assert not report["healthy"] and "file is not a database" in report["findings"][0]


def test_missing_catalog_is_an_error(tmp_path):
    with pytest.raises(CatalogError, match="no catalog here"):
        api.doctor(tmp_path / "nope.sqlite")


def test_changed_and_missing_model_files(family, tmp_path):
    db = make_catalog(family, tmp_path, copy_models=True)
    e1 = tmp_path / "models" / family[1][0].name
    shard = sorted(e1.glob("*.safetensors"))[0]
    with open(shard, "ab") as fh:
        fh.write(b"\0" * 64)
    shutil.rmtree(tmp_path / "models" / family[1][1].name)
    report = api.doctor(db)
    assert not report["healthy"]
    assert len(report["findings"]) == 2, report["findings"]
    assert report["findings"][0].startswith("model e1: ") and str(e1) in report["findings"][0]
    assert report["findings"][1].startswith("model e2: ")
    assert report["checked"]["models"] == 3


def test_unfinished_transaction_dead_run_and_stale_staging(family, tmp_path):
    db = make_catalog(family, tmp_path)
    outs = tmp_path / "outs"
    outs.mkdir()
    staging = outs / ".m.mergepipe-staging-txn-dead"
    staging.mkdir()
    stray = outs / ".old.mergepipe-staging-txn-gone"
    stray.mkdir()
    dead = 2 ** 22 + 12345  # no such process
    cat = Catalog(db)
    with cat.transaction():
        runs_table.insert_txn(cat, "txn-dead", str(staging), str(outs / "m"), dead)
        runs_table.insert_txn(cat, "txn-gone", str(stray), str(outs / "old"), dead)
        runs_table.set_txn_status(cat, "txn-gone", "aborted")
        run_id = runs_table.insert_analyze_run(cat, ["e1"])
        runs_table.mark_run_running(cat, run_id, dead)
    cat.close()
    before = dump_db(db)
    findings = api.doctor(db)["findings"]
    assert dump_db(db) == before  # doctor changes nothing
    assert len(findings) == 3, findings
    assert findings[0].startswith("transaction txn-dead (staging") and f"remove {staging}" in findings[0]
    assert "`mergepipe recover` rolls it back" in findings[0]
    assert findings[1] == (f"run {run_id} is recorded as running but its process is gone: "
                           "`mergepipe recover` marks it failed")
    assert findings[2].startswith(f"stale staging directory {stray}")
    cat = Catalog(db)
    res = api.recover(cat)
    cat.close()
    assert res["rolled_back"] == ["txn-dead"] and res["failed_runs"] == [run_id]
    assert [f for f in api.doctor(db)["findings"]] == [findings[2]]
    stray.rmdir()
    assert api.doctor(db)["healthy"]


def test_transaction_of_a_live_process_is_no_finding(family, tmp_path):
    db = make_catalog(family, tmp_path)
    (tmp_path / ".m.mergepipe-staging-txn-live").mkdir()
    cat = Catalog(db)
    with cat.transaction():
        runs_table.insert_txn(cat, "txn-live", str(tmp_path / ".m.mergepipe-staging-txn-live"),
                              str(tmp_path / "m"), os.getppid())
    cat.close()
    assert api.doctor(db)["healthy"]
