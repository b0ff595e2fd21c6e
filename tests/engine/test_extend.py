"""Incremental merges (issue 17): `merge --extend SNAPSHOT --add/--remove/--reweight`.

Every result is compared with an independent float64 reference of the from-scratch merge of the same set
with the same per-expert access sets (computed here from the checkpoints' tensors with the safetensors
library), and at 100 % with the engine's own from-scratch merge. The reads are checked against the plan
(the engine's counters and, cold, /proc/self/io), and refusals against a catalog dump.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import dump_catalog, fsync_tree, load_checkpoint_tensors, read_bytes_now
from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.errors import PlanError
from mergepipe.research.family import make_family
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.local import evict
from mergepipe.storage.registry import open_checkpoint
from mergepipe.storage.safetensors import FLOAT_DTYPES

BLOCK = 4096
EXPERTS = 4


def _family(root: Path, dtype: str):
    paths = make_family(root / "fam", experts=EXPERTS, size="tiny", dtype=dtype, shard_bytes=64 << 10, seed=3)
    db = root / "catalog.sqlite"
    cat = Catalog(db)
    register(cat, "base", paths["base"])
    for i, p in enumerate(paths["experts"], start=1):
        register(cat, f"e{i}", p, base_id="base")
    analyze(cat, block_bytes=BLOCK)
    cat.close()
    return db, paths


@pytest.fixture(scope="module")
def fams(tmp_path_factory):
    return {dt: _family(tmp_path_factory.mktemp(f"extend-{dt}"), dt) for dt in ("fp32", "bf16")}


@pytest.fixture
def cat_of(fams, tmp_path):
    """A private copy of a family's analyzed catalog (tests publish snapshots into it)."""
    opened = []

    def make(dtype: str) -> Catalog:
        import sqlite3
        src = sqlite3.connect(fams[dtype][0])
        dst_path = tmp_path / f"cat-{dtype}.sqlite"
        dst = sqlite3.connect(dst_path)
        src.backup(dst)
        src.close()
        dst.close()
        cat = Catalog(dst_path)
        opened.append(cat)
        return cat
    yield make
    for c in opened:
        c.close()


# --- the independent reference ---------------------------------------------------------------------
def reference(cat: Catalog, experts: dict[str, float], access: dict, operator: str, params: dict) -> dict:
    """base*beta + k * sum_i w_i * delta_i (delta_i only on its access blocks), in float64."""
    base_row = cat.model("base")
    base = {k: v.double() for k, v in load_checkpoint_tensors(Path(base_row["uri"])).items()}
    infos = open_checkpoint(base_row["uri"]).tensors
    W = math.fsum(experts.values())
    lam, normalize = params["lambda"], params["normalize"]
    k = lam / W if normalize else lam
    beta = W if operator == "linear" and not normalize else 1.0
    out = {}
    xs = {e: load_checkpoint_tensors(Path(cat.model(e)["uri"])) for e in experts}
    for name, b in base.items():
        info = infos[name]
        if info.dtype not in FLOAT_DTYPES:
            out[name] = b
            continue
        s = torch.zeros_like(b)
        for e, w in experts.items():
            blocks = {i for lo, hi in access.get(e, {}).get(name, []) for i in range(lo, hi)}
            d = xs[e][name].double() - b
            mask = torch.zeros(b.shape[0] if b.dim() else 1, dtype=torch.bool)
            for span in tensor_grid(info, BLOCK):
                if span.index in blocks:
                    mask[span.row_start:span.row_end] = True
            d = d * mask.reshape(-1, *([1] * (b.dim() - 1))) if b.dim() else d * mask[0]
            s += w * d
        out[name] = beta * b + k * s
    return out


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at |x| (float64)."""
    bits = {torch.bfloat16: 8, torch.float32: 24}[dtype]
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.pow(2.0, e - (bits - 1))


def deviation_ulps(result: Path, ref: dict, scale: dict | None = None) -> float:
    """Largest |result - ref| in units of the output dtype's spacing at max(|ref|, |scale|, |result|)."""
    got = load_checkpoint_tensors(result)
    worst = 0.0
    for name, r in ref.items():
        g = got[name]
        if not g.is_floating_point():
            assert torch.equal(g, r.to(g.dtype)), name
            continue
        mag = torch.maximum(r.abs(), g.double().abs())
        if scale is not None:
            mag = torch.maximum(mag, scale[name])
        worst = max(worst, float(((g.double() - r).abs() / ulp(mag, g.dtype)).max()))
    return worst


