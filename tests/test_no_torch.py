"""Merging bf16/fp32 safetensors with a task-vector operator never imports torch: the fused numba kernels do
the tensor work, and everything around them (register, ANALYZE, plan, merge, execute, verify, explain) is
torch-free. Each case runs in a fresh interpreter (this test process has torch loaded) and asserts that
torch is absent at its end; a positive control (an interpolation method, whose block kernel is torch) shows
that the check can fail. Also: numba's kernels come from its on-disk cache, so a second process running the
same merge compiles nothing (counted by the dispatchers' cache statistics, never timed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mergepipe
from merge_helpers import ALL_OPS, copy_catalog, shared_family

REPO = Path(mergepipe.__file__).resolve().parents[1]
EXPERTS = ["e1", "e2", "e3"]
SPARSE = {"ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear"}

# Runs in a fresh interpreter: argv[1] is a JSON list of steps, each ["api", name, kwargs] or ["cli", argv];
# prints one JSON line: the steps' results and whether torch (and numba) got imported; also which of the modules
# numba would import for nothing (ops/numba_setup.py) were.
CHILD = r"""
import json, sys
steps = json.loads(sys.argv[1])
results = []
for kind, *rest in steps:
    if kind == "cli":
        from mergepipe.cli.app import main
        results.append(main(rest[0]))
        continue
    from mergepipe import api
    db, operator, out, settings = rest
    cat = api.Catalog(db)
    try:
        plan, sid, manifest = api.merge(cat, "base", settings.pop("experts"), out, operator=operator, **settings)
        results.append({"manifest_hash": manifest.manifest_hash, "plan_id": plan.id, "digest": plan.digest,
                        "software": manifest.core["software"]})
    finally:
        cat.close()
stats = {}
for mod, names in (("mergepipe.ops.kernel_loops", ("merge_block", "random_l1", "_fill_uniform", "_abs_sum64")),
                   ("mergepipe.ops.nonfinite", ("_count_exp_all_ones",))):
    if mod in sys.modules:
        for name in names:
            fn = getattr(sys.modules[mod], name)
            stats[name] = [sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values())]
print("RESULT:" + json.dumps({"results": results, "torch": "torch" in sys.modules,
                              "numba": "numba" in sys.modules, "kernels": stats,
                              "unneeded": sorted(m for m in ("scipy", "cffi") if m in sys.modules)}))
