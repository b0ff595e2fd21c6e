"""Invariant 2: at full budget every operator equals an independent full-read reference.

Two references: mergepipe.research.baselines.naive_merge (whole tensors, torch.topk thresholds, the same
per-(seed, expert, tensor, block) random streams), and, for linear / task_arithmetic / ties, a
from-scratch implementation of the brief's semantics written here with torch.topk. mergekit is not
used as an oracle. fp32: max abs diff <= 1e-6; bf16: bit-identical to naive_merge.
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.research.baselines import naive_merge
from mergepipe.engine.engine import Engine
from mergepipe.planner.context import Planner

from merge_helpers import ALL_OPS, load_dir, max_abs_diff, open_copy, plan_kwargs_for_baseline, shared_family

WEIGHTS = [0.6, 1.3, 0.35]  # non-uniform, sum != 1
DENSITY = 0.3


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    fam = shared_family(tmp_path_factory, "tiny-fp32")
    d = tmp_path_factory.mktemp("ops-fp32")
    cat = open_copy(fam, d / "c.sqlite")
    yield fam, cat, d
    cat.close()


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    fam = shared_family(tmp_path_factory, "tiny-bf16")
    d = tmp_path_factory.mktemp("ops-bf16")
    cat = open_copy(fam, d / "c.sqlite")
    yield fam, cat, d
    cat.close()


def merged_and_reference(fam, cat, d, op, **kw):
    plan = Planner(cat).plan("base", fam.expert_ids, op, weights=WEIGHTS, density=DENSITY, seed=11, **kw)
    assert plan["estimate"]["expert_read"] == plan["full_expert_bytes"]
    tag = f"{op}-{abs(hash(tuple(sorted(kw.items())))) % 10**6}"
    _, manifest = Engine(cat).execute(plan, out=d / ("out-" + tag))
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    naive_merge(str(fam.base), [str(p) for p in fam.experts[:3]], d / ("ref-" + tag),
                **plan_kwargs_for_baseline(plan))
    return load_dir(d / ("out-" + tag)), load_dir(d / ("ref-" + tag)), plan


@pytest.mark.parametrize("op", ALL_OPS)
def test_full_budget_equals_naive_fp32(fp32, op):
    fam, cat, d = fp32
    out, ref, _ = merged_and_reference(fam, cat, d, op)
    base = load_dir(fam.base)
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in base.items()}
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in base.items()}
    assert max_abs_diff(out, ref) <= 1e-6
    assert max_abs_diff(out, base) > 1e-4  # the merge did something


@pytest.mark.parametrize("op", ALL_OPS)
def test_full_budget_equals_naive_bf16(bf16, op):
    fam, cat, d = bf16
    out, ref, _ = merged_and_reference(fam, cat, d, op)
    base = load_dir(fam.base)
    for k in base:
        assert out[k].dtype == torch.bfloat16 == base[k].dtype
        assert torch.equal(out[k], ref[k]), k
    assert max_abs_diff(out, base) > 0


@pytest.mark.parametrize("op, kw", [
    ("ties", dict(normalize=False, lam=0.8)),
    ("task_arithmetic", dict(lam=0.7, normalize=True)),
    ("linear", dict(normalize=False)),
    ("dare_linear", dict(rescale=False)),
    ("dare_ties", dict(normalize=True, lam=1.2)),
    ("breadcrumbs", dict(gamma=0.01, rescale=True)),
    ("della", dict(epsilon=0.05, rescale=False)),
])
def test_full_budget_equals_naive_non_default_params(fp32, op, kw):
    fam, cat, d = fp32
    out, ref, plan = merged_and_reference(fam, cat, d, op, **kw)
    assert max_abs_diff(out, ref) <= 1e-6


# --- a from-scratch reference of the brief's semantics -------------------------------------------------
def scratch_merge(base: dict, experts: list[dict], op: str, weights, density=1.0, lam=1.0, normalize=None):
    """Whole-tensor merge written from the brief, independent of mergepipe's code."""
    out = {}
    for name, b in base.items():
        b32 = b.double()
        xs = [e[name].double() for e in experts]
        deltas = [x - b32 for x in xs]
        if op == "linear":
            norm = True if normalize is None else normalize
            s = sum(w * x for w, x in zip(weights, xs))
            res = s / sum(weights) if norm else s
        elif op == "task_arithmetic":
            norm = False if normalize is None else normalize
            s = sum(w * dl for w, dl in zip(weights, deltas))
            res = b32 + lam * (s / sum(weights) if norm else s)
        elif op == "ties":
            norm = True if normalize is None else normalize
            trimmed = []
            for dl in deltas:
                # exactly the top k = max(1, int(d n)) (mergekit), magnitudes tied at the cut-off taken in
                # flat index order (MergePipe's documented tie-break), on the float32 magnitudes
                k = max(1, int(density * dl.numel()))
                order = torch.sort(dl.float().abs().reshape(-1), descending=True, stable=True).indices[:k]
                mask = torch.zeros(dl.numel(), dtype=torch.bool)
                mask[order] = True
                trimmed.append(torch.where(mask.reshape(dl.shape), dl, torch.zeros_like(dl)))
            weighted = torch.stack([w * t for w, t in zip(weights, trimmed)])
            elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).double()
            agree = torch.sign(weighted) == elected
            mixed = (weighted * agree).sum(0)
            if norm:
                wt = torch.tensor(weights, dtype=torch.float64).view(-1, *[1] * b.dim())
                div = (wt * agree).sum(0)
                mixed = mixed / torch.where(div == 0, torch.ones_like(div), div)
            res = b32 + lam * mixed
        else:
            raise AssertionError(op)
        out[name] = res
    return out