def magnitudes(path: Path) -> dict:
    return {k: v.double().abs() for k, v in load_checkpoint_tensors(path).items()}


def input_scale(cat: Catalog, *paths) -> dict:
    """Elementwise max |value| over the base, every expert and ``paths`` (the rounding errors of a merge
    are relative to its inputs' magnitudes: M = base + small deltas rounds at |base|'s spacing)."""
    scale: dict = {}
    for p in [cat.model(m["id"])["uri"] for m in cat.models() if m["id"] in ("base", *(f"e{i}" for i in range(1, EXPERTS + 1)))] + list(paths):
        for k, v in magnitudes(Path(p)).items():
            scale[k] = torch.maximum(scale[k], v) if k in scale else v
    return scale


def touched(manifest) -> dict:
    return manifest.core["touched"]


# --- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("operator", ["linear", "task_arithmetic"])
def test_full_budget_extend_equals_the_from_scratch_merge(cat_of, tmp_path, dtype, operator):
    cat = cat_of(dtype)
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "a", operator=operator, weights=[1.0, 2.0])
    plan, _, manifest = api.extend(cat, api.extend_request("a", "add", "e3", weight=0.5, out=tmp_path / "b"))
    scratch, _, m_scratch = api.merge(cat, "base", ["e1", "e2", "e3"], tmp_path / "c", operator=operator,
                                      weights=[1.0, 2.0, 0.5])
    assert plan["access"] == scratch["access"]  # at 100 % every expert's changed blocks
    assert touched(manifest) == touched(m_scratch)
    ref = reference(cat, {"e1": 1.0, "e2": 2.0, "e3": 0.5}, scratch["access"], operator, scratch["params"])
    scale = input_scale(cat, tmp_path / "a")
    ext, frm = deviation_ulps(tmp_path / "b", ref, scale), deviation_ulps(tmp_path / "c", ref, scale)
    # Spacing at the inputs' magnitudes: the from-scratch merge (float32 arithmetic) is within a few; the
    # extend adds the parent's rounding (0.5, scaled by a <= 1) and its own (0.5) -- bf16: at most 1.
    assert frm <= 4.0 and ext <= (4.0 if dtype == "fp32" else 1.0), (ext, frm)
    assert plan["error_bound"]["absolute"] == pytest.approx(0.0, abs=1e-12) == scratch["error_bound"]["absolute"]
    if dtype == "fp32":  # the engine's from-scratch result and the extend differ by fp32 rounding only
        a, c = load_checkpoint_tensors(tmp_path / "b"), load_checkpoint_tensors(tmp_path / "c")
        assert max(float((a[n] - c[n]).abs().max()) for n in a) < 1e-6


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_budgeted_add_reweight_remove_match_reference_with_the_same_access_sets(cat_of, tmp_path, dtype):
    cat = cat_of(dtype)
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "a", operator="task_arithmetic", weights=[1.0, 0.7],
              budget="30%", lam=0.8)
    p_add, _, m_add = api.extend(cat, api.extend_request("a", "add", "e3", weight=0.5, out=tmp_path / "b"))
    p_rw, _, m_rw = api.extend(cat, api.extend_request("b", "reweight", "e1", weight=1.5, out=tmp_path / "c"))
    p_rm, _, m_rm = api.extend(cat, api.extend_request("c", "remove", "e2", out=tmp_path / "d"))
    assert p_add["budget"]["spec"] == "30%"  # the parent's fraction, applied to the new expert
    assert p_add["expert_read_by_expert"]["e3"] <= 0.3 * p_add["full_expert_bytes"] < p_add["full_expert_bytes"]
    steps = [(tmp_path / "b", {"e1": 1.0, "e2": 0.7, "e3": 0.5}, p_add, tmp_path / "a"),
             (tmp_path / "c", {"e1": 1.5, "e2": 0.7, "e3": 0.5}, p_rw, tmp_path / "b"),
             (tmp_path / "d", {"e1": 1.5, "e3": 0.5}, p_rm, tmp_path / "c")]
    scale = input_scale(cat, *(s[3] for s in steps))
    for n, (out, weights, plan, parent) in enumerate(steps, start=1):
        assert sorted(plan["access"]) == sorted(weights)
        ref = reference(cat, weights, plan["access"], "task_arithmetic", plan["params"])
        dev = deviation_ulps(out, ref, scale)
        assert dev <= (n if dtype == "bf16" else 4.0), (n, dev)  # one more rounding per step (bf16)
        # the bound: exactly what a from-scratch plan with these access sets reports
        assert plan["error_bound"]["absolute"] == pytest.approx(scratch_bound(cat, weights, plan), rel=1e-9)
    assert p_rm["change"] == {"action": "remove", "expert": "e2", "weight_old": 0.7, "weight": None}


