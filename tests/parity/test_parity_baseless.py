"""nuslerp and multislerp without a base_model (issue 15, items 1 and 3), against mergekit 0.1.5.

mergekit interpolates the models themselves when no base_model is given. MergePipe plans it as a soup
(config/soup.py): the first model is the reference, read in full as the "base" and weighted as a model; the
angles and norms of the whole models come from ANALYZE's Gram statistics (||base||^2, <base, delta_i>,
<delta_i, delta_j>). Asserted: fp32 outputs within a few float32 ulps of the tensor's largest value (the
coefficients come from float64 sums, mergekit reduces in float32; nuslerp's per-row variant is computed in the
block: bit-equal), bf16 outputs bit-equal or a rare entry one bf16 ulp away; under a budget an omitted block
keeps the reference's values and the bytes read equal the plan's; EXPLAIN names the reference.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe.api import merge_config
from mergepipe.catalog.db import Catalog
from mergepipe.config.parse import parse_config
from mergepipe.planner.explain import explain_plan
from mergepipe.planner.plan import expand_ranges
from mergepipe.research.family import make_family
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.registry import open_checkpoint

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge

EPS32 = 2.0 ** -23


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def bfam(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"baseless-{request.param}")
    paths = make_family(root / "fam", experts=3, size="tiny", dtype=request.param, shard_bytes=1 << 30, seed=13)
    return {"dtype": request.param, "root": root, "models": paths["experts"]}


def _cfg(fam, method, weights, parameters=None):
    cfg = {"merge_method": method, "dtype": "float32",
           "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(fam["models"], weights)]}
    if parameters:
        cfg["parameters"] = parameters
    if fam["dtype"] == "bf16":
        cfg["out_dtype"] = "bfloat16"
    return cfg


def _both(fam, cfg, tag, budget=None):
    out = fam["root"] / tag
    out.mkdir()
    cat = Catalog(out / "c.sqlite")
    try:
        ours_cfg = dict(cfg, mergepipe={"budget": budget}) if budget else cfg
        plan, _, manifest = merge_config(cat, parse_config(yaml.safe_dump(ours_cfg)), out / "mp", model_id=tag)
    finally:
        cat.close()
    return plan, manifest, load_dir(out / "mp"), mergekit_merge(cfg, out / "mk")


def _assert_equal(fam, ours, theirs, ulps, bf16_diff=0.0):
    assert set(ours) == set(theirs)
    for name, b in theirs.items():
        a = ours[name]
        assert a.dtype == b.dtype, name
        if fam["dtype"] == "bf16":
            differ = float((a != b).float().mean())
            assert differ <= bf16_diff, (name, differ)
            if differ:
                assert float((a.float() - b.float()).abs().max()) <= 2 ** -8 * float(b.float().abs().max()), name
        elif ulps is None:
            assert torch.equal(a, b), name
        else:
            assert float((a - b).abs().max()) <= ulps * EPS32 * float(b.abs().max()), name


CASES = {
    "nuslerp": ("nuslerp", [0.3, 0.7], None, 4, 0.0),
    "nuslerp-rows": ("nuslerp", [0.6, 0.4], {"nuslerp_flatten": False}, 4, 0.0),  # 1-D: whole-tensor angle
    "multislerp-2": ("multislerp", [0.5, 0.3], None, 4, 0.01),
    "multislerp-3": ("multislerp", [0.2, 0.5, 0.3], None, 4, 0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_baseless_equals_mergekit(bfam, case):
    method, weights, params, ulps, bf16_diff = CASES[case]
    cfg = _cfg(bfam, method, weights, params)
    cfg["models"] = cfg["models"][:len(weights)]
    plan, manifest, ours, theirs = _both(bfam, cfg, case)
    assert plan["operator"] == method and plan["base"]["uri"] == str(bfam["models"][0])
    assert plan["base_member"] == {"weight": weights[0], "position": 0, "reference": True}
    assert [e["weight"] for e in plan["experts"]] == weights[1:]
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    _assert_equal(bfam, ours, theirs, ulps, bf16_diff)
    assert "reference model" in explain_plan(plan.data)


def test_baseless_nuslerp_under_a_budget_keeps_the_reference_where_omitted(bfam):
    cfg = _cfg(bfam, "nuslerp", [0.4, 0.6])
    cfg["models"] = cfg["models"][:2]
    plan, manifest, part, full = _both(bfam, cfg, "nuslerp-budget", budget="50%")
    read = manifest.core["realized"]["expert_read"]
    assert read == plan["estimate"]["expert_read"] <= 0.5 * plan["full_expert_bytes"]
    omitted = {t: set(expand_ranges(rs)) for t, rs in plan["omitted"].items()}
    ref = load_dir(bfam["models"][0])
    ck = open_checkpoint(bfam["models"][0])
    kept = merged = 0
    for name, info in ck.tensors.items():
        for span in tensor_grid(info, plan["grid"]["block_bytes"]):
            rows = slice(span.row_start, span.row_end)
            if span.index in omitted.get(name, ()):
                assert torch.equal(part[name][rows], ref[name][rows]), (name, span.index)
                kept += 1
            else:  # read: the full merge's values (mergekit's, within the parity tolerance)
                a, b = part[name][rows].float(), full[name][rows].float()
                tol = (4 * EPS32 if bfam["dtype"] == "fp32" else 2 ** -8) * float(full[name].float().abs().max())
                assert float((a - b).abs().max()) <= tol, (name, span.index)
                merged += 1
    assert kept >= 1 and merged >= 1


def test_base_is_still_required_where_mergekit_requires_it(bfam, tmp_path):
    cfg = _cfg(bfam, "model_stock", [1.0, 1.0, 1.0])
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        with pytest.raises(Exception, match="`base_model` is required by model_stock"):
            merge_config(cat, parse_config(yaml.safe_dump(cfg)), tmp_path / "out", model_id="x")
        assert cat.conn.execute("SELECT COUNT(*) FROM models").fetchone()[0] == 0
    finally:
        cat.close()
