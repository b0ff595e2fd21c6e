"""The interpolation methods (slerp, nuslerp, model_stock, multislerp, karcher, nearswap, sce, ram, ramplus_tl,
arcee_fusion) against mergekit
0.1.5 at full budget, through the mergekit YAML path, on the tiny fp32 and bf16 families; and their budget
semantics at 50 %: realized == planned <= budget, omitted blocks keep the base, joint reads.

Parity (README, Operators): bf16 outputs are bit-equal (multislerp and karcher: the rare entry one bf16 ulp
away, at a rounding boundary); fp32 outputs of the methods whose coefficients come from the catalog's Gram
statistics differ from mergekit's float32 reductions by at most a few float32 ulps of the tensor's largest
value (nearswap and the per-row variants are bit-equal); karcher follows mergekit's float32 iteration to
~3e-7 of the tensor's scale, except where its ``theta < tol`` branch flips on nearly identical 1-D tensors
(up to ~3e-4).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe import api
from mergepipe.catalog import analyses
from mergepipe.config.parse import parse_config
from mergepipe.errors import MergePipeError, PlanError
from mergepipe.planner.context import Planner
from mergepipe.planner.plan import expand_ranges
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.registry import open_checkpoint

from merge_helpers import load_dir, open_copy, run_cli, shared_family
from mergekit_runner import mergekit_merge

EPS32 = 2.0 ** -23
MK_DTYPE = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "float32", "out_dtype": "bfloat16"}}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def setup(request, tmp_path_factory):
    fam = shared_family(tmp_path_factory, f"tiny-{request.param}")
    work = tmp_path_factory.mktemp(f"methods-{request.param}")
    cat = open_copy(fam, work / "cat.sqlite")
    yield request.param, fam, cat, work
    cat.close()


def _models(fam, n, weights=None, with_base=False):
    models = [{"model": str(fam.base)}] if with_base else []
    for i in range(n):
        m = {"model": str(fam.experts[i])}
        if weights:
            m["parameters"] = {"weight": weights[i]}
        models.append(m)
    return models


CASES = {
    "slerp": lambda f: {"merge_method": "slerp", "models": _models(f, 1, with_base=True), "parameters": {"t": 0.3}},
    "slerp-gradient": lambda f: {"merge_method": "slerp", "models": _models(f, 1, with_base=True),
                                 "parameters": {"t": [0.2, 0.9, 0.4]}},
    "slerp-filters": lambda f: {"merge_method": "slerp", "models": _models(f, 1, with_base=True),
                                "parameters": {"t": [{"filter": "self_attn", "value": [0.0, 0.7]},
                                                     {"filter": "mlp", "value": 0.6}, {"value": 0.45}]}},
    "nearswap": lambda f: {"merge_method": "nearswap", "models": _models(f, 1, with_base=True),
                           "parameters": {"t": 0.002}},
    "nuslerp": lambda f: {"merge_method": "nuslerp", "models": _models(f, 2, [0.3, 0.7])},
    "nuslerp-rows": lambda f: {"merge_method": "nuslerp", "models": _models(f, 2, [0.6, 0.4]),
                               "parameters": {"nuslerp_flatten": False}},
    "model_stock": lambda f: {"merge_method": "model_stock", "models": _models(f, 3)},
    "model_stock-filter_wise": lambda f: {"merge_method": "model_stock", "models": _models(f, 3),
                                          "parameters": {"filter_wise": True}},
    "multislerp": lambda f: {"merge_method": "multislerp", "models": _models(f, 2, [0.5, 0.3])},
    "karcher": lambda f: {"merge_method": "karcher", "models": _models(f, 3)},
    "sce": lambda f: {"merge_method": "sce", "models": _models(f, 3)},
    "ram": lambda f: {"merge_method": "ram", "models": _models(f, 3)},
    "ramplus_tl": lambda f: {"merge_method": "ramplus_tl", "models": _models(f, 3),
                             "parameters": {"r": 0.5, "alpha": 0.3}},
    "arcee_fusion": lambda f: {"merge_method": "arcee_fusion", "models": _models(f, 1, with_base=True)},
}
# fp32: max |ours - mergekit| per tensor, in float32 ulps of the tensor's largest |value| (None: bit-equal)
FP32_ULPS = {"slerp": 4, "slerp-gradient": 4, "slerp-filters": 4, "nearswap": None, "nuslerp": 4,
             "nuslerp-rows": 4, "model_stock": 4, "model_stock-filter_wise": 4, "multislerp": 4,
             "karcher": 8192, "sce": 4, "ram": None, "ramplus_tl": None, "arcee_fusion": None}  # ~1e-3: see the module docstring
# bf16: fraction of entries allowed to differ (by one bf16 ulp); 0: bit-equal
BF16_DIFF = {"multislerp": 0.01, "karcher": 0.05, "sce": 0.01}


def _config(fam, dtype, case):
    return dict(CASES[case](fam), base_model=str(fam.base), **MK_DTYPE[dtype])


@pytest.mark.parametrize("case", list(CASES))
def test_full_budget_equals_mergekit(setup, case):
    dtype, fam, cat, work = setup
    cfg = _config(fam, dtype, case)
    ref = mergekit_merge(cfg, work / f"mk-{case}")
    plan, _, manifest = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / f"mp-{case}",
                                         model_id=f"mp-{case}")
    assert plan["operator"] == case.split("-")[0]
    assert plan["error_bound"] is None and plan["omitted"] == {}
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    got = load_dir(work / f"mp-{case}")
    assert set(got) == set(ref)
    for name in ref:
        a, b = got[name], ref[name]
        assert a.dtype == b.dtype, name
        if dtype == "bf16":
            differ = float((a != b).float().mean())
            assert differ <= BF16_DIFF.get(case, 0.0), (name, differ)
            if differ:  # at a rounding boundary: within one bf16 ulp of the tensor's largest value
                assert float((a.float() - b.float()).abs().max()) <= 2 ** -8 * float(b.float().abs().max()), name
        elif FP32_ULPS[case] is None:
            assert torch.equal(a, b), name
        else:
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= FP32_ULPS[case] * EPS32 * scale, name


def _blocks(fam, block_bytes):
    ck = open_checkpoint(fam.base)
    return {name: tensor_grid(info, block_bytes) for name, info in ck.tensors.items()}


@pytest.mark.parametrize("op,experts,kw", [("slerp", 1, {"t": 0.4}), ("model_stock", 3, {}),
                                           ("nuslerp", 2, {"weights": [1.0, 2.0]}), ("arcee_fusion", 1, {})])
def test_half_budget_reads_jointly_and_keeps_the_base_where_omitted(setup, op, experts, kw):
    dtype, fam, cat, work = setup
    ids = fam.expert_ids[:experts]
    # these experts analyzed together (another test's config merge may have analyzed a subset since, dropping
    # pairs); arcee_fusion's thresholds are opt-in statistics (a config merge gathers them by itself)
    api.analyze(cat, ids, gram=True, arcee=op == "arcee_fusion", block_bytes=fam.spec.block_bytes)
    planner = Planner(cat)
    full = planner.plan("base", ids, op, **kw)
    half = planner.plan("base", ids, op, budget=0.5, **kw)
    budget = half["budget"]["bytes"]
    assert 0 < half["estimate"]["expert_read"] <= budget < full["estimate"]["expert_read"]
    assert half["coefficients"] == full["coefficients"]  # whole-tensor scalars do not depend on the budget
    # joint: a block is read for every expert that changed it, or for none
    changed = {e: {(r[0], r[1]) for r in analyses.changed_block_stats(cat, e)} for e in ids}
    read = {e: {(t, b) for t, rs in half["access"][e].items() for b in expand_ranges(rs)} for e in ids}
    union = set().union(*read.values())
    for e in ids:
        assert read[e] == union & changed[e]
    omitted = {t: set(expand_ranges(rs)) for t, rs in half["omitted"].items()}
    assert omitted and not any(b in omitted.get(t, ()) for t, b in union)
    assert {(t, b) for t, bs in omitted.items() for b in bs} == set().union(*changed.values()) - union
    out_full, out_half = work / f"full-{op}", work / f"half-{op}"
    _, m_full = api.execute(cat, full, out_full)
    _, m = api.execute(cat, half, out_half)
    core = m.core
    assert core["realized_by_expert"] == half["expert_read_by_expert"]
    assert core["realized"]["expert_read"] == half["estimate"]["expert_read"] <= budget
    base, tf, th = load_dir(fam.base), load_dir(out_full), load_dir(out_half)
    kept = merged = 0
    for name, spans in _blocks(fam, half["grid"]["block_bytes"]).items():
        for span in spans:
            rows = slice(span.row_start, span.row_end)
            if span.index in omitted.get(name, ()):  # omitted: the base's values (t = 0 there)
                assert torch.equal(th[name][rows], base[name][rows]), (name, span.index)
                kept += 1
            else:  # read (or unchanged): the full-budget merge's values
                assert torch.equal(th[name][rows], tf[name][rows]), (name, span.index)
                merged += 1
    assert kept >= 5 and merged >= 5


def test_declarations_and_refusals(setup):
    dtype, fam, cat, work = setup
    names = {p.name for p in api.parameters()}
    assert {"t", "nuslerp_flatten", "nuslerp_row_wise", "filter_wise", "normalize_weights", "max_iter",
            "tol"} <= names
    ops = {s.name: s for s in api.operators()}
    for name in ("slerp", "nuslerp", "model_stock", "multislerp", "karcher", "nearswap", "arcee_fusion"):
        assert not ops[name].additive and ops[name].joint and ops[name].budget_semantics
    planner = Planner(cat)
    with pytest.raises(PlanError, match="exactly 1 model"):
        planner.plan("base", fam.expert_ids[:2], "slerp", t=0.5)
    with pytest.raises(PlanError, match="needs the parameter t"):
        planner.plan("base", fam.expert_ids[:1], "slerp")
    with pytest.raises(PlanError, match="arcee_fusion needs exactly 1 model besides the base"):
        planner.plan("base", fam.expert_ids[:2], "arcee_fusion")
    with pytest.raises(PlanError, match="at least 2"):
        planner.plan("base", fam.expert_ids[:1], "model_stock")
    with pytest.raises(PlanError, match="takes no parameter lambda"):
        planner.plan("base", fam.expert_ids[:1], "slerp", t=0.5, lam=2.0)
    with pytest.raises(MergePipeError, match="per column"):
        planner.plan("base", fam.expert_ids[:2], "nuslerp", nuslerp_row_wise=True, nuslerp_flatten=False)
    cfg = _config(fam, dtype, "slerp")
    cfg["parameters"]["t"] = "x"
    with pytest.raises(MergePipeError):
        parse_config(yaml.safe_dump(cfg))
    # the three analyzed together (a one-expert method's config merge, e.g. arcee_fusion's, analyzes its one alone)
    api.analyze(cat, fam.expert_ids[:3], gram=True, block_bytes=fam.spec.block_bytes)
    text = api.explain(cat, planner.plan("base", fam.expert_ids[:3], "model_stock", budget=0.5).id)
    assert "bound      n/a" in text and "omitted" in text


def test_cli_flags_merge_like_the_config(setup):
    """``mergepipe merge --op model_stock --filter_wise`` (flags generated from the declarations) gives
    the same bytes as the YAML config path."""
    dtype, fam, cat, work = setup
    db = work / "cat.sqlite"
    out = work / "cli-ms"
    r = run_cli(["--db", db, "merge", "--base", "base", "--experts", *fam.expert_ids[:3], "--op", "model_stock",
                 "--filter_wise", "--out", out, "--model-id", "cli-ms"])
    assert r.returncode == 0, r.stderr
    cfg = _config(fam, dtype, "model_stock-filter_wise")
    api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / "cfg-ms", model_id="cfg-ms")
    a, b = load_dir(out), load_dir(work / "cfg-ms")
    assert all(torch.equal(a[k], b[k]) for k in b)
    r = run_cli(["--db", db, "plan", "--base", "base", "--experts", fam.expert_ids[0], "--op", "slerp", "--t", "0.25"])
    assert r.returncode == 0, r.stderr


def test_config_with_fresh_paths_analyzes_the_experts_together(setup, tmp_path):
    """A mergekit config naming unregistered paths: registered, analyzed together (the Gram statistics),
    planned and merged, equal to the merge from the shared catalog."""
    dtype, fam, cat, work = setup
    from mergepipe.catalog.db import Catalog
    fresh = Catalog(tmp_path / "fresh.sqlite")
    try:
        cfg = _config(fam, dtype, "model_stock")
        api.merge_config(fresh, parse_config(yaml.safe_dump(cfg)), tmp_path / "fresh-out", model_id="fresh-ms")
        assert fresh.conn.execute("SELECT COUNT(*) FROM gram").fetchone()[0] > 0
    finally:
        fresh.close()
    api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / "shared-ms", model_id="shared-ms")
    a, b = load_dir(tmp_path / "fresh-out"), load_dir(work / "shared-ms")
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("op,experts,kw", [("slerp", 1, {"t": [0.1, 0.8]}), ("nuslerp", 2, {"weights": [1.0, 3.0]}),
                                           ("karcher", 3, {"max_iter": 5})])
def test_export_as_mergekit_round_trips(setup, op, experts, kw):
    """``explain --as-mergekit`` writes a config mergekit reads and MergePipe plans to the same digest."""
    dtype, fam, cat, work = setup
    from mergepipe.config.export import export_mergekit
    from mergepipe.config.resolve import plan_from_config
    plan = Planner(cat).plan("base", fam.expert_ids[:experts], op, budget=0.5, **kw)
    text = export_mergekit(cat, plan.id)
    again, _ = plan_from_config(cat, parse_config(text), save=False)
    assert again.digest == plan.digest
