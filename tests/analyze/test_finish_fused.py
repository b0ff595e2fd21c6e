"""The compiled end of a tensor pass (analyze/finish.py) against the general path it stands in for
(thresholds.kth_largest_thresholds, KeySelection, SecondPass.tie_cuts): every stored statistic equal, byte
for byte, on bf16 (ties at almost every cut-off), fp16 and fp32 families, several grids and densities."""

from __future__ import annotations

import pytest

from mergepipe.analyze import stats as analyze_mod
from mergepipe.api import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family


def _tables(cat: Catalog) -> dict:
    out = {}
    for table in ("tensor_stats", "blocks"):
        out[table] = cat.conn.execute(f"SELECT * FROM {table} ORDER BY model_id, tensor"
                                      + (", block" if table == "blocks" else "")).fetchall()
    return out


def _analyzed(fam, path, block, densities, fused: bool, monkeypatch) -> tuple[dict, dict]:
    calls = {"fused": 0, "general": 0}
    real = analyze_mod._TensorPass._fused_select

    def counted(self, hist):
        texts = real(self, hist)
        calls["fused" if texts is not None else "general"] += 1
        return texts

    with monkeypatch.context() as m:
        m.setattr(analyze_mod._TensorPass, "_fused_select", counted)
        if not fused:
            m.setattr(analyze_mod._TensorPass, "_fusable", lambda self: False)
        cat = Catalog(path)
        register(cat, "base", fam["base"])
        for i, e in enumerate(fam["experts"]):
            register(cat, f"e{i}", e, base_id="base")
        kwargs = {"densities": densities} if densities else {}
        analyze(cat, block_bytes=block, **kwargs)
        out = _tables(cat)
        cat.close()
    return out, calls


@pytest.mark.parametrize("dtype,block,densities", [
    ("bf16", 4096, None), ("bf16", 1 << 20, (0.0001, 0.37, 0.5, 0.999, 1.0)), ("fp16", 3000, None),
    ("fp32", 8192, None), ("fp32", 1 << 20, (0.25, 1.0)),
])
def test_fused_finish_equals_the_general_path(tmp_path, monkeypatch, dtype, block, densities):
    fam = make_family(tmp_path / "fam", experts=2, size="tiny", dtype=dtype, shard_bytes=1 << 30, seed=4)
    fused, calls = _analyzed(fam, tmp_path / "a.sqlite", block, densities, True, monkeypatch)
    general, _ = _analyzed(fam, tmp_path / "b.sqlite", block, densities, False, monkeypatch)
    assert calls["fused"] > 0
    assert calls["general"] == 0  # every tensor of these families is the common case
    assert fused == general
