"""ANALYZE: per-block and per-tensor delta statistics equal a numpy reference computed from whole tensors
loaded with safetensors; exact top-k thresholds (in-memory and re-read paths); incremental re-analysis."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

import mergepipe.analyze.stats as analyze_mod
from conftest import (
    ANALYZE_BLOCK_BYTES,
    dump_catalog,
    load_checkpoint_tensors,
    register_family,
    to_np32,
)
from mergepipe.analyze.runner import analyze, analyze_expert
from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError
from mergepipe.catalog.models import register
from mergepipe.storage.safetensors import open_checkpoint


def _deltas(fam_dir_base, fam_dir_expert) -> dict[str, np.ndarray]:
    base = load_checkpoint_tensors(fam_dir_base)
    exp = load_checkpoint_tensors(fam_dir_expert)
    return {n: to_np32(exp[n]) - to_np32(base[n]) for n in base}


def _block_ref(delta: np.ndarray, row_start: int, row_end: int) -> dict:
    d = delta[row_start:row_end].reshape(-1).astype(np.float64)
    return {"delta_l2": float(np.sqrt(np.sum(d * d))), "delta_l1": float(np.sum(np.abs(d))),
            "delta_max_abs": float(np.max(np.abs(d))) if d.size else 0.0, "delta_nnz": int(np.count_nonzero(d))}


def _kth_largest(absd: np.ndarray, k: int) -> float:
    return float(np.partition(absd, absd.size - k)[absd.size - k])


def _check_blocks(cat: Catalog, expert_id: str, deltas: dict[str, np.ndarray]) -> None:
    rows = cat.blocks(expert_id)
    assert rows
    for r in rows:
        ref = _block_ref(deltas[r["tensor"]], r["row_start"], r["row_end"])
        where = f"{r['tensor']}#{r['block']}"
        assert r["delta_nnz"] == ref["delta_nnz"], where
        for k in ("delta_l2", "delta_l1", "delta_max_abs"):
            np.testing.assert_allclose(r[k], ref[k], rtol=1e-5, atol=0, err_msg=f"{where} {k}")


@pytest.mark.parametrize("name", ["fp32-sharded", "bf16-sharded"])
def test_block_stats_equal_numpy_reference(analyzed, families, name):
    cat, fam = analyzed[name], families[name]
    n_multi = 0
    for i, e in enumerate(fam.experts, start=1):
        deltas = _deltas(fam.base, e)
        _check_blocks(cat, f"expert_{i}", deltas)
        rows = cat.blocks(f"expert_{i}")
        # every tensor is covered by its blocks: block nnz and l1 add up to the whole-tensor reference
        for tname, delta in deltas.items():
            mine = [r for r in rows if r["tensor"] == tname]
            n_multi += len(mine) > 1
            assert sum(r["delta_nnz"] for r in mine) == np.count_nonzero(delta)
            assert sum(r["nbytes"] for r in mine) == delta.size * (4 if fam.dtype == "fp32" else 2)
    assert n_multi > 10  # the grid really cut tensors into several blocks


@pytest.mark.parametrize("name", ["fp32-sharded", "bf16-sharded"])
def test_tensor_stats_and_thresholds_equal_numpy_reference(analyzed, families, name):
    cat, fam = analyzed[name], families[name]
    n_checked = n_frozen = 0
    for i, e in enumerate(fam.experts, start=1):
        densities = json.loads(cat.analysis(f"expert_{i}")["densities"])
        assert set(densities) >= {0.01, 0.1, 0.5, 0.9}
        stats = cat.tensor_stats(f"expert_{i}")
        deltas = _deltas(fam.base, e)
        assert set(stats) == set(deltas)
        for tname, delta in deltas.items():
            s = stats[tname]
            absd = np.abs(delta.reshape(-1))
            d64 = delta.astype(np.float64)
            assert s["numel"] == absd.size
            assert s["delta_nnz"] == np.count_nonzero(absd)
            np.testing.assert_allclose(s["delta_l2"], np.sqrt(np.sum(d64 * d64)), rtol=1e-5)
            np.testing.assert_allclose(s["delta_l1"], np.sum(np.abs(d64)), rtol=1e-5)
            assert s["delta_max_abs"] == float(absd.max())
            if s["delta_nnz"] == 0:
                n_frozen += 1
                assert s["thresholds"] == {}
                continue
            assert set(s["thresholds"]) == set(densities)
            for d in densities:
                k = int(d * absd.size)
                want = float("inf") if k == 0 else _kth_largest(absd, k)
                assert s["thresholds"][d] == want, (tname, d, k)
                n_checked += 1
    assert n_checked > 500
    assert n_frozen > 0  # the family has frozen tensors: exactly-zero deltas are recorded as such


def test_thresholds_select_top_k(analyzed, families):
    """For density d the threshold t is the k-th largest |delta|: fewer than k entries lie strictly
    above it and at least k at or above it (k = int(d * numel))."""
    cat, fam = analyzed["fp32-sharded"], families["fp32-sharded"]
    deltas = _deltas(fam.base, fam.experts[0])
    stats = cat.tensor_stats("expert_1")
    n = 0
    for tname, delta in deltas.items():
        absd = np.abs(delta.reshape(-1))
        for d, t in stats[tname]["thresholds"].items():
            k = int(d * absd.size)
            if 0 < k <= np.count_nonzero(absd):
                assert int((absd > t).sum()) < k <= int((absd >= t).sum()), (tname, d)
                n += 1
    assert n > 100


@pytest.mark.parametrize("first_pass_keys", [False, True])
@pytest.mark.parametrize("name", ["fp32-sharded", "bf16-sharded"])
def test_out_of_memory_path_gives_identical_results(tmp_path, monkeypatch, analyzed, families, name, first_pass_keys):
    """Tensors too large to keep: the radix select's low bits come from the keys the first pass
    collected, or (no room for keys) from a second read of the blocks; both equal the in-memory path."""
    ref_cat = analyzed[name]
    monkeypatch.setattr(analyze_mod, "IN_MEMORY_TENSOR_BYTES", 0)
    if not first_pass_keys:
        monkeypatch.setattr(analyze_mod, "KEY_CAP", 0)
    cat = Catalog(tmp_path / "oom.sqlite")
    ids = register_family(cat, families[name])
    results = analyze(cat, block_bytes=ANALYZE_BLOCK_BYTES)
    for mid, res in zip(ids, results):
        assert not res.skipped
        assert cat.tensor_stats(mid) == ref_cat.tensor_stats(mid)
        assert cat.blocks(mid, with_sketch=True) == ref_cat.blocks(mid, with_sketch=True)
        in_memory = ref_cat.analysis(mid)["bytes_read"]
        if first_pass_keys:  # every low-bit pattern was collected on the way: nothing read twice
            assert res.bytes_read == in_memory
        else:  # the second pass really re-read the blocks from the files
            assert res.bytes_read > in_memory
    cat.close()


def test_analysis_record_and_bytes_read(analyzed, families):
    cat, fam = analyzed["fp32-sharded"], families["fp32-sharded"]
    base_bytes = open_checkpoint(fam.base).nbytes
    for i, e in enumerate(fam.experts, start=1):
        a = cat.analysis(f"expert_{i}")
        assert a["base_id"] == "base"
        assert a["block_bytes"] == ANALYZE_BLOCK_BYTES
        assert a["fingerprint"] == cat.model(f"expert_{i}")["fingerprint"]
        assert a["base_fingerprint"] == cat.model("base")["fingerprint"]
        # base and expert each read exactly once
        assert a["bytes_read"] == base_bytes + open_checkpoint(e).nbytes
        assert a["seconds"] >= 0 and a["analyzed_at"]
        assert cat.is_analyzed(f"expert_{i}")
        assert a["sketch_size"] == 2048
        assert all(len(r["sketch"]) == 2 * min(2048, r["nbytes"] // 4) for r in cat.blocks(f"expert_{i}", with_sketch=True))


def test_delta_checkpoint_analyzes_like_the_full_expert(tmp_path, families):
    fam = families["fp32-single"]
    base = load_file(str(fam.base / "model.safetensors"))
    exp = load_file(str(fam.experts[0] / "model.safetensors"))
    delta_path = tmp_path / "delta.safetensors"
    save_file({n: exp[n].float() - base[n].float() for n in base}, str(delta_path))
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(fam.base))
    register(cat, "full", str(fam.experts[0]), base_id="base")
    register(cat, "delta", str(delta_path), base_id="base", kind="delta")
    analyze(cat, block_bytes=4096, densities=(0.1, 0.5))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("model_id", "offset")} for r in rows]  # noqa: E731
    assert strip(cat.blocks("delta", with_sketch=True)) == strip(cat.blocks("full", with_sketch=True))
    # a delta checkpoint reads only the expert's bytes, never the base's
    assert cat.analysis("delta")["bytes_read"] == open_checkpoint(delta_path).nbytes
    cat.close()


# --- incremental analyze ----------------------------------------------------------------------------
DENS = (0.1, 0.5)


def _rewrite_tensor(ckpt_dir, tensor: str, add: float) -> None:
    """Rewrite the shard holding ``tensor`` with that tensor changed; same layout, newer mtime."""
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        if tensor in tensors:
            old = f.stat().st_mtime_ns
            tensors[tensor] = (tensors[tensor].float() + add).to(tensors[tensor].dtype)
            save_file(tensors, str(f), metadata={"format": "pt"})
            # ext4 timestamps are coarse: make sure the rewrite is visible in the mtime
            os.utime(f, ns=(old + 10**9, old + 10**9))
            return
    raise AssertionError(tensor)


def test_incremental_analyze_skips_unchanged_and_reanalyzes_changed(tmp_path, monkeypatch, fresh_family):
    fam = fresh_family
    cat = Catalog(tmp_path / "c.sqlite")
    register_family(cat, fam)
    first = analyze(cat, block_bytes=ANALYZE_BLOCK_BYTES, densities=DENS)
    assert [r.skipped for r in first] == [False, False]
    assert all(r.bytes_read > 0 and r.n_blocks > 0 for r in first)
    before = dump_catalog(cat)
    analyses_before = {m: cat.analysis(m) for m in ("expert_1", "expert_2")}

    # from now on a (re-)analysis would stamp this time
    monkeypatch.setattr(analyze_mod, "now", lambda: "2099-01-01T00:00:00Z")
    second = analyze(cat, densities=DENS)
    assert [(r.model_id, r.skipped, r.bytes_read, r.n_blocks) for r in second] == [
        ("expert_1", True, 0, 0), ("expert_2", True, 0, 0)]
    assert dump_catalog(cat) == before
    # fewer densities than stored are also covered; the same block bytes given explicitly too
    assert analyze_expert(cat, "expert_1", block_bytes=ANALYZE_BLOCK_BYTES, densities=(0.5,)).skipped

    # change expert_1: analyze refuses until it is re-registered, and nothing changes
    target = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_tensor(fam.experts[0], target, 0.25)
    with pytest.raises(CatalogError, match="changed since registration"):
        analyze(cat, ["expert_1"], densities=DENS)
    assert dump_catalog(cat) == before

    old_stats = cat.tensor_stats("expert_1")
    old_blocks = cat.blocks("expert_1")
    assert register(cat, "expert_1", str(fam.experts[0]), base_id="base", replace=True)["status"] == "replaced"
    assert not cat.is_analyzed("expert_1") and cat.is_analyzed("expert_2")
    third = analyze(cat, densities=DENS)
    assert {r.model_id: r.skipped for r in third} == {"expert_1": False, "expert_2": True}
    assert cat.analysis("expert_1")["analyzed_at"] == "2099-01-01T00:00:00Z"
    assert cat.analysis("expert_2") == analyses_before["expert_2"]
    new_stats = cat.tensor_stats("expert_1")
    assert new_stats[target]["delta_l2"] != old_stats[target]["delta_l2"]
    assert new_stats[target]["thresholds"] != old_stats[target]["thresholds"]
    for tname in old_stats:
        if tname != target:
            assert new_stats[tname] == old_stats[tname]
    assert cat.blocks("expert_1") != old_blocks
    _check_blocks(cat, "expert_1", _deltas(fam.base, fam.experts[0]))
    cat.close()


def test_grid_change_reanalyzes(tmp_path, fresh_family):
    cat = Catalog(tmp_path / "c.sqlite")
    register_family(cat, fresh_family)
    analyze(cat, block_bytes=ANALYZE_BLOCK_BYTES, densities=DENS)
    n_old = cat.analysis("expert_1")["n_blocks"]
    res = analyze_expert(cat, "expert_1", block_bytes=2 * ANALYZE_BLOCK_BYTES, densities=DENS)
    assert not res.skipped
    assert cat.grid_block_bytes("base") == 2 * ANALYZE_BLOCK_BYTES
    assert 0 < cat.analysis("expert_1")["n_blocks"] < n_old
    # expert_2 was analyzed on the old grid: no longer current, and the next analyze redoes it
    assert not cat.is_analyzed("expert_2")
    again = analyze(cat, densities=DENS)
    assert {r.model_id: r.skipped for r in again} == {"expert_1": True, "expert_2": False}
    assert cat.analysis("expert_2")["block_bytes"] == 2 * ANALYZE_BLOCK_BYTES
    # force re-analyzes even when nothing changed
    assert not analyze_expert(cat, "expert_2", densities=DENS, force=True).skipped
    # more densities than stored: re-analyzed
    assert not analyze_expert(cat, "expert_2", densities=DENS + (0.3,)).skipped
    assert 0.3 in cat.tensor_stats("expert_2")["model.layers.0.mlp.up_proj.weight"]["thresholds"]
    cat.close()


def test_analyze_errors_leave_catalog_unchanged(tmp_path, fam_fp32):
    cat = Catalog(tmp_path / "c.sqlite")
    register_family(cat, fam_fp32)
    before = dump_catalog(cat)
    with pytest.raises(CatalogError, match="unknown model id 'nope'"):
        analyze(cat, ["expert_1", "nope"])
    with pytest.raises(CatalogError, match="has no base"):
        analyze(cat, ["base"])
    with pytest.raises(CatalogError, match="block-bytes must be positive"):
        analyze(cat, ["expert_1"], block_bytes=0)
    assert dump_catalog(cat) == before
    assert cat.analysis("expert_1") is None
    cat.close()


def test_progress_callback_reaches_total(tmp_path, fam_bf16):
    cat = Catalog(tmp_path / "c.sqlite")
    register_family(cat, fam_bf16)
    calls = []
    analyze(cat, ["expert_2"], densities=DENS, progress=lambda *a: calls.append(a))
    total = open_checkpoint(fam_bf16.experts[1]).nbytes
    assert calls and calls[-1] == ("expert_2", total, total)
    assert [c[1] for c in calls] == sorted(c[1] for c in calls)
    cat.close()


@pytest.mark.parametrize("tiny_fraction", [0.0, 0.01, 0.5])
def test_thresholds_exact_whatever_share_of_deltas_has_low_bits(tmp_path, tiny_fraction):
    """bf16 deltas are differences of two bf16 numbers: their float32 low 16 bits are zero unless the
    base entry is much smaller than the delta. The second pass is skipped (no such entry), keyed (few)
    or dense (many): thresholds are exact in all three cases."""
    import torch

    g = torch.Generator().manual_seed(7)
    base = torch.randn(512, 384, generator=g)
    base = torch.sign(base) * (0.01 + base.abs() * 0.02)  # away from 0: bf16 deltas with no low bits
    tiny = torch.rand(base.shape, generator=g) < tiny_fraction
    base = torch.where(tiny, base * 1e-4, base).to(torch.bfloat16)
    expert = (base.float() + torch.randn(base.shape, generator=g) * 3e-4).to(torch.bfloat16)
    for name, t in (("base", base), ("expert", expert)):
        (tmp_path / name).mkdir()
        save_file({"w": t, "b": t[0].clone()}, str(tmp_path / name / "model.safetensors"))
    delta = (expert.float() - base.float()).numpy().reshape(-1)
    low_bits = int((np.abs(delta).view(np.uint32) & 0xFFFF).astype(bool).sum())
    assert (low_bits == 0) == (tiny_fraction == 0.0)
    assert (low_bits * 8 < delta.size) == (tiny_fraction < 0.5)  # keyed selection below 1/8, dense above
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(tmp_path / "base"))
    register(cat, "expert", str(tmp_path / "expert"), base_id="base")
    analyze(cat, ["expert"], block_bytes=64 << 10)
    absd = np.abs(delta)
    thresholds = cat.tensor_stats("expert")["w"]["thresholds"]
    assert len(thresholds) == 102
    for d, t in thresholds.items():
        k = int(d * absd.size)
        assert t == (float("inf") if k == 0 else _kth_largest(absd, k)), d
    cat.close()
