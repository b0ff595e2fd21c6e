"""Catalog schema v13: the Gram table packed, one row per (base, tensor, a) holding a's values against every b
(catalog/gram.py). A v12 catalog (one row per pair) migrates in place and reads the same values, bit for bit,
and plans the same; ANALYZE --gram adds experts later (pairs analyzed together at different times all stay
readable), a re-analysis replaces an expert's pairs and one without --gram deletes them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.gram import (load_arcee_thresholds, load_gram, load_gram_diagonal, load_gram_matrices,
                                    load_sce_selection, load_set_counts, replace_gram, sce_row_keys, set_key, unpack)
from mergepipe.catalog.schema import GRAM_V12_COLUMNS, SCHEMA_VERSION
from mergepipe.errors import PlanError

from merge_helpers import open_copy, shared_family

GRAM_OPS = ("model_stock", "karcher", "multislerp", "sce", "ramplus_tl")


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


def _v12_rows(cat: Catalog) -> list[tuple]:
    """The packed table as the v12 table's rows (base_id, tensor, a, b, value)."""
    return [(base, tensor, a, b, v) for base, tensor, a, bs, value in
            cat.conn.execute("SELECT base_id, tensor, a, b, value FROM gram ORDER BY base_id, tensor, a").fetchall()
            for b, v in unpack(bs, value).items()]


def _to_v12(cat: Catalog, rows: list[tuple]) -> None:
    """Back to schema v12: the Gram table one row per pair, holding ``rows``."""
    cat.conn.execute("DROP TABLE gram")
    cat.conn.execute(f"CREATE TABLE gram ({GRAM_V12_COLUMNS}) WITHOUT ROWID")
    cat.conn.executemany("INSERT INTO gram VALUES (?, ?, ?, ?, ?)", rows)
    cat.conn.execute("UPDATE meta SET value = '12' WHERE key = 'schema_version'")
    cat.conn.commit()


def _by_rows(rows: list[tuple], base: str, ids: list[str]) -> dict:
    """The matrices load_gram_matrices gave in v12: each row in primary-key order, m[i, j] = m[j, i] = value."""
    pos = {"": 0, **{e: i + 1 for i, e in enumerate(ids)}}
    out = {}
    for b_id, tensor, a, b, value in sorted(rows, key=lambda r: r[:4]):
        if b_id == base and a in pos and b in pos:
            m = out.setdefault(tensor, np.full((len(pos), len(pos)), np.nan))
            m[pos[a], pos[b]] = m[pos[b], pos[a]] = np.nan if value is None else value
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[t].tobytes() == b[t].tobytes() for t in a)


def _plans(cat: Catalog, ids: list[str]) -> dict:
    """Each Gram operator's plan (digest and JSON) or refusal (multislerp: a tensor no expert changes)."""
    cases = [(op, ids, budget, {}) for op in GRAM_OPS for budget in ("50%", "100%")]
    cases += [("nuslerp", ids[:2], "100%", {}), ("sce", ids, "100%", {"select_topk": 0.5}),
              ("arcee_fusion", ids[:1], "100%", {}), ("arcee_fusion", ids[:1], "50%", {})]
    out = {}
    for op, experts, budget, settings in cases:
        try:
            p = api.plan(cat, api.merge_request("base", experts, op, budget=budget, **settings), save=False)
            out[op, budget, str(settings)] = (p.digest, p.to_json())
        except PlanError as exc:
            out[op, budget, str(settings)] = ("refused", str(exc))
    assert sum(v[0] != "refused" for v in out.values()) >= len(cases) - 2
    return out


def _reads(cat: Catalog, ids: list[str]) -> dict:
    key = set_key(ids)
    out = {"counts": load_set_counts(cat, "base", key), "sce": load_sce_selection(cat, "base", sce_row_keys(0.5, key)),
           "arcee": load_arcee_thresholds(cat, "base", ids[0])}
    for order in (ids, ids[::-1], ids[:2], ids[1:]):
        out["rows", *order] = load_gram(cat, "base", order)
        out["mat", *order] = {t: m.tobytes() for t, m in load_gram_matrices(cat, "base", order).items()}
        diag, complete = load_gram_diagonal(cat, "base", order)
        out["diag", *order] = ({t: m.tobytes() for t, m in diag.items()}, complete)
    return out


