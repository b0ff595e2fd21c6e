"""Sign sketches: the stored blobs estimate per-block sign-conflict rate and cosine between two experts'
deltas within MAE <= 0.02 and p95 <= 0.05 of the exact values computed on the full block deltas."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import Family, load_checkpoint_tensors, register_family, to_np32
from mergepipe.catalog import sketch
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.research.family import make_family
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES


# --- unit behaviour ------------------------------------------------------------------------------
def test_sample_positions_are_fixed_sorted_and_unique():
    p = sketch.sample_positions(100_000, 2048)
    assert p.shape == (2048,) and p.dtype == np.int64
    assert np.array_equal(p, np.sort(p)) and np.unique(p).size == 2048
    assert int(p.min()) >= 0 and int(p.max()) < 100_000
    sketch.sample_positions.cache_clear()
    assert np.array_equal(sketch.sample_positions(100_000, 2048), p)  # same positions for every expert
    assert not np.array_equal(sketch.sample_positions(100_001, 2048)[:50], p[:50])
    assert np.array_equal(sketch.sample_positions(300, 2048), np.arange(300))


def test_make_sketch_and_decode_roundtrip():
    d = torch.linspace(-2.0, 2.0, 1000)
    blob = sketch.make_sketch(d, 2.0, 2048)
    assert len(blob) == 2 * 1000  # float16 per sampled element; small blocks keep every element
    dec = sketch.decode(blob)
    assert dec.dtype == np.float32
    np.testing.assert_allclose(dec, (d / 2.0).numpy(), atol=1e-3)
    big = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    mx = float(big.abs().max())
    dec = sketch.decode(sketch.make_sketch(big, mx, 512))
    np.testing.assert_allclose(dec, (big[sketch.sample_positions(50_000, 512)] / mx).numpy(), rtol=1e-3, atol=1e-4)
    assert np.abs(dec).max() <= 1.0
    zero = sketch.decode(sketch.make_sketch(torch.zeros(10), 0.0, 2048))
    assert zero.tolist() == [0.0] * 10
    assert sketch.decode(None).size == 0 and sketch.decode(b"").size == 0


def test_conflict_rate_and_cosine_values():
    a = np.array([1.0, -1.0, 2.0, 0.0, 3.0, -0.5], dtype=np.float32)
    b = np.array([2.0, 1.0, -1.0, 5.0, 0.0, -4.0], dtype=np.float32)
    # both non-zero at positions 0, 1, 2, 5; signs differ at 1 and 2
    assert sketch.conflict_rate(a, b) == 0.5
    assert sketch.conflict_rate(a, np.zeros(6, np.float32)) == 0.0
    want = float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
    assert sketch.cosine(a, b) == pytest.approx(want, rel=1e-6)
    assert sketch.cosine(a, a) == pytest.approx(1.0)
    assert sketch.cosine(a, -a) == pytest.approx(-1.0)
    assert sketch.cosine(a, np.zeros(6, np.float32)) == 0.0


# --- accuracy on a generated family ------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-bf16")
    paths = make_family(root, experts=3, size="small", dtype="bf16", seed=0)
    cat = Catalog(root / "catalog.sqlite")
    fam = Family(root, Path(paths["base"]), tuple(Path(p) for p in paths["experts"]), "bf16", False)
    register_family(cat, fam)
    analyze(cat)  # the default grid (1 MiB blocks) and sketch size (2048)
    yield fam, cat
    cat.close()


def test_sketch_estimates_match_exact_block_values(small_family):
    fam, cat = small_family
    assert cat.grid_block_bytes("base") == DEFAULT_BLOCK_BYTES
    base = {n: to_np32(t) for n, t in load_checkpoint_tensors(fam.base).items()}
    deltas = []
    for e in fam.experts:
        exp = load_checkpoint_tensors(e)
        deltas.append({n: to_np32(exp[n]) - base[n] for n in base})
    blocks = [{(r["tensor"], r["block"]): r for r in cat.blocks(f"expert_{i}", with_sketch=True)}
              for i in (1, 2, 3)]
    conflict_err, cosine_err, sizes = [], [], []
    for i, j in itertools.combinations(range(3), 2):
        for key, ra in blocks[i].items():
            rb = blocks[j][key]
            if ra["delta_nnz"] == 0 or rb["delta_nnz"] == 0:
                continue
            tname = key[0]
            da = deltas[i][tname][ra["row_start"]:ra["row_end"]].reshape(-1).astype(np.float64)
            db = deltas[j][tname][rb["row_start"]:rb["row_end"]].reshape(-1).astype(np.float64)
            sa, sb = sketch.decode(ra["sketch"]), sketch.decode(rb["sketch"])
            sizes.append(sa.size)
            conflict_err.append(abs(sketch.conflict_rate(sa, sb) - sketch.conflict_rate(da, db)))
            cosine_err.append(abs(sketch.cosine(sa, sb) - sketch.cosine(da, db)))
    conflict_err, cosine_err = np.array(conflict_err), np.array(cosine_err)
    print(f"\nsketch accuracy over {conflict_err.size} block pairs (sketch size {max(sizes)}): "
          f"conflict MAE {conflict_err.mean():.4f} p95 {np.percentile(conflict_err, 95):.4f} "
          f"max {conflict_err.max():.4f}; cosine MAE {cosine_err.mean():.4f} "
          f"p95 {np.percentile(cosine_err, 95):.4f} max {cosine_err.max():.4f}")
    assert conflict_err.size >= 50
    assert max(sizes) == 2048  # the family's blocks are large enough that the sketch samples
    assert conflict_err.mean() <= 0.02 and np.percentile(conflict_err, 95) <= 0.05
    assert cosine_err.mean() <= 0.02 and np.percentile(cosine_err, 95) <= 0.05


def test_sketch_cost_in_catalog_bytes(small_family):
    _, cat = small_family
    rows = cat.blocks("expert_1", with_sketch=True)
    for r in rows:
        elements = r["nbytes"] // 2
        assert len(r["sketch"]) == 2 * min(2048, elements)
    assert sum(len(r["sketch"]) for r in rows) <= 4096 * len(rows)
