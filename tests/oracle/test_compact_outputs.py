"""Three-way plans (exact, compact, omitted) against the independent oracle: every task-vector operator at 10, 25
and 50 % on the fp32 and bf16 families of test_budgeted_outputs (two full experts, a delta checkpoint in the
other float dtype, a PEFT LoRA adapter), with progressive compacts; and each single-level codec at 25 %.

reference.py decodes each compact record from the file's bytes by storage/compact.py's written definition
(not by MergePipe's decoder) and merges it as the expert's delta on that block; the tolerances are those of
test_budgeted_outputs (the decoded values are exact in float32, so a compact block adds no rounding)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import reference as ref
from test_budgeted_outputs import (BLOCK, DENSITY, EXPERTS, LAM, LORA, OPS, SEED, WEIGHTS, _build,  # noqa: F401
                                   check_thresholds, compare)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """The oracle families, their catalogs re-analyzed with progressive compacts (files beside each catalog)."""
    from mergepipe.analyze.runner import analyze
    from mergepipe.catalog.db import Catalog
    out = {}
    for dt in ("fp32", "bf16"):
        fam = _build(tmp_path_factory.mktemp("compact-" + dt), dt)
        db = tmp_path_factory.mktemp("ccat-" + dt) / "c.sqlite"
        shutil.copy(fam["db"], db)
        cat = Catalog(db)
        results = analyze(cat, list(EXPERTS), block_bytes=BLOCK, compact="progressive", compact_group=32)
        assert all(r.compact and r.compact["bytes"] > 0 for r in results)
        out[dt] = (fam, cat)
    yield out
    for _, cat in out.values():
        cat.close()


def merge_tiered(cat, out: Path, op: str, budget: str, compact: str = "progressive"):
    from mergepipe.api import merge
    plan, _, manifest = merge(cat, "base", list(EXPERTS), out, operator=op, model_id=out.name, weights=WEIGHTS,
                              density=DENSITY if op not in ("linear", "task_arithmetic") else None, lam=LAM,
                              seed=SEED, budget=budget, compact=compact)
    return plan.data, manifest


def check_tiered(fam, cat, tmp_path, op, budget, compact="progressive"):
    out = tmp_path / f"t-{fam['dtype']}-{op}-{budget.rstrip('%')}-{compact}"
    plan, manifest = merge_tiered(cat, out, op, budget, compact)
    est, real = plan["estimate"], manifest.core["realized"]
    # budget-sound, and what was read is what was planned (exact and compact, counted by the readers)
    assert real["expert_read"] == est["expert_read"]
    assert real["compact_read"] == est["compact_read"] == plan["tiers"]["compact"]["bytes"]
    assert est["expert_read"] + est["compact_read"] <= plan["budget"]["bytes"]
    assert manifest.core["realized_compact_by_expert"] == {
        e: n for e, n in plan["compact_read_by_expert"].items() if n}
    assert plan["compact"], "a partial budget over compacts reads some blocks from the compact tier"
    result = ref.merge(plan, fam["base"])
    check_thresholds(fam, plan, result)
    stats = compare(out, result, fam["base"], flips_ok=op not in ("linear", "task_arithmetic"))
    return plan, result, stats


@pytest.mark.parametrize("budget", ["10%", "25%", "50%"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_tiered_output_equals_oracle(tiered, tmp_path, op, dtype, budget):
    fam, cat = tiered[dtype]
    plan, result, stats = check_tiered(fam, cat, tmp_path, op, budget)
    # the oracle sees the compact blocks: without them it is another merge
    if op in ("linear", "task_arithmetic"):
        plain = dict(plan, compact=None)
        with pytest.raises(AssertionError, match="entries off the oracle"):
            compare(tmp_path / f"t-{dtype}-{op}-{budget.rstrip('%')}-progressive", ref.merge(plain, fam["base"]),
                    fam["base"], flips_ok=False)
    print(op, dtype, budget, plan["tiers"], stats)


@pytest.mark.parametrize("codec,level", [("sign1", "1"), ("q2", "2"), ("q4", "4")])
@pytest.mark.parametrize("op", ["task_arithmetic", "ties", "dare_linear"])
def test_single_level_codecs_equal_oracle(tiered, tmp_path, op, codec, level):
    fam, cat = tiered["bf16"]
    plan, _, _ = check_tiered(fam, cat, tmp_path, op, "25%", compact=codec)
    levels = {lv for entry in plan["compact"]["experts"].values() for lv in entry["bits"]}
    assert levels == {level}


def test_full_budget_is_unchanged_by_compacts(tiered, tmp_path):
    """At 100 % nothing comes from the compact tier: the plan (id, digest) and the output bytes equal the
    exact-only merge's."""
    fam, cat = tiered["fp32"]
    a, ma = merge_tiered(cat, tmp_path / "full-tiered", "ties", "100%")
    b, mb = merge_tiered(cat, tmp_path / "full-off", "ties", "100%", compact="off")
    assert (a["id"], a["digest"]) == (b["id"], b["digest"])
    assert "compact" not in a and ma.core["realized"]["compact_read"] == 0
    assert ma.core["outputs"] == mb.core["outputs"]