def scratch_bound(cat: Catalog, weights: dict, plan) -> float:
    """sum over experts of |c_i| * sum of ||delta|| over the changed blocks outside its access set."""
    p = plan["params"]
    W = math.fsum(weights.values())
    total = 0.0
    for e, w in weights.items():
        chosen = {(t, i) for t, rs in plan["access"][e].items() for lo, hi in rs for i in range(lo, hi)}
        omitted = math.fsum(r["delta_l2"] for r in cat.query(
            "SELECT tensor, block, delta_l2 FROM blocks WHERE model_id = ? AND delta_nnz > 0", [e])
            if (r["tensor"], r["block"]) not in chosen)
        c = w * p["lambda"] / (W if p["normalize"] else 1.0)
        total += abs(c) * omitted
    return total


def test_remove_undoes_add_in_fp32(cat_of, tmp_path):
    cat = cat_of("fp32")
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "a", operator="linear", weights=[1.0, 2.0], budget="40%")
    api.extend(cat, api.extend_request("a", "add", "e4", weight=3.0, out=tmp_path / "b"))
    _, _, m = api.extend(cat, api.extend_request("b", "remove", "e4", out=tmp_path / "c"))
    a, c = load_checkpoint_tensors(tmp_path / "a"), load_checkpoint_tensors(tmp_path / "c")
    assert max(float((a[n].double() - c[n].double()).abs().max()) for n in a) < 1e-6
    assert touched(m) == json.loads(cat.query("SELECT json FROM manifests m JOIN snapshots s ON s.id = m.snapshot_id "
                                              "WHERE s.model_id = 'a'")[0]["json"])["core"]["touched"]


@pytest.mark.parametrize("operator, action, budget", [("task_arithmetic", "add", "100%"),
                                                     ("linear", "reweight", "35%"), ("linear", "remove", "100%")])
def test_fused_kernel_and_torch_path_give_the_same_bytes(cat_of, tmp_path, operator, action, budget):
    """bf16 extends run the fused affine kernel; the torch path (Engine(fused=False)) writes the same files."""
    from mergepipe.engine.engine import Engine
    cat = cat_of("bf16")
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "p", operator=operator, weights=[1.0, 0.5], budget=budget)
    expert = "e3" if action == "add" else "e1"
    req = api.extend_request("p", action, expert, weight=None if action == "remove" else 2.0, out=tmp_path / "f")
    plan = api.plan_extend(cat, req)
    Engine(cat, fused=True).execute(plan, out=tmp_path / "f", model_id="f")
    Engine(cat, fused=False).execute(plan, out=tmp_path / "t", model_id="t")
    fused, plain = load_checkpoint_tensors(tmp_path / "f"), load_checkpoint_tensors(tmp_path / "t")
    assert fused.keys() == plain.keys()
    assert all(torch.equal(fused[n].view(torch.int16), plain[n].view(torch.int16)) for n in fused
               if fused[n].dtype == torch.bfloat16)
    assert any(not torch.equal(fused[n], load_checkpoint_tensors(tmp_path / "p")[n]) for n in fused)


OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "reweight"]), st.integers(1, EXPERTS),
                         st.sampled_from([0.25, 0.5, 1.0, 2.0])), min_size=1, max_size=3)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, operator=st.sampled_from(["linear", "task_arithmetic"]), dtype=st.sampled_from(["fp32", "bf16"]),
       budget=st.sampled_from(["100%", "35%"]))
