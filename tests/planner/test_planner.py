"""The budget-aware planner: access set, greedy selection, budget soundness, error bound, target
bound, content addressing, and planning from the catalog alone (no expert tensor byte read)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError, PlanError
from mergepipe.planner.context import Planner
from mergepipe.planner.plan import expand_ranges, load_plan
from mergepipe.catalog.models import register

from merge_helpers import DENSITIES, l2_dist, load_dir, open_copy, shared_family

WEIGHTS = [0.5, 1.0, 0.3]
PLAN_CORE_KEYS = ("format", "base", "experts", "operator", "params", "seed", "strategy", "grid", "budget",
                  "access", "thresholds")


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


@pytest.fixture(scope="module")
def cat(fam, tmp_path_factory):
    """A module-private catalog copy; tests here only plan (save=False) or save plans."""
    c = open_copy(fam, tmp_path_factory.mktemp("planner") / "c.sqlite")
    yield c
    c.close()


def blocks_of(cat, expert_id):
    return cat.query("SELECT tensor, block, nbytes, delta_l2, delta_max_abs, delta_nnz FROM blocks "
                     "WHERE model_id = ?", [expert_id])


def triples(plan) -> set[tuple[str, str, int]]:
    return {(e, t, b) for e, ts in plan["access"].items() for t, rs in ts.items() for b in expand_ranges(rs)}


def coefficient(op, w, wsum, lam=1.0):
    return w / wsum if op == "linear" else w * lam


def candidates(cat, expert_ids, weights, op, density=None, lam=1.0):
    """Independent candidate list from the blocks table: (expert, tensor, block) -> (nbytes, bound term)."""
    wsum = sum(weights)
    out = {}
    for eid, w in zip(expert_ids, weights):
        stats = cat.tensor_stats(eid)
        for r in blocks_of(cat, eid):
            if not r["delta_nnz"]:
                continue
            if op == "ties":
                thr = stats[r["tensor"]]["thresholds"][density]
                if thr == float("inf"):  # int(density * n) = 0: mergekit keeps the largest entry
                    thr = stats[r["tensor"]]["delta_max_abs"]
                if r["delta_max_abs"] < thr:
                    continue
            out[(eid, r["tensor"], r["block"])] = (r["nbytes"], abs(coefficient(op, w, wsum, lam)) * r["delta_l2"])
    return out


def test_full_budget_selects_every_useful_block_and_no_zero_block(cat, fam):
    ids = fam.expert_ids
    plan = Planner(cat).plan("base", ids, "linear", weights=WEIGHTS, save=False)
    cand = candidates(cat, ids, WEIGHTS, "linear")
    assert triples(plan) == set(cand)
    assert plan["full_expert_bytes"] == sum(n for n, _ in cand.values())
    assert plan["estimate"]["expert_read"] == plan["full_expert_bytes"] == plan["budget"]["bytes"]
    # The family has frozen tensors (exactly zero delta): those blocks are never worth reading.
    zero = {(e, r["tensor"], r["block"]) for e in ids for r in blocks_of(cat, e) if not r["delta_nnz"]}
    assert zero and not (zero & triples(plan))
    total_blocks = sum(1 for e in ids for _ in blocks_of(cat, e))
    assert plan.selected_blocks == len(cand) < total_blocks
    assert plan["error_bound"]["absolute"] == 0.0 and plan["error_bound"]["relative"] == 0.0


def test_full_budget_ties_skips_blocks_below_the_topk_threshold(cat, fam):
    ids = fam.expert_ids
    plan = Planner(cat).plan("base", ids, "ties", weights=WEIGHTS, density=0.3, save=False)
    cand = candidates(cat, ids, WEIGHTS, "ties", density=0.3)
    assert triples(plan) == set(cand)
    linear = Planner(cat).plan("base", ids, "linear", weights=WEIGHTS, save=False)
    assert plan["full_expert_bytes"] <= linear["full_expert_bytes"]
    # Row scales vary, so at a low density many 4 KiB blocks hold no top-k entry and are never read.
    sparse = Planner(cat).plan("base", ids, "ties", weights=WEIGHTS, density=0.01, save=False)
    assert triples(sparse) == set(candidates(cat, ids, WEIGHTS, "ties", density=0.01))
    assert sparse["full_expert_bytes"] < 0.8 * linear["full_expert_bytes"]
    # the blockwise bound is for linear/task_arithmetic; TIES gets the sound, loose sparsified one
    assert plan["error_bound"]["kind"] == "sparsified" and plan["error_bound"]["full_delta_norm"] is None
    assert plan["thresholds"]["e1"]  # per-tensor thresholds come from the catalog and are part of the plan
    for eid in ids:
        stats = cat.tensor_stats(eid)
        for t, vals in plan["thresholds"][eid].items():
            assert vals[0] == stats[t]["thresholds"][0.3]  # [threshold, L1 ratio (1: no rescale), exact-k cut]
            assert vals[1] == 1.0 and len(vals) == 4


@pytest.mark.parametrize("op", ["linear", "task_arithmetic"])
@pytest.mark.parametrize("budget", ["1%", "7%", "25%", "0.5", "99%", "100000B", "300KiB"])
def test_greedy_selection_budget_sound_and_bound_exact(cat, fam, op, budget):
    ids = fam.expert_ids
    lam = 0.7 if op == "task_arithmetic" else 1.0
    kw = {"lam": lam} if op == "task_arithmetic" else {}
    plan = Planner(cat).plan("base", ids, op, weights=WEIGHTS, budget=budget, save=False, **kw)
    cand = candidates(cat, ids, WEIGHTS, op, lam=lam)
    chosen = triples(plan)
    assert chosen <= set(cand)
    used = sum(cand[c][0] for c in chosen)
    B = plan["budget"]["bytes"]
    assert used == plan["estimate"]["expert_read"] <= B <= plan["full_expert_bytes"]
    assert sum(plan["expert_read_by_expert"].values()) == used == sum(plan["expert_read_by_tensor"].values())
    for eid in ids:
        assert plan["expert_read_by_expert"][eid] == sum(cand[c][0] for c in chosen if c[0] == eid)
        assert plan["blocks_selected"][eid] == sum(1 for c in chosen if c[0] == eid)
    # Greedy by score per byte: everything that ranks strictly above the best omitted block is chosen,
    # and the best omitted block did not fit.
    omitted = [c for c in cand if c not in chosen]
    if omitted:
        ratio = {c: cand[c][1] / cand[c][0] for c in cand}
        best = max(omitted, key=lambda c: ratio[c])
        assert all(c in chosen for c in cand if ratio[c] > ratio[best] * (1 + 1e-12))
        assert used + cand[best][0] > B
        assert len(chosen) > 0 or B < min(n for n, _ in cand.values())
    # Error bound: the additive one is the sum over omitted blocks of |c_i| * ||delta||, from the catalog; the
    # headline (absolute) is the tighter blockwise one (checked below)
    bound = sum(cand[c][1] for c in omitted)
    assert plan["error_bound"]["additive"] == pytest.approx(bound, rel=1e-9, abs=1e-15)
    assert plan["error_bound"]["absolute"] == plan["error_bound"]["blockwise"] <= bound * (1 + 1e-12)
    norm = plan["error_bound"]["full_delta_norm"]
    assert plan["error_bound"]["additive_relative"] == pytest.approx(bound / norm, rel=1e-9, abs=1e-15)
    assert plan["error_bound"]["relative"] == pytest.approx(plan["error_bound"]["absolute"] / norm, rel=1e-9,
                                                            abs=1e-15)
    # The blockwise bound: per (tensor, block) position, the omitted experts' terms add, then an l2 over positions.
    per_position: dict = {}
    for c in omitted:
        per_position[c[1:]] = per_position.get(c[1:], 0.0) + cand[c][1]
    blockwise = math.sqrt(sum(v * v for v in per_position.values()))
    assert plan["error_bound"]["blockwise"] == pytest.approx(blockwise, rel=1e-9, abs=1e-15)
    assert plan["error_bound"]["blockwise"] <= plan["error_bound"]["absolute"] * (1 + 1e-12)


def test_budget_monotone_bound_and_selection(cat, fam):
    ids = fam.expert_ids
    prev_bound, prev_used = math.inf, -1
    for pct in (2, 5, 10, 20, 40, 60, 80, 100):
        p = Planner(cat).plan("base", ids, "task_arithmetic", weights=WEIGHTS, budget=f"{pct}%", save=False)
        assert p["error_bound"]["absolute"] <= prev_bound + 1e-15
        assert p["estimate"]["expert_read"] >= prev_used
        prev_bound, prev_used = p["error_bound"]["absolute"], p["estimate"]["expert_read"]
    assert prev_bound == 0.0


def test_full_delta_norm_estimate_matches_real_merge(cat, fam, tmp_path):
    from mergepipe.engine.engine import Engine
    for op, w in (("linear", WEIGHTS), ("task_arithmetic", [0.5, 1.0, -0.3])):
        plan = Planner(cat).plan("base", fam.expert_ids, op, weights=w)
        Engine(cat).execute(plan, out=tmp_path / op)
        real = l2_dist(load_dir(tmp_path / op), load_dir(fam.base))
        assert real > 0
        assert plan["error_bound"]["full_delta_norm"] == pytest.approx(real, rel=0.02)


@pytest.mark.parametrize("eps", [0.5, 0.2, 0.05, 0.01])
@pytest.mark.parametrize("op", ["linear", "task_arithmetic"])
def test_target_bound_picks_smallest_budget(cat, fam, op, eps):
    ids = fam.expert_ids
    planner = Planner(cat)
    plan = planner.plan("base", ids, op, weights=WEIGHTS, target_bound=eps, save=False)
    chosen = plan["budget"]["bytes"]
    assert plan["error_bound"]["relative"] <= eps
    assert plan["estimate"]["expert_read"] <= chosen < plan["full_expert_bytes"]
    assert plan["target_bound"] == eps and plan["budget"]["spec"] == f"target-bound {eps:g}"
    smaller = planner.plan("base", ids, op, weights=WEIGHTS, budget=f"{chosen - 1}B", save=False)
    assert smaller["error_bound"]["relative"] > eps
    # The same budget given as bytes selects the same blocks.
    same = planner.plan("base", ids, op, weights=WEIGHTS, budget=f"{chosen}B", save=False)
    assert same["access"] == plan["access"]


def test_target_bound_met_without_reading_anything(cat, fam):
    """A target at or above the bound of reading nothing (relative >= 1 by the triangle inequality) is
    met by the empty access set: the smallest budget is 0 bytes."""
    planner = Planner(cat)
    nothing = planner.plan("base", fam.expert_ids, "linear", weights=WEIGHTS, budget="1B", save=False)
    assert nothing["estimate"]["expert_read"] == 0
    eps = nothing["error_bound"]["relative"] * 1.01
    assert eps >= 1.0
    plan = planner.plan("base", fam.expert_ids, "linear", weights=WEIGHTS, target_bound=eps, save=False)
    assert plan["error_bound"]["relative"] <= eps
    assert plan["budget"]["bytes"] == 0 and plan["estimate"]["expert_read"] == 0 and plan.selected_blocks == 0


def test_empty_access_set_executes_to_the_base(fam, tmp_path):
    from mergepipe.engine.engine import Engine
    cat = open_copy(fam, tmp_path / "c.sqlite")
    plan = Planner(cat).plan("base", fam.expert_ids, "linear", weights=WEIGHTS, target_bound=1e9)
    assert plan["budget"]["bytes"] == 0
    _, m = Engine(cat).execute(plan, out=tmp_path / "out")
    assert m.core["realized"]["expert_read"] == 0 and m.core["touched"] == {e: {} for e in fam.expert_ids}
    out, base = load_dir(tmp_path / "out"), load_dir(fam.base)
    assert all(torch.equal(out[k], base[k]) for k in base)
    cat.close()


def test_target_bound_zero_and_errors(cat, fam):
    planner = Planner(cat)
    p = planner.plan("base", fam.expert_ids, "linear", target_bound=0.0, save=False)
    assert p["error_bound"]["absolute"] == pytest.approx(0.0, abs=1e-12)
    assert p["estimate"]["expert_read"] == p["full_expert_bytes"]
    with pytest.raises(PlanError, match="additive"):
        planner.plan("base", fam.expert_ids, "ties", density=0.3, target_bound=0.1, save=False)
    with pytest.raises(PlanError):
        planner.plan("base", fam.expert_ids, "linear", target_bound=-0.1, save=False)


def test_plan_is_content_addressed(cat, fam):
    ids = fam.expert_ids
    planner = Planner(cat)
    a = planner.plan("base", ids, "dare_ties", weights=WEIGHTS, density=0.3, budget="40%", seed=7)
    b = planner.plan("base", ids, "DARE", weights=WEIGHTS, density=0.3, budget="40%", seed=7, save=False)
    assert a.to_json() == b.to_json() and a.id == b.id and a.digest == b.digest
    core = {k: a.data[k] for k in PLAN_CORE_KEYS}
    digest = hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert a.digest == "sha256:" + digest and a.id == "plan-" + digest[:16]
    assert a["base"]["fingerprint"] == cat.model("base")["fingerprint"]
    assert [e["fingerprint"] for e in a["experts"]] == [cat.model(i)["fingerprint"] for i in ids]
    # Stored in the catalog, loaded back identical (also by the short id).
    assert load_plan(cat, a.id).data == a.data
    assert load_plan(cat, a.id[len("plan-"):]).data == a.data
    row = cat.query("SELECT * FROM plans WHERE id = ?", [a.id])[0]
    assert row["operator"] == "dare_ties" and row["budget_bytes"] == a["budget"]["bytes"]
    assert row["expert_read_bytes"] == a["estimate"]["expert_read"]
    # Every input of the digest changes it.
    variants = [
        dict(weights=WEIGHTS, density=0.3, budget="40%", seed=8),
        dict(weights=[0.5, 1.0, 0.31], density=0.3, budget="40%", seed=7),
        dict(weights=WEIGHTS, density=0.31, budget="40%", seed=7),
        dict(weights=WEIGHTS, density=0.3, budget="41%", seed=7),
        dict(weights=WEIGHTS, density=0.3, budget="40%", seed=7, rescale=False),
        dict(weights=WEIGHTS, density=0.3, budget="40%", seed=7, strategy="conflict"),
    ]
    digests = {planner.plan("base", ids, "dare_ties", save=False, **v).digest for v in variants}
    assert len(digests) == len(variants) and a.digest not in digests
    with pytest.raises(PlanError, match="unknown plan"):
        load_plan(cat, "plan-0000000000000000")


def test_operator_defaults_and_aliases(cat, fam):
    planner = Planner(cat)
    ids = fam.expert_ids
    expect = {
        "linear": {"normalize": True, "rescale": False, "lambda": 1.0},
        "AVG": {"normalize": True, "rescale": False, "lambda": 1.0},
        "task_arithmetic": {"normalize": False, "rescale": False, "lambda": 1.0},
        "TIES": {"normalize": True, "rescale": False, "lambda": 1.0},
        "dare_linear": {"normalize": False, "rescale": True, "lambda": 1.0},
        "DARE": {"normalize": False, "rescale": True, "lambda": 1.0},
        "breadcrumbs": {"normalize": False, "rescale": False, "lambda": 1.0, "gamma": 0.01},
        "breadcrumbs_ties": {"normalize": False, "rescale": False, "lambda": 1.0, "gamma": 0.01},
        "della": {"normalize": True, "rescale": True, "lambda": 1.0, "epsilon": 0.15},
        "della_linear": {"normalize": False, "rescale": True, "lambda": 1.0, "epsilon": 0.15},
    }
    names = {"AVG": "linear", "TIES": "ties", "DARE": "dare_ties"}
    for op, params in expect.items():
        p = planner.plan("base", ids, op, density=0.3, save=False)
        assert p["params"] == params, op
        assert p["operator"] == names.get(op, op)
        dens = [e["density"] for e in p["experts"]]
        assert dens == ([None] * 3 if p["operator"] in ("linear", "task_arithmetic") else [0.3] * 3)
    p = planner.plan("base", ids, "ties", density=0.3, normalize=False, lam=0.5, save=False)
    assert p["params"] == {"normalize": False, "rescale": False, "lambda": 0.5}
    with pytest.raises(PlanError, match="no parameter gamma"):
        planner.plan("base", ids, "ties", density=0.3, gamma=0.1, save=False)


def test_per_expert_density_and_weights(cat, fam):
    ids = fam.expert_ids
    p = Planner(cat).plan("base", [{"model": "e1", "weight": 2.0, "density": 0.5}, "e2",
                                   {"model": "e3", "weight": -0.5}], "ties", density=0.3, save=False)
    assert [(e["id"], e["weight"], e["density"]) for e in p["experts"]] == [
        ("e1", 2.0, 0.5), ("e2", 1.0, 0.3), ("e3", -0.5, 0.3)]
    assert all(v[0] == cat.tensor_stats("e1")[t]["thresholds"][0.5] for t, v in p["thresholds"]["e1"].items())
    assert ids == ["e1", "e2", "e3"]


def test_conflict_strategy(cat, fam):
    ids = fam.expert_ids
    planner = Planner(cat)
    full_norm = planner.plan("base", ids, "ties", weights=WEIGHTS, density=0.3, save=False)
    full_conf = planner.plan("base", ids, "ties", weights=WEIGHTS, density=0.3, strategy="conflict", save=False)
    assert full_norm["access"] == full_conf["access"]  # 100% reads every useful block whatever the score
    a = planner.plan("base", ids, "ties", weights=WEIGHTS, density=0.3, budget="30%", strategy="conflict", save=False)
    b = planner.plan("base", ids, "ties", weights=WEIGHTS, density=0.3, budget="30%", strategy="conflict", save=False)
    n = planner.plan("base", ids, "ties", weights=WEIGHTS, density=0.3, budget="30%", save=False)
    assert a.to_json() == b.to_json()
    assert a["estimate"]["expert_read"] <= a["budget"]["bytes"] == n["budget"]["bytes"]
    assert a["strategy"] == "conflict" and a.digest != n.digest
    assert triples(a) != triples(n)  # sign conflicts change which blocks are worth reading
    with pytest.raises(PlanError, match="strategy"):
        planner.plan("base", ids, "ties", density=0.3, strategy="best", save=False)


@pytest.mark.parametrize("strategy", ["kept", "random", "uniform"])
def test_baseline_and_kept_strategies_are_budget_sound_and_deterministic(cat, fam, strategy):
    ids = fam.expert_ids
    planner = Planner(cat)
    kw = dict(weights=WEIGHTS, density=0.3, save=False)
    full = planner.plan("base", ids, "ties", strategy=strategy, **kw)
    assert full["access"] == planner.plan("base", ids, "ties", **kw)["access"]
    a = planner.plan("base", ids, "ties", budget="30%", strategy=strategy, **kw)
    assert a.to_json() == planner.plan("base", ids, "ties", budget="30%", strategy=strategy, **kw).to_json()
    assert 0 < a["estimate"]["expert_read"] <= a["budget"]["bytes"]
    assert a["estimate"]["expert_read"] > 0.9 * a["budget"]["bytes"]  # greedy fills the budget
    n = planner.plan("base", ids, "ties", budget="30%", **kw)
    if strategy == "kept":  # scores shrink by the kept share of each block's energy
        norm_ctx = planner.context("base", ids, "ties", weights=WEIGHTS, density=0.3)
        kept_ctx = planner.context("base", ids, "ties", weights=WEIGHTS, density=0.3, strategy="kept")
        ratio = kept_ctx.candidates.score / norm_ctx.candidates.score
        assert ratio.min() > 0 and ratio.max() <= 1.0 + 1e-9 and ratio.std() > 0.01
    else:
        assert triples(a) != triples(n)


def test_random_strategy_follows_the_seed(cat, fam):
    kw = dict(weights=WEIGHTS, density=0.3, budget="30%", strategy="random", save=False)
    planner = Planner(cat)
    a, b = planner.plan("base", fam.expert_ids, "ties", seed=1, **kw), planner.plan("base", fam.expert_ids, "ties", seed=2, **kw)
    assert triples(a) != triples(b)


def test_uniform_strategy_takes_the_same_share_of_every_tensor(cat, fam):
    planner = Planner(cat)
    p = planner.plan("base", fam.expert_ids, "linear", budget="50%", strategy="uniform", save=False)
    cands = {}
    for eid in fam.expert_ids:
        for r in cat.query("SELECT tensor, count(*) AS n FROM blocks WHERE model_id = ? AND delta_nnz > 0 "
                           "GROUP BY tensor", [eid]):
            cands[(eid, r["tensor"])] = r["n"]
    shares = []
    for (eid, tensor), n in cands.items():
        if n >= 8:
            taken = sum(b - a for a, b in p["access"][eid].get(tensor, []))
            shares.append(taken / n)
    assert shares and max(shares) - min(shares) <= 0.3


def test_kept_strategy_scores_blocks_by_what_ties_keeps():
    """A block whose energy sits below the TIES threshold is worth less than its norm says."""
    from mergepipe.planner.strategies import _van_der_corput, _uniform_priority
    assert [_van_der_corput(i) for i in range(4)] == [0.0, 0.5, 0.25, 0.75]
    pr = _uniform_priority(np.array([0, 0, 0, 0]), np.array([1, 1, 1, 1]), np.array([3, 2, 1, 0]))
    assert list(np.argsort(-pr, kind="stable")) == [3, 1, 2, 0]  # blocks 0, 2, 1, 3


def test_planner_input_errors(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    planner = Planner(cat)
    ids = fam.expert_ids
    with pytest.raises(CatalogError, match="unknown model id 'nope'"):
        planner.plan("nope", ids, "linear")
    with pytest.raises(CatalogError, match="unknown model id 'e9'"):
        planner.plan("base", ["e1", "e9"], "linear")
    with pytest.raises(PlanError, match="unknown operator"):
        planner.plan("base", ids, "task_adapter")
    with pytest.raises(PlanError, match="no experts"):
        planner.plan("base", [], "linear")
    with pytest.raises(PlanError, match="twice"):
        planner.plan("base", ["e1", "e1"], "linear")
    with pytest.raises(PlanError, match="3 weights"):
        planner.plan("base", ["e1", "e2"], "linear", weights=[1, 2, 3])
    with pytest.raises(PlanError, match="finite"):
        planner.plan("base", ["e1"], "linear", weights=[float("nan")])
    for d in (0, 1.5, -0.2):
        with pytest.raises(PlanError, match="outside"):
            planner.plan("base", ids, "ties", density=d)
    with pytest.raises(PlanError, match="della"):
        planner.plan("base", ids, "della", density=0.05)  # density - epsilon must stay positive
    # No stored top-37% threshold, and an expert registered but not analyzed: not refused any more,
    # the plan reads those experts in full and analyzes them on the way (tests/engine/test_first_merge.py).
    no_thr = planner.plan("base", ids, "ties", density=0.37, save=False)
    assert [e["analyze"] for e in no_thr["experts"]] == ["no magnitude threshold for top-0.37"] * len(ids)
    register(cat, "e4", str(fam.experts[3]), base_id="base")
    fresh = planner.plan("base", ["e1", "e4"], "linear", budget="10%", save=False)
    assert [e.get("analyze") for e in fresh["experts"]] == [None, "not analyzed"]
    assert fresh["budget"]["bytes"] == fresh["full_expert_bytes"] == fresh["estimate"]["expert_read"]
    # A model with no base.
    register(cat, "loose", str(fam.experts[3]))
    with pytest.raises(PlanError, match="registered with base"):
        planner.plan("base", ["e1", "loose"], "linear")
    before = cat.query("SELECT COUNT(*) AS n FROM plans")[0]["n"]
    assert before == 0  # failed plans store nothing
    cat.close()


def test_planning_reads_no_expert_tensor_bytes(fam, tmp_path):
    """Plan, overwrite every expert tensor byte (keeping sizes and mtimes, so the fingerprints hold),
    plan again: the planner only sees the catalog, so the plans are identical."""
    root = tmp_path / "fam"
    shutil.copytree(fam.root / "fam" / "base", root / "base")
    for i in (1, 2):
        shutil.copytree(fam.experts[i - 1], root / f"expert_{i}")
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(root / "base"))
    for i in (1, 2):
        register(cat, f"e{i}", str(root / f"expert_{i}"), base_id="base")
    analyze(cat, block_bytes=4096, densities=DENSITIES)
    planner = Planner(cat)
    kw = dict(weights=[1.0, 0.5], density=0.3, save=False)
    before = {op: planner.plan("base", ["e1", "e2"], op, budget="35%", **kw).to_json()
              for op in ("ties", "linear", "breadcrumbs", "dare_ties")}
    before_conf = planner.plan("base", ["e1", "e2"], "ties", budget="35%", strategy="conflict", **kw).to_json()
    for i in (1, 2):
        for f in (root / f"expert_{i}").glob("*.safetensors"):
            st = f.stat()
            raw = bytearray(f.read_bytes())
            header_end = 8 + int.from_bytes(raw[:8], "little")
            raw[header_end:] = os.urandom(len(raw) - header_end)
            f.write_bytes(bytes(raw))
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = {op: planner.plan("base", ["e1", "e2"], op, budget="35%", **kw).to_json() for op in before}
    assert after == before
    assert planner.plan("base", ["e1", "e2"], "ties", budget="35%", strategy="conflict", **kw).to_json() == before_conf
    cat.close()


def test_explain_lists_experts_and_tensors(cat, fam):
    plan = Planner(cat).plan("base", fam.expert_ids, "linear", weights=WEIGHTS, budget="30%", save=False)
    text = plan.explain()
    lines = text.splitlines()
    assert lines[0].startswith(f"PLAN {plan.id}")
    for eid in fam.expert_ids:
        line = next(l for l in lines if l.strip().startswith(eid + " "))
        assert f"blocks {plan['blocks_selected'][eid]}/{plan['blocks_candidate'][eid]}" in line
    tensors = {t for ts in plan["access"].values() for t in ts}
    assert tensors
    for t in tensors:
        assert any(l.strip().startswith(t + " ") for l in lines), t
    assert "bound" in text


def test_access_ranges_are_compact_and_sorted(cat, fam):
    plan = Planner(cat).plan("base", fam.expert_ids, "linear", weights=WEIGHTS, budget="45%", save=False)
    for ts in plan["access"].values():
        assert list(ts) == sorted(ts)
        for rs in ts.values():
            for (a, b), (c, d) in zip(rs, rs[1:]):
                assert a < b < c < d  # half-open, disjoint and non-adjacent
    counts = np.array([len(expand_ranges(rs)) for ts in plan["access"].values() for rs in ts.values()])
    assert counts.sum() == plan.selected_blocks
