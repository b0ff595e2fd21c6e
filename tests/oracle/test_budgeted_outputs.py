"""What a budgeted merge must output, for every operator, checked against an independent oracle.

``reference.py`` (numpy, float64, its own safetensors parser, no MergePipe kernel) merges each plan's
access set from the raw files; here the engine's published output is compared with it at 10 %, 50 % and
100 % expert-read budgets, on an fp32 and a bf16 family, each with two full experts, a delta checkpoint
(in the other float dtype) and a PEFT LoRA adapter, with negative weights, lambda != 1, and variants
with density 1 and weights summing to exactly 0. The kernel's own read count (/proc/self/io, cold
page cache, in a child process) is checked against the plan for every operator.

Tolerances (``reference.Result.err``): the oracle is exact float64 on the exact inputs; MergePipe
computes in float32, so each entry may differ by the float32 rounding of the K + 6 steps it takes
(delta, weight, K-term sum, rescale, divisor, lambda, base addition): (K + 6)·2⁻²⁴ times the
magnitudes combined, plus the error of LoRA's float32 B @ A (r + 2)·2⁻²⁴·scale·(|B| @ |A|); a bf16
output then adds half a bf16 ulp (the engine rounds its float32 result to the nearest bf16, the oracle
is not rounded). Linear and task arithmetic must meet that everywhere. Operators with a decision
per entry (a magnitude threshold, a random keep vs. a float32 probability, a sign election) may decide
an entry differently when the float32 and float64 values straddle the boundary; at most 1e-4 of the
entries may then be off, and every other entry must meet the tolerance.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from mergepipe.errors import PlanError

import reference as ref

OPS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties",
       "della", "della_linear")
BUDGETS = ("10%", "50%", "100%")
BLOCK = 8192
WEIGHTS = [0.75, -0.375, 1.125, 0.5]  # dyadic: no subset of agreeing weights sums to 0
ZERO_SUM = [0.75, -0.5, 0.25, -0.5]  # sums to exactly 0 in float32 and float64 (only the full set does)
DENSITY = 0.5
LAM = 0.875
SEED = 7
FLIP_FRACTION = 1e-4
EXPERTS = ("e1", "e2", "dl", "lo")  # full, full, delta checkpoint, LoRA adapter
LORA = {  # adapter_config.json of the family's LoRA expert
    "fp32": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "bf16": dict(r=8, lora_alpha=4, target_modules=["o_proj", "up_proj"], use_rslora=True,
                 rank_pattern={"up_proj": 2}, alpha_pattern={"o_proj": 16}),
}


def test_every_registered_operator_is_covered():
    from mergepipe.ops.core import OPERATORS
    # the interpolation methods (spec.nonlinear) are checked against mergekit itself:
    # tests/parity/test_parity_methods.py
    task_vector_ops = {name for name, spec in OPERATORS.items() if not spec.nonlinear}
    assert task_vector_ops == set(OPS) == set(ref.SPARSIFY)


def test_reference_imports_no_mergepipe_and_no_torch():
    """The oracle is independent: importing it loads numpy and the standard library only."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import reference; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('mergepipe', 'torch', 'numba', 'safetensors')))")
    res = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# --- the families ------------------------------------------------------------------------------------------
def _write_lora(out: Path, base: dict, dtype: str, seed: int, cfg: dict) -> None:
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
    tensors = {}
    for name, t in base.items():
        module = name[: -len(".weight")]
        short = module.split(".")[-1]
        if len(t.shape) != 2 or short not in cfg["target_modules"]:
            continue
        r = cfg.get("rank_pattern", {}).get(short, cfg["r"])
        a = torch.randn(r, t.shape[1], generator=g) * 0.1
        b = torch.randn(t.shape[0], r, generator=g) * 0.005
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(tdt)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(tdt)
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "bias": "none", **cfg}))