@pytest.mark.parametrize("op, kw", [
    ("linear", {}),
    ("linear", dict(normalize=False)),
    ("task_arithmetic", {}),
    ("task_arithmetic", dict(lam=0.6)),
    ("ties", {}),
    ("ties", dict(density=0.5)),
    ("ties", dict(density=0.3, lam=0.9, normalize=False)),
])
def test_full_budget_equals_scratch_reference_fp32(fp32, op, kw):
    fam, cat, d = fp32
    kw = dict(kw)
    density = kw.pop("density", DENSITY)
    plan = Planner(cat).plan("base", fam.expert_ids, op, weights=WEIGHTS, density=density, **kw)
    tag = f"scratch-{op}-{density}-{sorted(kw.items())}".replace(" ", "").replace("'", "")
    Engine(cat).execute(plan, out=d / tag)
    out = load_dir(d / tag)
    base = load_dir(fam.base)
    experts = [load_dir(p) for p in fam.experts[:3]]
    ref = scratch_merge(base, experts, op, WEIGHTS, density=density, lam=kw.get("lam", 1.0),
                        normalize=kw.get("normalize"))
    worst = max(float((out[k].double() - ref[k]).abs().max()) for k in base)
    assert worst <= 1e-6
    # The reference is not trivially equal to the base: the merge moved the weights.
    assert max(float((ref[k] - base[k].double()).abs().max()) for k in base) > 1e-4


