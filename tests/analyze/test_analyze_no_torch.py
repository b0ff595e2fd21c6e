"""ANALYZE of safetensors full and delta experts (bf16, fp32) never imports torch, and what it stores is what the
torch implementation stored: the sketch positions (torch's CPU randperm), arcee_fusion's sample (torch.randint),
sce's variance (torch.var) and keep count are reproduced with numpy bit for bit (torch is the reference here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import ANALYZE_BLOCK_BYTES, load_checkpoint_tensors
from mergepipe.analyze.gram import torch_randint
from mergepipe.analyze.sce import keep_count, variance
from mergepipe.catalog import sketch
from mergepipe.research.family import make_family

REPO = Path(__file__).resolve().parents[2]


def _torch_positions(numel: int, size: int) -> np.ndarray:
    """The positions as sketch.py computed them with torch (catalogs on disk hold sketches at these)."""
    if numel <= size:
        return torch.arange(numel).numpy()
    g = torch.Generator().manual_seed(sketch._SEED ^ numel)
    return torch.randperm(numel, generator=g)[:size].sort().values.numpy()


def test_sample_positions_equal_torch_randperm():
    rng = np.random.default_rng(33)
    numels = [2049, 2050, 4096, 8192, 65536, 262144, 524288, 1 << 20, 1_000_003, 4_194_304]
    numels += [int(n) for n in rng.integers(2049, 3_000_000, 40)]
    for n in numels:
        for size in (2048, 512, 1):
            got = sketch.sample_positions(n, size)
            assert got.dtype == np.int64
            assert np.array_equal(got, _torch_positions(n, size)), (n, size)
    for n in range(1, 60):
        for size in {1, max(1, n - 1), n, n + 1, 2048}:
            assert np.array_equal(sketch.sample_positions(n, size), _torch_positions(n, size)), (n, size)


@pytest.mark.slow
def test_randperm_head_equals_torch_on_its_large_n_path():
    """torch switches to an inside-out shuffle with 64-bit draws at n >= (2**32 - 1) // 20 (blocks of ~214M
    entries; ~20 s and 1.7 GB for torch's whole permutation)."""
    n = sketch._RANDPERM_SMALL
    g = torch.Generator().manual_seed(sketch._SEED ^ n)
    want = torch.randperm(n, generator=g)[:2048].numpy()
    assert np.array_equal(sketch.randperm_head(n, 2048, sketch._SEED ^ n), want)


def test_torch_randint_equals_torch():
    for high, count, seed in [(1_000_001, 5000, 0x41524345), ((1 << 28) - 1, 3000, 0x41524345), (1 << 28, 3000, 0x41524345),
                              (3_000_000_000, 3000, 7), ((1 << 33) + 5, 3000, 9),
                              (1 << 40, 100, 0x41524345), (2, 100, 1)]:
        g = torch.Generator().manual_seed(seed)
        want = torch.randint(high, (count,), generator=g).numpy()
        assert np.array_equal(torch_randint(high, count, seed), want), high


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 16, 17, 33, 64])
def test_variance_equals_torch_var_bit_for_bit(k):
    rng = np.random.default_rng(k)
    for n in (1, 5, 4097):
        d = (rng.standard_normal((k, n)) * rng.choice([1e-6, 1e-3, 1.0, 1e4], size=(k, n))).astype(np.float32)
        d[:, :1] = 0
        if n > 4:
            d[0, 1:3] = -0.0
            d[-1, 3] = np.inf
            d[0, 4] = np.nan
        want = torch.var(torch.from_numpy(d), dim=0, unbiased=False).numpy()
        got = variance(d)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (k, n)


def test_keep_count_equals_torch():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        nonzero = int(rng.integers(0, 1 << 34)) if rng.random() < 0.5 else int(rng.integers(0, 5_000_000))
        topk = float(rng.random()) if rng.random() < 0.6 else round(float(rng.random()), 2)
        assert keep_count(nonzero, topk) == int(torch.tensor(nonzero, dtype=torch.int64) * topk), (nonzero, topk)


@pytest.mark.parametrize("name", ["fp32-sharded", "bf16-sharded"])
def test_stored_sketches_equal_the_torch_reference(analyzed, families, name):
    """Every block's sketch: the torch delta (both sides widened to float32) at torch's randperm positions,
    divided by the block's max |delta|, as float16 (what sketch.py stored when it sampled with torch)."""
    cat, fam = analyzed[name], families[name]
    base = load_checkpoint_tensors(fam.base)
    for i, e in enumerate(fam.experts, start=1):
        exp = load_checkpoint_tensors(e)
        for r in cat.blocks(f"expert_{i}", with_sketch=True):
            delta = (exp[r["tensor"]].float() - base[r["tensor"]].float())[r["row_start"]:r["row_end"]].reshape(-1)
            vals = delta[torch.from_numpy(_torch_positions(delta.numel(), 2048))].numpy()
            if r["delta_max_abs"] > 0:
                vals = vals / np.float32(r["delta_max_abs"])
            assert r["sketch"] == vals.astype(np.float16).tobytes(), (r["tensor"], r["block"])


_RUN = r"""
import json, sys
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
how, db, base, experts, delta = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
cat = Catalog(db)
register(cat, "base", base)
for i, e in enumerate(experts, start=1):
    register(cat, f"expert_{i}", e, base_id="base")
register(cat, "delta", delta, base_id="base", kind="delta")
cat.close()
if how == "api":
    from mergepipe import api
    cat = Catalog(db)
    results = api.analyze(cat, block_bytes=%d)
    results += api.analyze(cat, ["expert_1", "expert_2"], block_bytes=%d, sce_topk=(0.5,))
    assert all(not r.skipped for r in results), results
    cat.close()
else:
    from mergepipe.cli import main
    assert main(["analyze", "--db", db, "--block-bytes", "%d"]) == 0
    assert main(["analyze", "--db", db, "--block-bytes", "%d", "--gram", "expert_1", "expert_2"]) == 0
print("TORCH-LOADED" if [m for m in sys.modules if m == "torch" or m.startswith("torch.")] else "NO-TORCH")
""" % ((ANALYZE_BLOCK_BYTES,) * 4)


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def small_family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("notorch-" + request.param)
    paths = make_family(root / "fam", experts=2, size="tiny", dtype=request.param, shard_bytes=64 << 10, seed=3)
    base, exp = load_checkpoint_tensors(Path(paths["base"])), load_checkpoint_tensors(Path(paths["experts"][0]))
    delta = root / "delta.safetensors"
    save_file({k: (exp[k].float() - base[k].float()).contiguous() for k in base}, str(delta))
    return root, paths, delta


@pytest.mark.parametrize("how", ["api", "cli"])
def test_analyze_never_imports_torch(small_family, how, tmp_path):
    root, paths, delta = small_family
    args = [how, str(tmp_path / "c.sqlite"), str(paths["base"]), json.dumps([str(p) for p in paths["experts"]]),
            str(delta)]
    out = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH", out.stdout[-2000:]
