"""Catalog schema v12: tensor_stats' thresholds and topk JSON stored packed (zlib, catalog/packed.py) and the
Gram table WITHOUT ROWID. A v11 catalog (plain-text JSON, a rowid Gram table) migrates in place, keeps its
rows, and plans exactly as before (same digests)."""

from __future__ import annotations

import json

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.gram import load_gram
from mergepipe.catalog.packed import pack, unpack
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.planner.context import Planner

from merge_helpers import open_copy, shared_family

OLD_GRAM = ("CREATE TABLE gram (base_id TEXT NOT NULL, tensor TEXT NOT NULL, a TEXT NOT NULL, b TEXT NOT NULL, "
            "value REAL, PRIMARY KEY (base_id, tensor, a, b))")


def _digests(cat: Catalog) -> list[str]:
    experts = [r["id"] for r in cat.models() if r["base_id"]]
    return [Planner(cat).plan("base", experts, op, budget=b, density=0.5, save=False).digest
            for op in ("ties", "breadcrumbs", "linear") for b in ("30%", "100%")]


def _gram_sql(cat: Catalog) -> str:
    return cat.conn.execute("SELECT sql FROM sqlite_master WHERE name = 'gram'").fetchone()[0]


def test_pack_round_trips_text_and_reads_plain_text():
    text = json.dumps({"0.1": 0.25, "0.2": [1, 2, 3.5]})
    assert isinstance(pack(text), bytes) and len(pack(text * 50)) < len(text * 50) / 3
    assert unpack(pack(text)) == text and unpack(text) == text and unpack(None) is None and pack(None) is None


def test_new_catalog_stores_packed_statistics(tmp_path, tmp_path_factory):
    cat = open_copy(shared_family(tmp_path_factory, "tiny-fp32"), tmp_path / "c.sqlite")
    try:
        kinds = {r[0] for r in cat.conn.execute("SELECT typeof(thresholds) FROM tensor_stats")}
        assert kinds == {"blob"}  # the shared family is analyzed by this MergePipe
        assert "WITHOUT ROWID" in _gram_sql(cat)
        stats = cat.tensor_stats("e1")
        assert all(isinstance(s["thresholds"], dict) for s in stats.values())
        assert any(s["thresholds"] for s in stats.values())
        assert all(s["topk"] is None or isinstance(s["topk"], str) for s in stats.values())
    finally:
        cat.close()


def test_v11_catalog_migrates_and_plans_the_same(tmp_path, tmp_path_factory):
    db = tmp_path / "old.sqlite"
    cat = open_copy(shared_family(tmp_path_factory, "tiny-fp32"), db)
    before = _digests(cat)
    rows = cat.conn.execute("SELECT model_id, tensor, thresholds, topk FROM tensor_stats").fetchall()
    # back to v11: plain-text JSON, a rowid Gram table holding a row
    for mid, tensor, thr, topk in rows:
        cat.conn.execute("UPDATE tensor_stats SET thresholds = ?, topk = ? WHERE model_id = ? AND tensor = ?",
                         [unpack(thr), unpack(topk), mid, tensor])
    cat.conn.execute("DROP TABLE gram")
    cat.conn.execute(OLD_GRAM)
    cat.conn.execute("INSERT INTO gram VALUES ('base', 't', 'e1', 'e2', 1.5)")
    cat.conn.execute("UPDATE meta SET value = '11' WHERE key = 'schema_version'")
    cat.conn.commit()
    assert {r[0] for r in cat.conn.execute("SELECT typeof(thresholds) FROM tensor_stats")} == {"text"}
    assert _digests(cat) == before  # plain text reads as packed does
    cat.close()
    cat = Catalog(db)
    try:
        assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION)
        assert "WITHOUT ROWID" in _gram_sql(cat)
        assert load_gram(cat, "base", ["e1", "e2"]) == {"t": {("e1", "e2"): 1.5}}  # packed from v13 on
        assert _digests(cat) == before
    finally:
        cat.close()


def test_members_reads_a_part_of_a_packed_object():
    from mergepipe.catalog.packed import members
    table = {str(round(0.01 * i, 2)): [i, i + 0.5, 1e-7 * i] for i in range(1, 101)}
    text = json.dumps(table)
    for value in (text, pack(text)):
        assert json.loads(members(value, ["0.2"])) == {"0.2": table["0.2"]}
        assert json.loads(members(value, ["0.03", "1.0"])) == {"0.03": table["0.03"], "1.0": table["1.0"]}
        assert members(value, ["0.205"]) is None
    numbers = json.dumps({"0.1": 0.5, "0.2": float("inf")})
    assert json.loads(members(pack(numbers), ["0.2"])) == {"0.2": float("inf")}
    assert members(json.dumps({"0.1": [[1, 2]]}), ["0.1"]) is None  # not a flat list: read whole
    assert members(None, ["0.1"]) is None