def test_random_sequences_of_changes_match_the_reference(cat_of, tmp_path_factory, ops, operator, dtype, budget):
    cat = cat_of(dtype)
    root = tmp_path_factory.mktemp("seq")
    weights = {"e1": 1.0, "e2": 0.5}
    api.merge(cat, "base", list(weights), root / "s0", operator=operator, weights=list(weights.values()),
              budget=budget)
    current, steps, scale, amplified = "s0", 0, input_scale(cat), 1.0
    for i, (action, n, w) in enumerate(ops, start=1):
        expert = f"e{n}"
        if action == "add" and expert in weights or action != "add" and expert not in weights \
                or action == "remove" and len(weights) == 1:
            continue  # a change this set cannot take (tested as refusals elsewhere)
        req = api.extend_request(current, action, expert, weight=None if action == "remove" else w,
                                 out=root / f"s{i}")
        for k, v in magnitudes(root / current).items():
            scale[k] = torch.maximum(scale[k], v)
        plan, _, _ = api.extend(cat, req)
        if action == "remove":
            del weights[expert]
        else:
            weights[expert] = w
        current, steps = f"s{i}", steps + 1
        amplified *= max(1.0, abs(plan["coefficients"]["a"]))
        ref = reference(cat, weights, plan["access"], operator, plan["params"])
        dev = deviation_ulps(root / current, ref, scale)
        # fp32: within a few ulp of the inputs' magnitudes (float64 arithmetic, one rounding per step), the
        # snapshot's own rounding scaled by each step's rescale factor a (removing 1.0 of 1.5: a = 3);
        # bf16: one extra rounding per step, each at most 0.5 ulp scaled by the rescale factor a
        bound = 4.0 * steps * amplified if dtype == "fp32" else steps * max(1.0, abs(plan["coefficients"]["a"])) + 1.0
        assert dev <= bound, (ops, operator, dtype, steps, dev)


# --- reads ----------------------------------------------------------------------------------------
def test_reads_are_the_snapshot_the_expert_and_the_needed_base_blocks_cold(tmp_path):
    """Counted from /proc/self/io after evicting every file of the family and the parent snapshot: the
    extend reads what its plan says (snapshot + expert blocks + base blocks), never the other experts."""
    paths = make_family(tmp_path / "fam", experts=4, size="small", dtype="bf16", shard_bytes=4 << 20, seed=1)
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", paths["base"])
    for i, p in enumerate(paths["experts"], start=1):
        register(cat, f"e{i}", p, base_id="base")
    analyze(cat, block_bytes=256 << 10)
    api.merge(cat, "base", ["e1", "e2", "e3"], tmp_path / "s", operator="task_arithmetic", budget="25%")
    req = api.extend_request("s", "add", "e4", weight=0.5, out=tmp_path / "t")
    plan = api.plan_extend(cat, req)
    est = plan["estimate"]
    everything = [Path(paths["base"]), *map(Path, paths["experts"]), tmp_path / "s"]
    fsync_tree(*everything)
    evict(everything)
    before = read_bytes_now()
    _, _, manifest = api.extend(cat, req)
    read = read_bytes_now() - before
    planned = est["snapshot_read"] + est["base_read"] + est["expert_read"]
    realized = manifest.core["realized"]
    assert (realized["snapshot_read"], realized["base_read"], realized["expert_read"]) == \
        (est["snapshot_read"], est["base_read"], est["expert_read"])
    assert est["expert_read"] < 0.3 * plan["full_expert_bytes"]
    # headers, config and tokenizer files, the catalog: well under 1 % of the model here
    assert planned <= read <= planned * 1.01 + (256 << 10), (read, planned)
    scratch = plan["from_scratch_estimate"]
    assert read < scratch["base_read"] + scratch["expert_read"]
    cat.close()