"""


def run_child(steps: list, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MERGEPIPE_DB"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(steps)], capture_output=True, text=True, cwd=cwd,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT:")][-1]
    return json.loads(line[len("RESULT:"):])


def api_step(db: Path, op: str, out: Path, budget: str, **kw) -> list:
    settings = {"experts": EXPERTS, "budget": budget, "seed": 3, **kw}
    if op in SPARSE:
        settings["density"] = 0.5
    return ["api", str(db), op, str(out), settings]


@pytest.fixture(scope="module", params=["tiny-bf16", "tiny-fp32"])
def fam(request, tmp_path_factory):
    return shared_family(tmp_path_factory, request.param)


@pytest.mark.slow
def test_api_merges_of_every_fused_operator_import_no_torch(fam, tmp_path):
    """Every task-vector operator at 10 % and 100 % budgets, through the API on an analyzed catalog; the
    manifests (software field included) equal those of the same merges in a process with torch loaded."""
    db = copy_catalog(fam, tmp_path / "c.sqlite")
    steps = [api_step(db, op, tmp_path / f"{op}-{b}", f"{b}%") for op in ALL_OPS for b in (10, 100)]
    got = run_child(steps, tmp_path)
    assert got["numba"] and not got["torch"], got
    import torch  # noqa: F401  (this process: torch loaded, as it was for every merge before)
    from mergepipe import api
    cat = api.Catalog(copy_catalog(fam, tmp_path / "ref.sqlite"))
    try:
        for (_, _, op, out, settings), result in list(zip(steps, got["results"]))[::5]:
            plan, _, manifest = api.merge(cat, "base", settings.pop("experts"), tmp_path / ("ref-" + Path(out).name),
                                          operator=op, **settings)
            assert (plan.id, plan.digest) == (result["plan_id"], result["digest"]), op
            assert manifest.manifest_hash == result["manifest_hash"], op
            assert manifest.core["software"] == result["software"] == {"mergepipe": mergepipe.__version__,
                                                                       "torch": torch.__version__}
    finally:
        cat.close()


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


@pytest.mark.slow
def test_cli_commands_import_no_torch(bf16, tmp_path):
    """register, plan, merge, execute, explain (plan and snapshot), verify and snapshots in one fresh
    interpreter, on a catalog analyzed beforehand."""
    db = copy_catalog(bf16, tmp_path / "c.sqlite")
    shutil.copytree(bf16.experts[0], tmp_path / "extra")
    cli = [
        ["--db", str(db), "register", "--base", "base", str(tmp_path / "extra")],
        ["--db", str(db), "--json", "plan", "--base", "base", "--experts", *EXPERTS, "--op", "ties", "--density",
         "0.5", "--budget", "50%"],
        ["--db", str(db), "merge", "--base", "base", "--experts", *EXPERTS, "--op", "dare_ties", "--density", "0.5",
         "--budget", "30%", "--out", str(tmp_path / "m1")],
        ["--db", str(db), "explain", "m1"],
        ["--db", str(db), "verify", str(tmp_path / "m1")],
        ["--db", str(db), "snapshots"],
        ["--db", str(db), "models"],
    ]
    got = run_child([["cli", argv] for argv in cli], tmp_path)
    assert got["results"] == [0] * len(cli) and not got["torch"] and got["numba"], got
    assert got["unneeded"] == [], got
    plan_id = _stored_plan(db, "ties")
    got = run_child([["cli", ["--db", str(db), "execute", plan_id, "--out", str(tmp_path / "m2")]],
                     ["cli", ["--db", str(db), "explain", plan_id]],
                     ["cli", ["--db", str(db), "verify", str(tmp_path / "m2")]]], tmp_path)
    assert got["results"] == [0, 0, 0] and not got["torch"], got


def _stored_plan(db: Path, op: str) -> str:
    from mergepipe.api import Catalog, plan_rows
    cat = Catalog(db)
    try:
        return next(r["id"] for r in plan_rows(cat) if r["operator"] == op)
    finally:
        cat.close()


@pytest.mark.slow
def test_analyze_and_a_first_merge_import_no_torch(bf16, tmp_path):
    """ANALYZE, and a first merge over experts never analyzed (it analyzes them on the way), fresh catalogs."""
    cats = {}
    for name in ("a", "b"):
        cats[name] = db = tmp_path / f"{name}.sqlite"
        args = ["--db", str(db), "register", str(bf16.base)]
        sub = run_child([["cli", args], ["cli", ["--db", str(db), "register", "--base", "base", *map(str, bf16.experts)]]],
                        tmp_path)
        assert sub["results"] == [0, 0] and not sub["torch"], sub
    experts = [p.name for p in bf16.experts]
    got = run_child([["cli", ["--db", str(cats["a"]), "analyze", *experts]]], tmp_path)
    assert got["results"] == [0] and not got["torch"], got
    assert got["numba"] and got["unneeded"] == [], got
    got = run_child([["cli", ["--db", str(cats["b"]), "merge", "--base", "base", "--experts", *experts, "--op", "ties",
                              "--density", "0.5", "--out", str(tmp_path / "first")]]], tmp_path)
    assert got["results"] == [0] and not got["torch"], got


@pytest.mark.slow
def test_positive_control_an_interpolation_method_imports_torch(bf16, tmp_path):
    """The check can fail: an interpolation method's block kernel (nearswap's) is torch, and the same child
    reports it."""
    db = copy_catalog(bf16, tmp_path / "c.sqlite")
    step = api_step(db, "nearswap", tmp_path / "out", "100%")
    step[4].update(experts=EXPERTS[:1], t=0.5)
    got = run_child([step], tmp_path)
    assert got["torch"], got


@pytest.mark.slow
def test_a_second_process_loads_every_kernel_from_numba_cache(bf16, tmp_path):
    """The same merges in two fresh processes: the second compiles nothing (every kernel it calls is a cache
    hit, no miss), so numba's on-disk cache works (kernels at module level, cache=True, a writable cache)."""
    db = copy_catalog(bf16, tmp_path / "c.sqlite")
    ops = ("ties", "dare_ties", "linear")
    first = run_child([api_step(db, op, tmp_path / f"a-{op}", "50%") for op in ops], tmp_path)
    second = run_child([api_step(db, op, tmp_path / f"b-{op}", "50%") for op in ops], tmp_path)
    assert not second["torch"], second
    stats = second["kernels"]
    for name in ("merge_block", "random_l1", "_count_exp_all_ones"):
        hits, misses = stats[name]
        assert hits >= 1 and misses == 0, (name, stats, first["kernels"])
    assert all(misses == 0 for _, misses in stats.values()), stats
    assert [r["manifest_hash"] for r in first["results"]] == [r["manifest_hash"] for r in second["results"]]