def test_new_catalog_is_v13_packed(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    try:
        ids = fam.expert_ids
        analyze(cat, ids, gram=True, block_bytes=fam.spec.block_bytes)
        assert cat.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        assert SCHEMA_VERSION == 13
        tensors, rows = cat.conn.execute("SELECT COUNT(DISTINCT tensor), COUNT(*) FROM gram").fetchone()
        # per tensor: the base's row, one per expert, ramplus_tl's shared and unique rows
        assert rows == tensors * (1 + len(ids) + 2)
        kinds = set(cat.conn.execute("SELECT typeof(b), typeof(value) FROM gram").fetchall())
        assert kinds == {("text", "blob")}
        pairs = sum(len(v) for v in load_gram(cat, "base", ids).values())
        assert pairs == tensors * (len(ids) + 1) * (len(ids) + 2) // 2
    finally:
        cat.close()


def test_v12_catalog_migrates_and_reads_the_same(fam, tmp_path):
    db = tmp_path / "old.sqlite"
    cat = open_copy(fam, db)
    ids = fam.expert_ids
    analyze(cat, ids, gram=True, arcee=True, sce_topk=(0.5,), block_bytes=fam.spec.block_bytes)
    plans, reads = _plans(cat, ids), _reads(cat, ids)
    rows = _v12_rows(cat)
    assert reads["arcee"] and reads["sce"] and reads["counts"]
    _to_v12(cat, rows)
    assert cat.conn.execute("SELECT COUNT(*) FROM gram").fetchone()[0] == len(rows) > 100
    cat.close()
    cat = Catalog(db)
    try:
        assert cat.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "13"
        assert _v12_rows(cat) == rows
        for order in (ids, ids[::-1], ids[:2]):
            assert _same(load_gram_matrices(cat, "base", order), _by_rows(rows, "base", order))
        assert _reads(cat, ids) == reads
        assert _plans(cat, ids) == plans
    finally:
        cat.close()


def test_v12_odd_rows_migrate(fam, tmp_path):
    """What a v12 table may hold beside ANALYZE's rows: a NULL value, a pair stored as a > b (read after the
    a < b one: it wins), another base, -0.0 (SQLite stored 0.0)."""
    db = tmp_path / "old.sqlite"
    cat = open_copy(fam, db)
    ids = fam.expert_ids
    analyze(cat, ids, gram=True, block_bytes=fam.spec.block_bytes)
    rows = _v12_rows(cat)
    tensor = rows[0][1]
    odd = [("base", tensor, "e9", "e8", None), ("base", tensor, ids[1], ids[0], 7.25),
           ("other", tensor, "", "", 3.5), ("other", tensor, "", ids[0], -0.0)]
    _to_v12(cat, rows + odd)
    cat.close()
    cat = Catalog(db)
    try:
        old = rows + [(*r[:4], 0.0) if r[4] == 0.0 else r for r in odd]
        assert sorted(_v12_rows(cat), key=lambda r: r[:4]) == sorted(old, key=lambda r: r[:4])
        for order in (ids, ids[::-1], ids[:2], [*ids, "e8", "e9"]):
            assert _same(load_gram_matrices(cat, "base", order), _by_rows(old, "base", order))
        got = load_gram_matrices(cat, "base", ids)[tensor]
        assert got[1, 2] == got[2, 1] == 7.25
        assert load_gram(cat, "base", ["e8", "e9"])[tensor] == {("", ""): load_gram(cat, "base", [])[tensor][("", "")],
                                                                ("e9", "e8"): None}
        other = load_gram(cat, "other", ids)
        assert other == {tensor: {("", ""): 3.5, ("", ids[0]): 0.0}}
        assert str(other[tensor][("", ids[0])]) == "0.0"
        _, complete = load_gram_diagonal(cat, "base", ids)
        assert tensor not in complete and len(complete) > 1  # a pair stored as a > b: not complete
    finally:
        cat.close()


def _job(expert: str, gram: dict, base: str = "base"):
    return SimpleNamespace(expert_id=expert, base={"id": base}, gram=gram)


def _store(cat: Catalog, jobs) -> None:
    with cat.transaction():
        replace_gram(cat, jobs)


def _gram_rows(ids: list[str], scale: float) -> list[tuple]:
    """Made-up Gram rows of experts analyzed together (values from their names and ``scale``)."""
    rows = [("", "", scale)] + [("", e, scale + int(e[1:])) for e in ids]
    rows += [(a, b, scale * int(a[1:]) * int(b[1:])) for i, a in enumerate(sorted(ids)) for b in sorted(ids)[i:]]
    rows += [(f"~shared:{set_key(ids)}", e, 1.0) for e in ids]
    return rows


def test_experts_added_later_replaced_and_deleted(tmp_path):
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        first = ["e1", "e2"]
        _store(cat, [_job(e, {"t1": _gram_rows(first, 1.0), "t2": _gram_rows(first, 2.0)}) for e in first])
        assert load_gram(cat, "base", first)["t1"] == {("", ""): 1.0, ("", "e1"): 2.0, ("", "e2"): 3.0,
                                                       ("e1", "e1"): 1.0, ("e1", "e2"): 2.0, ("e2", "e2"): 4.0}
        # e3 and e4 analyzed together later: the pairs of e1 and e2 stay, and the base's values are the last run's
        later = ["e3", "e4"]
        _store(cat, [_job(e, {"t1": _gram_rows(later, 10.0)}) for e in later])
        got = load_gram(cat, "base", first + later)
        assert got["t1"][("e1", "e2")] == 2.0 and got["t1"][("e3", "e4")] == 120.0
        assert got["t1"][("", "e1")] == 2.0 and got["t1"][("", "e4")] == 14.0 and got["t1"][("", "")] == 10.0
        assert ("e1", "e3") not in got["t1"] and got["t2"][("e1", "e2")] == 4.0 and ("", "e3") not in got["t2"]
        m = load_gram_matrices(cat, "base", ["e1", "e2", "e3"])["t1"]
        assert np.isnan(m[1, 3]) and m[1, 2] == m[2, 1] == 2.0 and m[3, 3] == 90.0
        # analyzed again together with e3: e1 and e2's pairs replaced, e3's pairs with e4 dropped (e4 was not in it)
        again = ["e1", "e2", "e3"]
        _store(cat, [_job(e, {"t1": _gram_rows(again, 3.0)}) for e in again])
        got = load_gram(cat, "base", first + later)
        assert got["t1"][("e1", "e2")] == 6.0 and got["t1"][("e1", "e3")] == 9.0 and got["t1"][("e4", "e4")] == 160.0
        assert ("e3", "e4") not in got["t1"] and got["t1"][("", "e4")] == 14.0
        assert "t2" not in got or not any("e1" in k or "e2" in k for k in got["t2"])
        matrices = load_gram_matrices(cat, "base", again)
        assert not np.isnan(matrices["t1"]).any()
        diag, complete = load_gram_diagonal(cat, "base", again)
        assert complete == {"t1"} and diag["t1"][3, 3] == 27.0 and np.isnan(diag["t1"][1, 2])
        assert load_set_counts(cat, "base", set_key(again)) == {"t1": {e: (1.0, 0.0) for e in again}}
        assert load_set_counts(cat, "base", set_key(later)) == {"t1": {"e4": (1.0, 0.0)}}
        # re-analyzed without --gram: every pair of e4 is gone, rows left without a pair deleted
        _store(cat, [_job("e4", {})])
        got = load_gram(cat, "base", ["e1", "e2", "e3", "e4"])
        assert not any("e4" in k for per in got.values() for k in per)
        assert load_set_counts(cat, "base", set_key(later)) == {}
        rows = cat.conn.execute("SELECT tensor, a FROM gram ORDER BY tensor, a").fetchall()
        assert ("t1", "e4") not in rows and ("t1", f"~shared:{set_key(later)}") not in rows
        for e in again:
            _store(cat, [_job(e, {})])
        # left: ||base||^2 (no expert in it), as the v12 table kept its ('', '') rows
        assert load_gram(cat, "base", again) == {"t1": {("", ""): 3.0}, "t2": {("", ""): 2.0}}
        assert cat.conn.execute("SELECT COUNT(*) FROM gram").fetchone()[0] == 2
    finally:
        cat.close()


def test_analyze_gram_adds_experts_later(fam, tmp_path):
    """ANALYZE --gram of e1 e2, later of e1 e2 e3: every pair readable, the same values as one run of all three;
    e3 re-analyzed alone keeps e1 and e2's pair; without --gram deletes its own."""
    ids = fam.expert_ids
    once = open_copy(fam, tmp_path / "once.sqlite")
    later = open_copy(fam, tmp_path / "later.sqlite")
    try:
        analyze(once, ids, gram=True, block_bytes=fam.spec.block_bytes)
        analyze(later, ids[:2], gram=True, block_bytes=fam.spec.block_bytes)
        first = load_gram_matrices(later, "base", ids[:2])
        assert first and not any(np.isnan(m).any() for m in first.values())
        analyze(later, ids, gram=True, block_bytes=fam.spec.block_bytes)
        assert _same(load_gram_matrices(later, "base", ids), load_gram_matrices(once, "base", ids))
        assert not any(np.isnan(m).any() for m in load_gram_matrices(later, "base", ids).values())
        for op in ("model_stock", "karcher", "sce"):
            req = api.merge_request("base", ids, op, budget="100%")
            assert api.plan(later, req, save=False).digest == api.plan(once, req, save=False).digest
        analyze(later, ids[2:], gram=True, block_bytes=fam.spec.block_bytes)
        some = next(iter(load_gram(later, "base", ids).values()))
        assert tuple(sorted(ids[:2])) in some and (ids[2], ids[2]) in some and tuple(sorted(ids[1:])) not in some
        analyze(later, ids[2:], force=True, block_bytes=fam.spec.block_bytes)
        assert not any(ids[2] in key for per in load_gram(later, "base", ids).values() for key in per)
    finally:
        once.close()
        later.close()