# --- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("operator", ["ties", "dare_linear"])
def test_non_additive_snapshots_are_refused_and_nothing_changes(cat_of, tmp_path, operator):
    cat = cat_of("fp32")
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "a", operator=operator, weights=[1.0, 1.0], density=0.5)
    before = dump_catalog(cat)
    with pytest.raises(PlanError) as err:
        api.extend(cat, api.extend_request("a", "add", "e3", weight=0.5, out=tmp_path / "b"))
    assert str(err.value).startswith(f"snapshot a was merged with {operator}, which is not additive")
    assert "sign election" in str(err.value)
    assert str(err.value).endswith(f"mergepipe merge --base base --experts e1 e2 e3 --op {operator} "
                                   f"--weights 1 1 0.5 --density 0.5 --budget 100% --out {tmp_path / 'b'}")
    assert dump_catalog(cat) == before and not (tmp_path / "b").exists()


@pytest.mark.parametrize("action,expert,weight,message", [
    ("add", "e1", 1.0, "'e1' is already an expert of snapshot a (use --reweight)"),
    ("remove", "e3", None, "'e3' is not an expert of snapshot a (its experts: e1, e2)"),
    ("reweight", "e3", 2.0, "'e3' is not an expert of snapshot a (its experts: e1, e2)"),
    ("add", "e3", 0.0, None),  # fine: a zero weight adds nothing but is a valid change
])
def test_changes_the_set_cannot_take_are_refused(cat_of, tmp_path, action, expert, weight, message):
    cat = cat_of("fp32")
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "a", operator="linear")
    before = dump_catalog(cat)
    req = api.extend_request("a", action, expert, weight=weight, out=tmp_path / "b")
    if message is None:
        api.extend(cat, req)
        a, b = load_checkpoint_tensors(tmp_path / "a"), load_checkpoint_tensors(tmp_path / "b")
        assert all(torch.equal(a[n], b[n]) for n in a)
        return
    with pytest.raises(PlanError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        api.extend(cat, req)
    assert dump_catalog(cat) == before


def test_a_re_registered_expert_cannot_be_removed(cat_of, tmp_path):
    cat = cat_of("fp32")
    api.merge(cat, "base", ["e1", "e2"], tmp_path / "a", operator="linear")
    cat.db["models"].update("e2", {"fingerprint": "changed"})  # what a re-registration of new files records
    with pytest.raises(PlanError, match="re-registered"):
        api.plan_extend(cat, api.extend_request("a", "remove", "e2", out=tmp_path / "b"))


# --- lineage and the command line -----------------------------------------------------------------
def test_cli_extend_records_an_extends_edge_and_refuses_in_one_line(fams, tmp_path):
    import shutil
    db = tmp_path / "c.sqlite"
    shutil.copy(fams["fp32"][0], db)
    env = {**os.environ, "PYTHONPATH": str(Path(api.__file__).resolve().parents[2])}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mergepipe.cli", "--db", str(db), *args],
                              capture_output=True, text=True, env=env, cwd=tmp_path)
    assert cli("merge", "--base", "base", "--experts", "e1", "e2", "--op", "task_arithmetic",
               "--out", str(tmp_path / "a")).returncode == 0
    r = cli("--json", "merge", "--extend", "a", "--add", "e3", "--weight", "0.5", "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["change"] == {"action": "add", "expert": "e3", "weight_old": None, "weight": 0.5}
    assert out["model_id"] == "b" and out["extends"].startswith("snap-")
    cat = Catalog(db)
    try:
        edges = {(e["parent_id"], e["role"]) for e in api.lineage(cat, "b")["edges"] if e["child_id"] == "b"}
        assert edges == {("a", "extends"), ("base", "base"), ("e1", "expert"), ("e2", "expert"), ("e3", "expert")}
        assert api.verify(cat, "b")["ok"]
        before = dump_catalog(cat)
    finally:
        cat.close()
    bad = cli("merge", "--extend", "b", "--reweight", "e9", "2", "--out", str(tmp_path / "c"))
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert bad.stderr == "error: 'e9' is not an expert of snapshot b (its experts: e1, e2, e3)\n"
    flags = cli("merge", "--extend", "b", "--add", "e4", "--op", "ties", "--out", str(tmp_path / "c"))
    assert flags.stderr == "error: --extend keeps the snapshot's operator and parameters; drop --op\n"
    cat = Catalog(db)
    try:
        assert dump_catalog(cat) == before
    finally:
        cat.close()
