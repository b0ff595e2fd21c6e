"""ANALYZE's per-tensor Gram statistics (analyze/gram.py, catalog/gram.py): ||base||^2, <base, delta_i>,
<delta_i, delta_j> of the experts analyzed together, in its single pass; equal to a float64 computation
over mergekit's float32 deltas; pairs dropped when one expert is re-analyzed alone; a v4 catalog migrates."""

from __future__ import annotations

import sqlite3

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.gram import load_gram
from mergepipe.catalog.schema import SCHEMA_VERSION

from merge_helpers import load_dir, open_copy, shared_family


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


def test_gram_equals_float64_of_float32_deltas(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    try:
        ids = fam.expert_ids
        assert load_gram(cat, "base", ids) == {}  # opt-in: the template was analyzed without --gram
        analyze(cat, ids, gram=True, block_bytes=fam.spec.block_bytes)
        gram = load_gram(cat, "base", ids)
        base = load_dir(fam.base)
        xs = [load_dir(p) for p in fam.experts[:len(ids)]]
        assert set(gram) == set(base)
        for name, b in base.items():
            b32 = b.float()
            deltas = [(x[name].float() - b32).double().reshape(-1) for x in xs]
            rows = gram[name]
            bb = float(b32.double().reshape(-1) @ b32.double().reshape(-1))
            assert rows[("", "")] == pytest.approx(bb, rel=1e-12, abs=1e-12)
            for i, e in enumerate(ids):
                assert rows[("", e)] == pytest.approx(float(b32.double().reshape(-1) @ deltas[i]), rel=1e-9, abs=1e-12)
                for j, f in enumerate(ids):
                    key = tuple(sorted((e, f)))
                    assert rows[key] == pytest.approx(float(deltas[i] @ deltas[j]), rel=1e-9, abs=1e-12)
        # re-analyzing one expert alone drops its pairs with the others (they need a joint run)
        analyze(cat, [ids[0]], gram=True, block_bytes=fam.spec.block_bytes)
        gram = load_gram(cat, "base", ids)
        some = next(iter(gram.values()))
        assert tuple(sorted((ids[0], ids[1]))) not in some and (ids[0], ids[0]) in some
        assert tuple(sorted((ids[1], ids[2]))) in some
        # re-analyzing without --gram drops the expert's stale rows and stores none
        analyze(cat, [ids[1]], force=True, block_bytes=fam.spec.block_bytes)
        some = next(iter(load_gram(cat, "base", ids).values()))
        assert not any(ids[1] in key for key in some) and (ids[0], ids[0]) in some
    finally:
        cat.close()


def test_v4_catalog_migrates_to_the_gram_table(tmp_path):
    db = tmp_path / "old.sqlite"
    Catalog(db).close()
    conn = sqlite3.connect(db)
    conn.execute("DROP TABLE gram")
    conn.execute("ALTER TABLE tensor_stats DROP COLUMN topk")  # what v5 adds
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    cat = Catalog(db)
    try:
        assert cat.conn.execute("SELECT COUNT(*) FROM gram").fetchone()[0] == 0
        assert cat.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    finally:
        cat.close()