def _build(root: Path, dtype: str) -> dict:
    import torch
    from safetensors.torch import save_file

    from mergepipe.analyze.runner import analyze
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register
    from mergepipe.research.family import make_family
    from merge_helpers import load_dir

    paths = make_family(root / "fam", experts=3, size="tiny", dtype=dtype,
                        shard_bytes=(64 << 10) if dtype == "fp32" else (32 << 10), seed=5)
    base_dir = Path(paths["base"])
    base = load_dir(base_dir)
    x3 = load_dir(Path(paths["experts"][2]))
    other = torch.bfloat16 if dtype == "fp32" else torch.float32  # the delta in the other float dtype
    (root / "delta").mkdir()
    save_file({n: (x3[n].float() - base[n].float()).to(other) for n in base}, str(root / "delta" / "model.safetensors"),
              metadata={"format": "pt"})
    _write_lora(root / "lora", base, dtype, seed=11 if dtype == "fp32" else 12, cfg=LORA[dtype])
    db = root / "catalog.sqlite"
    cat = Catalog(db)
    try:
        register(cat, "base", str(base_dir))
        register(cat, "e1", paths["experts"][0], base_id="base")
        register(cat, "e2", paths["experts"][1], base_id="base")
        register(cat, "dl", str(root / "delta"), base_id="base", kind="delta")
        register(cat, "lo", str(root / "lora"), base_id="base", kind="lora")
        analyze(cat, block_bytes=BLOCK)
        cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        cat.close()
    dirs = [base_dir, Path(paths["experts"][0]), Path(paths["experts"][1]), root / "delta", root / "lora"]
    return {"root": root, "db": db, "base": base_dir, "dirs": dirs, "dtype": dtype}