def test_scratch_reference_bf16_ties(bf16):
    """bf16 against the float64 scratch reference: equal to one bf16 rounding, except where the sign
    election is a numerical tie (sum of weighted deltas ~ 0, e.g. 0.6a - 1.3a + 0.35(2a) = 0 with bf16
    deltas that are multiples of one power of two); such entries must be few."""
    fam, cat, d = bf16
    plan = Planner(cat).plan("base", fam.expert_ids, "ties", weights=WEIGHTS, density=DENSITY)
    Engine(cat).execute(plan, out=d / "scratch-ties")
    out = load_dir(d / "scratch-ties")
    base = load_dir(fam.base)
    experts = [load_dir(p) for p in fam.experts[:3]]
    ref = scratch_merge(base, experts, "ties", WEIGHTS, density=DENSITY)
    ambiguous = total = 0
    for k in base:
        b = base[k].double()
        weighted = []
        for w, e in zip(WEIGHTS, experts):
            dl = e[k].double() - b
            n = int(DENSITY * dl.numel())
            thr = torch.topk(dl.abs().reshape(-1), n).values[-1]
            weighted.append(w * torch.where(dl.abs() >= thr, dl, torch.zeros_like(dl)))
        weighted = torch.stack(weighted)
        tie = weighted.sum(0).abs() <= 1e-6 * weighted.abs().sum(0)
        r = ref[k].to(torch.bfloat16).double()
        diff = (out[k].double() - r).abs()
        # one bf16 ulp of the value (fp32 vs fp64 intermediate rounding can straddle a bf16 boundary)
        ulp = r.abs().clamp_min(1e-30) * 2.0 ** -7
        assert bool(((diff <= ulp) | tie).all()), k
        ambiguous += int((tie & (weighted != 0).any(0)).sum())
        total += b.numel()
    assert ambiguous < 1e-3 * total


def test_dare_keeps_about_density_of_entries(fp32):
    """Single-expert DARE without rescale: out - base = w * delta on kept entries, 0 elsewhere, with
    a keep rate of about ``density``; with rescale, the L1 norm of each block's delta is preserved."""
    fam, cat, d = fp32
    base = load_dir(fam.base)
    x = load_dir(fam.experts[0])
    plan = Planner(cat).plan("base", ["e1"], "dare_linear", weights=[1.0], density=0.3, rescale=False, seed=3)
    Engine(cat).execute(plan, out=d / "dare-single")
    out = load_dir(d / "dare-single")
    kept = total = 0
    for k in base:
        delta = x[k].double() - base[k].double()
        moved = out[k].double() - base[k].double()
        nz = delta != 0
        # each entry is either unchanged or fully moved to the expert (fp32 rounding of base + delta)
        close = (moved - delta).abs() <= 1e-6
        assert bool(((moved == 0) | close)[nz].all()), k
        kept += int((close & nz & (moved != 0)).sum())
        total += int(nz.sum())
    assert total > 10000
    assert 0.27 < kept / total < 0.33
    # Another seed draws another mask.
    plan2 = Planner(cat).plan("base", ["e1"], "dare_linear", weights=[1.0], density=0.3, rescale=False, seed=4)
    Engine(cat).execute(plan2, out=d / "dare-single-4")
    out2 = load_dir(d / "dare-single-4")
    assert any(not torch.equal(out[k], out2[k]) for k in base)


def test_della_keeps_about_density_of_entries(fp32):
    fam, cat, d = fp32
    base = load_dir(fam.base)
    x = load_dir(fam.experts[1])
    plan = Planner(cat).plan("base", ["e2"], "della_linear", weights=[1.0], density=0.4, rescale=False, seed=5)
    Engine(cat).execute(plan, out=d / "della-single")
    out = load_dir(d / "della-single")
    kept = total = big_kept = big_total = 0
    for k in base:
        delta = (x[k].double() - base[k].double()).reshape(x[k].shape[0] if x[k].dim() >= 2 else 1, -1)
        moved = (out[k].double() - base[k].double()).reshape(delta.shape)
        nz = delta != 0
        keep = (moved != 0) & nz
        kept += int(keep.sum())
        total += int(nz.sum())
        if delta.shape[1] > 1:  # larger magnitudes within a row are kept more often
            med = delta.abs().median(dim=1, keepdim=True).values
            big = (delta.abs() > med) & nz
            big_kept += int((keep & big).sum())
            big_total += int(big.sum())
    assert total > 10000
    assert 0.36 < kept / total < 0.44
    assert big_kept / big_total > kept / total + 0.02
