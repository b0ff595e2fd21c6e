"""`mergepipe delete SNAP [--force]`: files and catalog rows go, all or nothing; refused while another
model's lineage needs the snapshot, unless forced. Tags and notes (schema v5)."""

from __future__ import annotations

import json

import pytest

from dashboard_helpers import build_catalog, copy_catalog
from mergepipe.api import delete_snapshot, set_snapshot_labels, snapshot_labels
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.cli.app import main
from mergepipe.errors import CatalogError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("delete"))


@pytest.fixture
def db(built, tmp_path):
    import shutil
    shutil.copytree(built.merged, tmp_path / "m1")  # a private copy of the snapshot's folder
    path = copy_catalog(built.db, tmp_path / "c.sqlite")
    cat = Catalog(path)
    cat.conn.execute("UPDATE snapshots SET out = ?", [str(tmp_path / "m1")])
    cat.conn.commit()
    cat.close()
    return path


def test_delete_removes_files_and_rows(db, built, tmp_path, capsys):
    cat = Catalog(db)
    set_snapshot_labels(cat, built.snapshot_id, ["keep", "ties"], "first try")
    cat.close()
    rc = main(["--db", str(db), "delete", built.snapshot_id])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith(f"deleted {built.snapshot_id} (merged-1) and {tmp_path / 'm1'}"), (out, err)
    assert not (tmp_path / "m1").exists() and not list(tmp_path.glob(".m1.deleting-*"))
    cat = Catalog(db)
    assert cat.query("SELECT * FROM snapshots") == [] and cat.query("SELECT * FROM manifests") == []
    assert not cat.has_model("merged-1") and cat.query("SELECT * FROM lineage WHERE child_id = 'merged-1'") == []
    assert cat.query("SELECT * FROM tensors WHERE model_id = 'merged-1'") == []
    assert snapshot_labels(cat) == {}
    assert cat.has_model("expert_1")  # its inputs stay
    cat.close()
    assert main(["--db", str(db), "delete", built.snapshot_id]) == 2
    assert "unknown snapshot" in capsys.readouterr().err


def test_delete_refused_while_needed_unless_forced(db, built, tmp_path, capsys):
    cat = Catalog(db)
    register(cat, "child", str(built.family / "expert_1"), base_id="merged-1")
    cat.close()
    rc = main(["--db", str(db), "delete", "merged-1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "needed by child" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "m1").is_dir() and Catalog(db).has_model("merged-1")  # nothing changed
    rc = main(["--db", str(db), "--json", "delete", "merged-1", "--force"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["dependents"] == ["child"] and res["removed_files"]
    assert not (tmp_path / "m1").exists()


def test_delete_failure_keeps_the_folder(db, built, tmp_path, monkeypatch):
    import mergepipe.engine.delete as d

    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(d, "delete_snapshot_rows", boom)
    cat = Catalog(db)
    with pytest.raises(RuntimeError):
        delete_snapshot(cat, built.snapshot_id)
    assert (tmp_path / "m1" / "mergepipe_manifest.json").is_file() and cat.has_model("merged-1")
    cat.close()


def test_labels_and_schema(db, built):
    assert SCHEMA_VERSION >= 7  # snapshot_labels came with v7
    cat = Catalog(db)
    set_snapshot_labels(cat, built.snapshot_id, ["a"], "n1")
    set_snapshot_labels(cat, built.snapshot_id, ["a", "b"], "n2")
    assert snapshot_labels(cat) == {built.snapshot_id: {"tags": ["a", "b"], "note": "n2"}}
    with pytest.raises(CatalogError, match="unknown snapshot"):
        set_snapshot_labels(cat, "snap-nope", [], "")
    cat.close()


def test_v4_catalog_gets_the_labels_table(tmp_path):
    db = tmp_path / "old.sqlite"
    cat = Catalog(db)
    cat.conn.execute("DROP TABLE snapshot_labels")
    cat.conn.execute("DROP TABLE evaluations")
    cat.conn.execute("DROP TABLE gram")  # what v6 adds
    cat.conn.execute("ALTER TABLE tensor_stats DROP COLUMN topk")  # what v5 adds
    cat.conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    cat.conn.commit()
    cat.close()
    cat = Catalog(db)
    assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION)
    assert cat.query("SELECT * FROM snapshot_labels") == []
    cat.close()


def test_evaluate_stores_and_reuses(db, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["--db", str(db), "--json", "evaluate", "base", "merged-1", "--text", str(text)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert [r["model_id"] for r in first] == ["base", "merged-1"] and not any(r["cached"] for r in first)
    assert all(r["perplexity"] > 1 and r["tokens"] > 10 for r in first)
    assert main(["--db", str(db), "--json", "evaluate", "merged-1", "--text", str(text)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again[0]["cached"] and again[0]["perplexity"] == pytest.approx(first[1]["perplexity"])
    cat = Catalog(db)
    from mergepipe.api import evaluations
    assert {e["model_id"] for e in evaluations(cat)} == {"base", "merged-1"}
    cat.close()
    assert main(["--db", str(db), "delete", "merged-1"]) == 0  # its results go with it
    capsys.readouterr()
    cat = Catalog(db)
    assert {e["model_id"] for e in evaluations(cat)} == {"base"}
    cat.close()
    assert main(["--db", str(db), "evaluate", "base", "--text", str(tmp_path / "nope.txt")]) == 2
    assert "is not a file" in capsys.readouterr().err