@pytest.fixture(scope="module")
def fams(tmp_path_factory):
    return {dt: _build(tmp_path_factory.mktemp("oracle-" + dt), dt) for dt in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def catalogs(fams, tmp_path_factory):
    """One working catalog per family (a copy of the analyzed template) for the merges of this module."""
    from mergepipe.catalog.db import Catalog
    cats = {}
    for dt, fam in fams.items():
        db = tmp_path_factory.mktemp("cat-" + dt) / "c.sqlite"
        shutil.copy(fam["db"], db)
        cats[dt] = Catalog(db)
    yield cats
    for c in cats.values():
        c.close()


# --- running a merge and the oracle ------------------------------------------------------------------------
def run_merge(cat, out: Path, op: str, budget: str, weights, density, experts=EXPERTS, **kw):
    from mergepipe.api import merge
    plan, _, manifest = merge(cat, "base", list(experts), out, operator=op, model_id=out.name, weights=weights,
                              density=density if op not in ("linear", "task_arithmetic") else None,
                              lam=LAM, seed=SEED, budget=budget, **kw)
    return plan.data, manifest


@lru_cache(maxsize=None)
def _stored_thresholds(db: str, expert: str) -> dict:
    """The per-tensor thresholds ANALYZE stored (through the catalog's data access, nothing else)."""
    from mergepipe.catalog.db import Catalog
    cat = Catalog(Path(db), create=False)
    try:
        return {t: s["thresholds"] for t, s in cat.tensor_stats(expert).items()}
    finally:
        cat.close()


def check_thresholds(fam, plan, result: ref.Result) -> int:
    """The oracle's thresholds (from the full delta) against ANALYZE's stored ones and the plan's."""
    n = 0
    for e in plan["experts"]:
        stored = _stored_thresholds(str(fam["db"]), e["id"])
        for tensor, mine in result.thresholds[e["id"]].items():
            planned = plan["thresholds"].get(e["id"], {}).get(tensor)
            assert planned is not None, (e["id"], tensor)
            exact = e["kind"] != "lora"  # full / delta: the same float32 magnitudes, bit for bit
            for got, want in zip(planned, mine):
                if exact or math.isinf(want):
                    assert got == want or (got == 0.0 and want <= 0.0), (e["id"], tensor, planned, mine)
                else:
                    assert got == pytest.approx(want, rel=1e-6, abs=1e-12), (e["id"], tensor, planned, mine)
                n += 1
            dens = ref.setting(e, "density", tensor)
            if plan["operator"] == "ties" and dens < 1:
                s = stored[tensor]
                key = next(k for k in s if abs(float(k) - dens) < 1e-9)
                assert s[key] == planned[0] or (math.isinf(s[key]) and planned[0] == mine[0])  # k = 0 -> 1
    return n


def compare(out_dir: Path, result: ref.Result, base_dir: Path, flips_ok: bool) -> dict:
    got = ref.read_dir(out_dir)
    base = ref.read_dir(base_dir)
    assert set(got) == set(base)
    bad = total = 0
    worst = 0.0
    for name, want in result.values.items():
        g = got[name]
        assert (g.dtype, g.shape) == (base[name].dtype, base[name].shape), name
        gv = g.values()
        tol = result.err[name].copy()
        if g.dtype != "F32":
            tol += 0.5 * ref.ulp(np.maximum(np.abs(gv), np.abs(want)), g.dtype)
        diff = np.abs(gv - want)
        off = diff > tol
        bad += int(off.sum())
        total += want.size
        if (~off).any():
            worst = max(worst, float((diff[~off] / np.maximum(tol[~off], 1e-300)).max()))
    allowed = int(FLIP_FRACTION * total) if flips_ok else 0
    assert bad <= allowed, f"{bad} of {total} entries off the oracle (allowed {allowed})"
    return {"off": bad, "total": total, "worst_ratio": worst}


def check(fam, cat, tmp_path, op, budget, weights=WEIGHTS, density=DENSITY, tag="m", experts=EXPERTS, **kw):
    out = tmp_path / f"{tag}-{fam['dtype']}-{op}-{budget.rstrip('%')}"
    plan, manifest = run_merge(cat, out, op, budget, weights, density, experts, **kw)
    assert not plan["budget"].get("first_merge")
    core = manifest.core
    assert core["realized"]["expert_read"] == plan["estimate"]["expert_read"] <= plan["budget"]["bytes"]
    if budget != "10%":  # every source kind (full, delta, LoRA) takes part
        assert all(plan["expert_read_by_expert"][e] > 0 for e in EXPERTS), plan["expert_read_by_expert"]
    result = ref.merge(plan, fam["base"])
    check_thresholds(fam, plan, result)
    stats = compare(out, result, fam["base"], flips_ok=op not in ("linear", "task_arithmetic"))
    return plan, result, stats


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_budgeted_output_equals_oracle(fams, catalogs, tmp_path, op, dtype, budget):
    fam = fams[dtype]
    plan, result, stats = check(fam, catalogs[dtype], tmp_path, op, budget)
    full = plan["full_expert_bytes"]
    if budget == "100%":
        assert plan["estimate"]["expert_read"] == full
        assert plan["blocks_selected"] == plan["blocks_candidate"]
    else:
        # a partial budget really omits blocks, and omitting them changes the output: the oracle over
        # every candidate block differs from the published merge (so the comparison sees the access set)
        assert plan["estimate"]["expert_read"] <= float(budget.rstrip("%")) / 100 * full + 1
        assert sum(plan["blocks_selected"].values()) < sum(plan["blocks_candidate"].values())
        everything = dict(plan, access={e["id"]: _all_blocks(e, fam) for e in plan["experts"]})
        with pytest.raises(AssertionError, match="entries off the oracle"):
            compare(tmp_path / f"m-{dtype}-{op}-{budget.rstrip('%')}", ref.merge(everything, fam["base"]),
                    fam["base"], flips_ok=True)
    print(op, dtype, budget, stats)


def _all_blocks(expert: dict, fam) -> dict:
    base = ref.read_dir(fam["base"])
    return {n: [[0, len(ref.block_rows(t.shape, t.dtype, BLOCK))]] for n, t in base.items()}


SPARSE_OPS = [op for op in OPS if ref.SPARSIFY[op]]


@pytest.mark.parametrize("dtype,budget", [("fp32", "50%"), ("bf16", "100%")])
@pytest.mark.parametrize("op", SPARSE_OPS)
def test_density_one_equals_oracle(fams, catalogs, tmp_path, op, dtype, budget):
    """Density 1: nothing is dropped (breadcrumbs included, as mergekit's magnitude_outliers since
    issue 15)."""
    check(fams[dtype], catalogs[dtype], tmp_path, op, budget, density=1.0, tag="d1")


@pytest.mark.parametrize("dtype,budget", [("bf16", "10%"), ("fp32", "100%")])
@pytest.mark.parametrize("op", OPS)
def test_weights_summing_to_zero_equal_oracle(fams, catalogs, tmp_path, op, dtype, budget):
    """Weights summing to exactly 0: linear (normalize on) refuses to divide by the zero sum; the others
    do not divide by the total (TIES-like: by the agreeing weights, 0 replaced by 1) and equal the oracle."""
    if op == "linear":
        with pytest.raises(PlanError, match="the weights sum to 0; normalize divides by their sum, which must be "
                                            "non-zero"):
            check(fams[dtype], catalogs[dtype], tmp_path, op, budget, weights=ZERO_SUM, tag="z")
        return
    check(fams[dtype], catalogs[dtype], tmp_path, op, budget, weights=ZERO_SUM, tag="z")


@pytest.mark.parametrize("dtype,budget", [("fp32", "50%"), ("bf16", "100%")])
@pytest.mark.parametrize("op", ["ties", "breadcrumbs_ties"])
def test_rescale_equals_oracle(fams, catalogs, tmp_path, op, dtype, budget):
    """``rescale: true`` (issue 15): TIES' per-tensor L1 factor ||δ||₁ / ||top-k||₁ from ANALYZE's exact
    top-k L1; breadcrumbs' per-block L1 restoration."""
    plan, _, _ = check(fams[dtype], catalogs[dtype], tmp_path, op, budget, tag="rs", rescale=True)
    if op == "ties":
        ratios = [v[1] for per in plan["thresholds"].values() for v in per.values()]
        assert all(r >= 1.0 for r in ratios) and sum(r > 1.0 for r in ratios) >= len(ratios) // 4


PER_TENSOR = [  # mergekit's filters and gradients: weights and densities that vary per tensor
    {"model": "e1", "weight": [{"filter": "mlp", "value": -0.625}, {"value": 0.75}], "density": [0.3, 0.7]},
    {"model": "e2", "density": [{"filter": "self_attn", "value": 0.37}, {"value": 0.81}]},
    {"model": "dl", "weight": [1.25, 0.5]},
    {"model": "lo", "weight": 0.875, "density": 0.63},
]


@pytest.mark.parametrize("op", ["task_arithmetic", "ties", "dare_ties", "breadcrumbs", "della_linear"])
def test_per_tensor_settings_equal_oracle(fams, catalogs, tmp_path, op):
    """Per-tensor weights and densities (the plan's ``tensors`` table) at a 50 % budget, fp32: other
    densities than 0.5 (float32(density) != density for DARE's comparison) and per-tensor weight sums."""
    plan, _, _ = check(fams["fp32"], catalogs["fp32"], tmp_path, op, "50%", weights=None, density=0.4,
                       tag="pt", experts=PER_TENSOR)
    per = [e.get("tensors") for e in plan["experts"]]
    assert per[0] and len({tuple(v) for v in per[0].values()}) > 1


# --- bytes read, counted by the kernel -----------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, sys
    from mergepipe.api import merge
    from mergepipe.catalog.db import Catalog
    from mergepipe.storage.local import evict, proc_io
    db, out, runs, dirs = sys.argv[1], sys.argv[2], [r.split("@") for r in sys.argv[3].split(",")], sys.argv[4:]
    experts = ["e1", "e2", "dl", "lo"]
    kw = dict(weights=[0.75, -0.375, 1.125, 0.5], lam=0.875, seed=7)
    cat = Catalog(db, create=False)
    # One merge per operator first loads the code it needs (numba's kernels, lazily imported modules);
    # only the second, on evicted inputs, is measured, so that the count holds checkpoint bytes alone.
    for op, budget in runs:
        dens = None if op in ("linear", "task_arithmetic") else 0.5
        merge(cat, "base", experts, f"{out}/warm-{op}", operator=op, density=dens, model_id=f"warm-{op}",
              budget=budget, **kw)
    res = {}
    for op, budget in runs:
        dens = None if op in ("linear", "task_arithmetic") else 0.5
        evict(dirs)
        before = proc_io()
        plan, sid, manifest = merge(cat, "base", experts, f"{out}/cold-{op}", operator=op, density=dens,
                                    model_id=f"cold-{op}", budget=budget, **kw)
        after = proc_io()
        res[op] = {"read_bytes": after["read_bytes"] - before["read_bytes"], "plan": plan.data,
                   "realized": manifest.core["realized"]}
    print("RESULT " + json.dumps(res))
""")
PAGE = 4096
# Measured here: the read count equals U exactly; the slack leaves room for a few filesystem metadata
# blocks (inodes, extents, directories) that the kernel may also have to read. Kernel read-ahead on the
# expert files (FADV_NORMAL instead of FADV_RANDOM) already exceeds it on these small files.
META_SLACK = 4 * PAGE
EXPERT_FILES_READ = ("config.json", "adapter_config.json", "model.safetensors.index.json")


def page_bounds(plan: dict, dirs: list[Path]) -> tuple[int, int, int]:
    """(base tensor bytes, L, U) for a cold merge of ``plan``. L: the bytes of the 4 KiB pages that the
    merge must read from disk, since it reads bytes in each of them: the base's tensor data, the header
    of every safetensors file, and the plan's expert byte ranges (rows of full/delta blocks, rows of
    LoRA's B and its whole A). U: L plus the pages of the small files a merge reads in full: every other
    file of the base (config, tokenizer and generation files, shard index: copied to the output) and
    the configs and shard index of the experts (layout and fingerprint checks)."""
    pages: set = set()

    def touch(f: Path, off: int, n: int) -> None:
        if n > 0:
            pages.update((str(f), p) for p in range(off // PAGE, (off + n - 1) // PAGE + 1))

    aux = 0
    for d in dirs:
        for f in d.iterdir():
            if f.suffix == ".safetensors":
                hlen, _ = ref.read_header(f)
                touch(f, 0, 8 + hlen)
            elif f.is_file() and (d == dirs[0] or f.name in EXPERT_FILES_READ):
                aux += -(-f.stat().st_size // PAGE) * PAGE
    base = ref.read_dir(dirs[0])
    base_bytes = sum(len(t.data) for t in base.values())
    for t in base.values():
        touch(t.file, t.offset, len(t.data))
    for e in plan["experts"]:
        tensors = ref.read_dir(Path(e["uri"]) / ("adapter_model.safetensors" if e["kind"] == "lora" else ""))
        for name, ranges in plan["access"][e["id"]].items():
            info = base[name]
            spans = ref.block_rows(info.shape, info.dtype, plan["grid"]["block_bytes"])
            if e["kind"] == "lora":
                module = "base_model.model." + name[: -len(".weight")]
                a, b = tensors[module + ".lora_A.weight"], tensors[module + ".lora_B.weight"]
                touch(a.file, a.offset, len(a.data))
                src = b
            else:
                src = tensors[name]
            row = len(src.data) // src.shape[0]
            for bi in ref.expand(ranges):
                r0, r1 = spans[bi]
                touch(src.file, src.offset + r0 * row, (r1 - r0) * row)
    lower = PAGE * len(pages)
    return base_bytes, lower, lower + aux


COLD_BUDGETS = {"fp32": ("10%", "30%", "60%"), "bf16": ("50%", "20%", "100%")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cold_reads_match_plan_for_every_operator(fams, tmp_path, dtype):
    """Kernel-counted bytes (/proc/self/io of a child process, inputs fsync'd and evicted), per operator
    (budgets 10-100 %): at least the pages holding the base and the planned expert bytes (L, itself >=
    base + planned), at most those plus the small files a merge reads (U) and a few metadata pages."""
    from mergepipe.storage.local import evict  # noqa: F401  (the child uses it; fail here if it moved)
    from merge_helpers import fsync_dirs
    fam = fams[dtype]
    budgets = {op: COLD_BUDGETS[dtype][i % 3] for i, op in enumerate(OPS)}
    db = tmp_path / "cold.sqlite"
    shutil.copy(fam["db"], db)
    fsync_dirs(*fam["dirs"])  # dirty pages cannot be evicted
    env = dict(os.environ)
    (tmp_path / "out").mkdir()
    runs = ",".join(f"{op}@{b}" for op, b in budgets.items())
    res = subprocess.run([sys.executable, "-c", CHILD, str(db), str(tmp_path / "out"), runs, *map(str, fam["dirs"])],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert set(out) == set(OPS)
    for op, r in out.items():
        plan = r["plan"]
        planned = plan["estimate"]["expert_read"]
        assert plan["budget"]["spec"] == budgets[op]
        assert r["realized"]["expert_read"] == planned <= plan["budget"]["bytes"]
        assert 0 < planned and (planned < plan["full_expert_bytes"] or budgets[op] == "100%")
        assert sum(plan["expert_read_by_expert"][e] > 0 for e in EXPERTS) >= 3, plan["expert_read_by_expert"]
        base_bytes, lower, upper = page_bounds(plan, fam["dirs"])
        assert r["realized"]["base_read"] == base_bytes
        print(dtype, op, budgets[op], {"read_bytes": r["read_bytes"], "base+planned": base_bytes + planned,
                                       "lower": lower, "upper": upper})
        assert base_bytes + planned <= lower <= r["read_bytes"] <= upper + META_SLACK, (
            op, r["read_bytes"], base_bytes, planned, lower, upper)
