"""ANALYZE's exact top-k statistics (catalog v5 ``tensor_stats.topk``): per density, the entries above and
equal to the threshold, the L1 norm of exactly k top entries (TIES' rescale), and the exact-k cut
(cut_block, cut_rank) that makes the blocks keep exactly k entries, ties taken in flat order -- checked
against numpy on a bf16 family (whose quantised deltas tie at almost every cut-off), in memory and
through the out-of-memory path (per-block histogram counts and first-pass keys, no second read)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mergepipe.analyze import stats as analyze_mod
from mergepipe.api import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import open_checkpoint

from merge_helpers import load_dir

BLOCK = 4096


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("topk")
    return make_family(root / "fam", experts=1, size="tiny", dtype="bf16", shard_bytes=1 << 30, seed=3)


@pytest.mark.parametrize("in_memory", [True, False])
def test_topk_statistics_and_cuts_are_exact(fam, tmp_path, monkeypatch, in_memory):
    if not in_memory:
        monkeypatch.setattr(analyze_mod, "IN_MEMORY_TENSOR_BYTES", 0)
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", fam["base"])
    register(cat, "e1", fam["experts"][0], base_id="base")
    res = analyze(cat, block_bytes=BLOCK)
    base, exp = load_dir(fam["base"]), load_dir(fam["experts"][0])
    infos = open_checkpoint(fam["base"]).tensors
    stats = cat.tensor_stats("e1")
    straddling = 0
    for name, st in stats.items():
        if not st["delta_nnz"]:
            continue
        a = (exp[name].float() - base[name].float()).abs().numpy().reshape(-1)
        n = a.size
        order = np.lexsort((np.arange(n), -a))  # |d| descending, then flat index
        topk = json.loads(st["topk"])
        spans = tensor_grid(infos[name], BLOCK)
        row = n // infos[name].shape[0]
        for d, thr in st["thresholds"].items():
            k = int(d * n)
            entry = topk.get(str(d))
            if not (0 < k <= st["delta_nnz"]):
                assert entry is None
                continue
            above, equal, kept_l1, cut_block, cut_rank = entry[:5]
            assert (above, equal) == (int((a > thr).sum()), int((a == thr).sum()))
            assert kept_l1 == pytest.approx(float(a[order[:k]].astype(np.float64).sum()), rel=1e-12)
            # the cut reproduces the exact top k block by block
            mask = a > thr
            for span in spans:
                lo, hi = span.row_start * row, span.row_end * row
                tied = np.flatnonzero(a[lo:hi] == thr) + lo
                if span.index < cut_block:
                    mask[tied] = True
                elif span.index == cut_block:
                    mask[tied[:cut_rank]] = True
            expected = np.zeros(n, dtype=bool)
            expected[order[:k]] = True
            assert np.array_equal(mask, expected), (name, d)
            straddling += above + equal > k
    assert straddling > 50  # bf16 deltas tie at the cut-offs: the cuts are really exercised
    assert not res[0].skipped
    cat.close()