def test_no_compact_plans_are_todays(tiered, tmp_path):
    """--no-compact over a catalog with compacts plans exactly as a catalog without them (same id and digest)."""
    from mergepipe.api import plan_merge
    fam, cat = tiered["bf16"]
    from mergepipe.catalog.db import Catalog
    plain = Catalog(fam["db"], create=False)
    try:
        for budget in ("10%", "25%"):
            off = plan_merge(cat, "base", list(EXPERTS), "ties", save=False, weights=WEIGHTS, density=DENSITY,
                             budget=budget, compact="off")
            before = plan_merge(plain, "base", list(EXPERTS), "ties", save=False, weights=WEIGHTS, density=DENSITY,
                                budget=budget)
            assert (off.id, off.digest) == (before.id, before.digest)
            assert off["access"] == before["access"]
    finally:
        plain.close()


def test_tiered_bound_is_sound(tiered, tmp_path):
    """The plan's bounds (headline and additive, with the compact blocks' stored error norms) hold against the
    realized distance to the full merge, for linear and task arithmetic at every budget."""
    fam, cat = tiered["fp32"]
    for op in ("linear", "task_arithmetic"):
        merge_tiered(cat, tmp_path / f"ref-{op}", op, "100%")
        full = ref.read_dir(tmp_path / f"ref-{op}")
        for budget in ("5%", "10%", "25%", "50%"):
            plan, manifest = merge_tiered(cat, tmp_path / f"b-{op}-{budget[:-1]}", op, budget)
            got = ref.read_dir(tmp_path / f"b-{op}-{budget[:-1]}")
            dist = float(np.sqrt(sum(float(np.sum((got[n].values() - full[n].values()) ** 2)) for n in full)))
            b = plan["error_bound"]
            assert b["kind"] == "blockwise" and b["absolute"] == b["blockwise"] <= b["additive"] * (1 + 1e-12)
            # the outputs are float32: allow their rounding on top of the bound
            assert dist <= b["absolute"] * (1 + 1e-6) + 1e-6, (op, budget, dist, b)
            assert dist > 0


@pytest.mark.parametrize("op", ["ties", "dare_ties", "dare_linear", "breadcrumbs_ties", "della"])
def test_sparsified_bound_is_sound(tiered, tmp_path, op):
    """TIES and the DARE family get a bound too (loose but sound): it holds against the realized distance to
    the full merge at every budget, tiered and exact-only, with positive weights."""
    from mergepipe.api import merge
    fam, cat = tiered["fp32"]
    kw = dict(operator=op, weights=[0.75, 0.375, 1.125, 0.5], density=DENSITY, lam=LAM, seed=SEED)
    merge(cat, "base", list(EXPERTS), tmp_path / "full", model_id=f"full-{op}", budget="100%", **kw)
    full = ref.read_dir(tmp_path / "full")
    for compact in ("progressive", "off"):
        for budget in ("10%", "25%", "50%"):
            out = tmp_path / f"{op}-{compact}-{budget[:-1]}"
            plan, _, _ = merge(cat, "base", list(EXPERTS), out, model_id=out.name, budget=budget, compact=compact, **kw)
            got = ref.read_dir(out)
            dist = float(np.sqrt(sum(float(np.sum((got[n].values() - full[n].values()) ** 2)) for n in full)))
            b = plan["error_bound"]
            assert b["kind"] == "sparsified" and 0 < dist <= b["absolute"] * (1 + 1e-6) + 1e-6, (budget, dist, b)
            print(op, compact, budget, f"realized/bound {dist / b['absolute']:.3f}")


@pytest.mark.parametrize("op", ["ties", "dare_ties", "task_arithmetic"])
def test_auto_levels_per_operator(tiered, op):
    """`auto` reads 2 and 4 bits for operators that trim, drop or elect signs (1 bit cost TIES and dare_ties
    accuracy in the fidelity study); additive operators read every stored level; an explicit codec reads what
    it names."""
    from mergepipe.api import plan_merge
    fam, cat = tiered["bf16"]
    levels = {}
    for mode in ("auto", "progressive"):
        plan = plan_merge(cat, "base", list(EXPERTS), op, save=False, weights=WEIGHTS, lam=LAM, budget="5%",
                          density=DENSITY if op != "task_arithmetic" else None, compact=mode)
        levels[mode] = {lv for lv, n in plan["tiers"]["compact"]["by_bits"].items()}
    assert levels["progressive"] == {"1", "2", "4"}
    assert levels["auto"] == ({"1", "2", "4"} if op == "task_arithmetic" else {"2", "4"})
