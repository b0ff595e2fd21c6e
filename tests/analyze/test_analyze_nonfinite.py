"""ANALYZE counts non-finite deltas (issue 14): NaN/Inf planted in an expert or in the base are counted
exactly, per block and per tensor (and how many of them the base holds); the planner then refuses the
expert, naming the model, the tensor, its blocks and the count. The counts live in schema v4."""

from __future__ import annotations

import pytest

from mergepipe.analyze import kernels
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.errors import PlanError
from mergepipe.planner.context import Planner

from numeric_helpers import BLOCK, INF, NAN, TENSOR, block_of, per_block, plant, registered, small_family

DTYPES = ["fp32", "bf16", "fp16"]
# element -> value: two in one block, one in a later block, and a -Inf
PLANTED = {5: INF, 7: NAN, 4000: -INF}


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_in_expert_counted_per_block_and_refused(tmp_path, dtype):
    fam = small_family(tmp_path / "fam", dtype)
    plant(fam["experts"][0], TENSOR, PLANTED)
    cat = registered(tmp_path / "c.sqlite", fam)
    analyze(cat, block_bytes=BLOCK)
    expected: dict[int, int] = {}
    for i in PLANTED:
        b = block_of(fam["base"], TENSOR, i)
        expected[b] = expected.get(b, 0) + 1
    assert len(expected) == 2
    assert per_block(cat, "e1") == {b: (n, 0) for b, n in expected.items()}
    assert per_block(cat, "e2") == {}
    assert cat.query("SELECT nonfinite, base_nonfinite FROM tensor_stats WHERE model_id = 'e1' AND nonfinite > 0") \
        == [{"nonfinite": 3, "base_nonfinite": 0}]
    assert cat.query("SELECT SUM(nonfinite) AS n FROM blocks WHERE model_id = 'e1'")[0]["n"] == 3
    blocks = ",".join(str(b) for b in sorted(expected))
    with pytest.raises(PlanError) as exc:
        Planner(cat).plan("base", ["e1", "e2"], "ties", density=0.3, save=False)
    msg = str(exc.value)
    assert msg.startswith("expert 'e1' holds non-finite values (NaN/Inf): 3 NaN/Inf delta entries")
    assert f"{TENSOR}: 3 (blocks {blocks})" in msg and "refused" in msg
    # the healthy expert alone still plans
    Planner(cat).plan("base", ["e2"], "ties", density=0.3, save=False)
    cat.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nonfinite_in_base_counted_for_every_expert_and_names_the_base(tmp_path, dtype):
    fam = small_family(tmp_path / "fam", dtype)
    plant(fam["base"], TENSOR, {10: NAN, 11: INF})
    plant(fam["experts"][1], TENSOR, {11: INF})  # Inf - Inf: NaN, still counted
    cat = registered(tmp_path / "c.sqlite", fam)
    analyze(cat, block_bytes=BLOCK)
    b = block_of(fam["base"], TENSOR, 10)
    assert per_block(cat, "e1") == {b: (2, 2)}
    assert per_block(cat, "e2") == {b: (2, 2)}
    with pytest.raises(PlanError, match=rf"^base 'base' holds non-finite values \(NaN/Inf\) under expert 'e1': "
                                        rf"2 NaN/Inf delta entries, by tensor: {TENSOR}: 2 \(block {b}, 2 NaN/Inf "
                                        rf"in the base\)"):
        Planner(cat).plan("base", ["e1", "e2"], "linear", save=False)
    cat.close()


def test_kernel_counts_match_numpy_on_random_bits():
    """count_nonfinite (the rare second look) and the histogram count agree with numpy on every dtype."""
    import numpy as np
    rng = np.random.default_rng(3)
    for view, widen in ((np.uint16, lambda u: (u.astype(np.uint32) << 16).view(np.float32)),
                        (np.int16, lambda u: u.view(np.float16).astype(np.float32)),
                        (np.float32, lambda u: u)):
        raw = rng.integers(0, 2**32, size=5000, dtype=np.uint32).view(np.float32)
        x = raw.view(view)[:5000].copy() if view is not np.float32 else raw.copy()
        truth = int((~np.isfinite(widen(x))).sum())
        assert truth > 0
        assert kernels.count_nonfinite(x) == truth
        hist = np.zeros((4, 1 << 16), dtype=np.int32)
        keys = np.empty(0, dtype=np.uint32)
        kernels.block_stats(x, None, hist, keys, 0)
        assert kernels.nonfinite_in_hist(hist) == truth


def test_v3_catalog_is_migrated_to_v4(tmp_path):
    db = tmp_path / "old.sqlite"
    cat = Catalog(db)
    for table in ("blocks", "tensor_stats"):
        for col in ("nonfinite", "base_nonfinite"):
            cat.conn.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    cat.conn.execute("INSERT INTO tensor_stats (model_id, tensor, numel, delta_nnz) VALUES ('e', 't', 4, 1)")
    cat.conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    cat.close()
    cat = Catalog(db)
    assert SCHEMA_VERSION >= 4  # migrated to the current version, through v4
    assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION)
    for table in ("blocks", "tensor_stats"):
        assert {"nonfinite", "base_nonfinite"} <= {c[1] for c in cat.conn.execute(f"PRAGMA table_info({table})")}
    assert cat.query("SELECT nonfinite, base_nonfinite FROM tensor_stats") == [{"nonfinite": 0, "base_nonfinite": 0}]
    cat.close()
