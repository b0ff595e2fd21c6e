"""Parity with mergekit 0.1.5 for the nine task-vector methods MergePipe had before issue 15.

Each method runs at full budget on tiny families (fp32 and bf16, three experts, 4 KiB blocks so a tensor
spans many blocks) through MergePipe's mergekit-YAML path (``mergepipe.api.merge_config``) and through
mergekit itself (tests/parity/mergekit_runner.py) with ``dtype: float32`` (mergekit computes and writes
float32; MergePipe computes in float32 and writes the base's dtype, so mergekit's output is rounded to
bf16, round to nearest even, before comparing on the bf16 family).

Deterministic methods (linear, task_arithmetic, ties, ties with ``rescale``, breadcrumbs,
breadcrumbs_ties) -- asserted per tensor:
  * the number of kept entries equals mergekit's (one-expert merges, weight 1, where output != base
    exactly where an entry is kept): MergePipe keeps exactly k like mergekit's top-k;
  * every entry where no expert's |delta| equals one of its cut-off magnitudes (mergekit's ranks: the
    k-th largest for TIES, the k_hi-th and k_lo-th for breadcrumbs) is equal up to rounding: fp32 within
    ULPS = 4 float32 ulps of the largest input magnitude there (float32 summation order differs:
    mergekit sums the stacked weighted deltas along the expert axis, MergePipe expert by expert), 16
    with TIES' rescale (its factor is a ratio of float64 sums here, of float32 sums in mergekit); bf16
    within 1 bf16 ulp (the same float32 value rounded; an ulp where the float32 values straddle a
    rounding boundary). Entries at tied magnitudes may differ: mergekit's (unstable) sort keeps an
    arbitrary subset of them, MergePipe the first in flat order -- the count kept is the same.
Random methods (dare_linear, dare_ties, della, della_linear) -- statistically equal (MergePipe's counter
stream is not torch's generator):
  * keep rate of a one-expert merge without rescale (kept among the changed entries): within 5 binomial
    standard deviations sqrt(p (1 - p) / n) (n ~ 1e5 changed entries) of mergekit's (times sqrt 2) and,
    for DARE, of p (DELLA's rate among changed entries exceeds p where zero deltas take the low ranks);
  * expected update: a one-expert merge with rescale (L1 restored per block here, per tensor in
    mergekit): the L1 norm of the output delta within 1e-4 relative of mergekit's (both restore it),
    and the mean of the output delta within 5 % of the L1 norm / n scale;
  * the merged three-expert output's delta: L1 within 3 % relative, mean within 5 % of the L1 / n scale.
The measured numbers are printed (``-s``) and copied into README.md's operator table.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from mergepipe.api import merge_config
from mergepipe.config.parse import parse_config
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge

ULPS = 4
ULPS_RESCALE = 16  # TIES' rescale factor: float64 sums here, float32 sums (their rounding) in mergekit
WEIGHTS = [0.6, 1.3, 0.35]
DENSITY = 0.5
SEED = 7
DETERMINISTIC = ["linear", "task_arithmetic", "ties", "ties+rescale", "breadcrumbs", "breadcrumbs_ties"]
RANDOM = ["dare_linear", "dare_ties", "della", "della_linear"]
SPARSIFYING = {"ties", "ties+rescale", "breadcrumbs", "breadcrumbs_ties"} | set(RANDOM)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def fam(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"parity-{request.param}")
    paths = make_family(root / "fam", experts=3, size="tiny", dtype=request.param, shard_bytes=1 << 30, seed=5)
    cat = Catalog(root / "c.sqlite")
    register(cat, "base", paths["base"])
    for i, e in enumerate(paths["experts"], start=1):
        register(cat, f"e{i}", e, base_id="base")
    from mergepipe.api import analyze
    analyze(cat, block_bytes=4096)
    yield {"dtype": request.param, "root": root, "cat": cat, "base": paths["base"], "experts": paths["experts"],
           "base_t": load_dir(paths["base"]), "experts_t": [load_dir(e) for e in paths["experts"]]}
    cat.close()


def _config(fam, method: str, experts: list[int], weights: list[float], for_mergekit: bool) -> dict:
    name, _, variant = method.partition("+")
    params = {"rescale": True} if variant == "rescale" else {}
    models = []
    for i, w in zip(experts, weights):
        p = {"weight": w}
        if method in SPARSIFYING:
            p["density"] = DENSITY
        models.append({"model": fam["experts"][i], "parameters": p})
    cfg = {"merge_method": name, "base_model": fam["base"], "dtype": "float32", "models": models}
    if fam["dtype"] == "bf16":
        cfg["out_dtype"] = "bfloat16"  # compute in float32, write bf16 (MergePipe keeps the base's dtype)
    if params:
        cfg["parameters"] = params
    if for_mergekit and name == "linear":
        del cfg["base_model"]  # mergekit's linear averages the models listed; MergePipe needs the base named
    if not for_mergekit:
        cfg["mergepipe"] = {"seed": SEED}
    return cfg


def _run(fam, method: str, experts: list[int], weights: list[float], tag: str):
    out = fam["root"] / tag
    out.mkdir()
    merge_config(fam["cat"], parse_config(yaml.safe_dump(_config(fam, method, experts, weights, False))), out / "mp",
                 model_id=tag)
    ours = load_dir(out / "mp")
    theirs = mergekit_merge(_config(fam, method, experts, weights, True), out / "mk", seed=SEED)
    assert set(ours) == set(theirs)
    return ours, theirs


def _ulp(x: torch.Tensor, dtype: str) -> torch.Tensor:
    bits = 23 if dtype == "fp32" else 7
    a = x.double().abs().clamp(min=2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - bits)


def _cutoffs(method: str, a: torch.Tensor) -> list[float]:
    """The magnitudes at which ``method`` cuts an expert's |delta| (mergekit's ranks)."""
    n = a.numel()
    srt = torch.sort(a.reshape(-1), descending=True).values
    if method.startswith("ties"):
        return [float(srt[max(1, int(DENSITY * n)) - 1])]
    target = int(DENSITY * n)
    k_hi = min(int(0.01 * n), n - target)
    return [float(srt[k - 1]) for k in (k_hi, k_hi + target) if 0 < k <= n]


def _tied(fam, method: str, name: str, experts: list[int]) -> torch.Tensor:
    """Entries where some expert's float32 |delta| equals one of its cut-off magnitudes: there mergekit
    keeps an arbitrary subset of the tied entries, MergePipe the first ones in flat order."""
    base = fam["base_t"][name].float()
    tied = torch.zeros(base.shape, dtype=torch.bool)
    if method not in SPARSIFYING:
        return tied
    for i in experts:
        a = (fam["experts_t"][i][name].float() - base).abs()
        for c in _cutoffs(method, a):
            tied |= a == c
    return tied


REPORT: dict = {}


@pytest.mark.parametrize("method", DETERMINISTIC)
def test_deterministic_methods_equal_mergekit(fam, method):
    ours, theirs = _run(fam, method, [0, 1, 2], WEIGHTS, f"{method}-3")
    worst_ulps = 0.0
    differing = at_ties = total = 0
    for name in ours:
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype == fam["base_t"][name].dtype
        diff = (a.double() - b.double()).abs()
        tied = _tied(fam, method, name, [0, 1, 2])
        scale = torch.stack([fam["base_t"][name].double().abs()] + [x[name].double().abs() for x in fam["experts_t"]]
                            + [b.double().abs()]).amax(0)
        ulps = diff / _ulp(scale, fam["dtype"])
        worst = float(ulps[~tied].max()) if (~tied).any() else 0.0
        worst_ulps = max(worst_ulps, worst)
        assert worst <= (ULPS_RESCALE if "rescale" in method else ULPS if fam["dtype"] == "fp32" else 1), (name, worst)
        differing += int((diff > 0).sum())
        at_ties += int(((diff > 0) & tied).sum())
        total += diff.numel()
    # kept counts, one expert at a time (weight 1: output != base exactly where an entry is kept)
    kept_ours = kept_theirs = 0
    if method in SPARSIFYING:
        for i in range(3):
            o1, t1 = _run(fam, method, [i], [1.0], f"{method}-e{i}")
            for name in o1:
                base = fam["base_t"][name]
                co, ct = int((o1[name] != base).sum()), int((t1[name] != base).sum())
                assert co == ct, (method, i, name, co, ct)
                kept_ours, kept_theirs = kept_ours + co, kept_theirs + ct
    REPORT[(fam["dtype"], method)] = dict(max_ulps_untied=worst_ulps, differing=differing, at_ties=at_ties,
                                          total=total, kept=(kept_ours, kept_theirs),
                                          max_abs=max(float((ours[n].double() - theirs[n].double()).abs().max())
                                                      for n in ours))
    print(fam["dtype"], method, REPORT[(fam["dtype"], method)])


def _delta_stats(out: dict, base: dict) -> tuple[int, float, float, int]:
    """(entries changed, L1 of out - base, sum of out - base, entries) over all tensors, float64."""
    changed, l1, s, n = 0, 0.0, 0.0, 0
    for name, b in base.items():
        d = out[name].double() - b.double()
        changed += int((d != 0).sum())
        l1 += float(d.abs().sum())
        s += float(d.sum())
        n += d.numel()
    return changed, l1, s, n


def _expert_nonzero(fam, i: int) -> int:
    e = load_dir(fam["experts"][i])
    return sum(int((e[k] != b).sum()) for k, b in fam["base_t"].items())


@pytest.mark.parametrize("method", RANDOM)
def test_random_methods_statistically_equal_mergekit(fam, method):
    base = fam["base_t"]
    # keep rate without rescale, one expert
    name = method
    ours, theirs = _run_params(fam, name, [0], [1.0], {"rescale": False}, f"{method}-rate")
    n_nonzero = _expert_nonzero(fam, 0)
    c_o, _, _, _ = _delta_stats(ours, base)
    c_t, _, _, _ = _delta_stats(theirs, base)
    p = DENSITY
    sd = math.sqrt(p * (1 - p) / n_nonzero)
    rate_o, rate_t = c_o / n_nonzero, c_t / n_nonzero
    if method.startswith("dare"):  # DELLA's rate among the changed entries exceeds p (zeros rank lowest)
        assert abs(rate_o - p) <= 5 * sd + 2e-3, (rate_o, p)  # (bf16: a kept delta may round away)
    assert abs(rate_o - rate_t) <= 5 * sd * math.sqrt(2) + 2e-3, (rate_o, rate_t)
    # expected update with rescale, one expert: L1 restored by both
    o1, t1 = _run_params(fam, name, [0], [1.0], {}, f"{method}-l1")
    _, l1_o, s_o, n = _delta_stats(o1, base)
    _, l1_t, s_t, _ = _delta_stats(t1, base)
    rel1 = abs(l1_o - l1_t) / l1_t
    assert rel1 <= (1e-4 if fam["dtype"] == "fp32" else 2e-2), (l1_o, l1_t)
    assert abs(s_o - s_t) <= 0.05 * l1_t, (s_o, s_t, l1_t)
    # three experts, defaults
    o3, t3 = _run_params(fam, name, [0, 1, 2], WEIGHTS, {}, f"{method}-3")
    _, l1_o3, s_o3, _ = _delta_stats(o3, base)
    _, l1_t3, s_t3, _ = _delta_stats(t3, base)
    rel3 = abs(l1_o3 - l1_t3) / l1_t3
    assert rel3 <= 0.03, (l1_o3, l1_t3)
    assert abs(s_o3 - s_t3) <= 0.05 * l1_t3, (s_o3, s_t3, l1_t3)
    REPORT[(fam["dtype"], method)] = dict(rate=(rate_o, rate_t), sd=sd, l1_rel_1=rel1, l1_rel_3=rel3,
                                          mean_gap_3=abs(s_o3 - s_t3) / l1_t3)
    print(fam["dtype"], method, REPORT[(fam["dtype"], method)])


def _run_params(fam, method, experts, weights, params: dict, tag: str):
    out = fam["root"] / tag
    out.mkdir()
    cfgs = []
    for mk in (False, True):
        cfg = _config(fam, method, experts, weights, mk)
        cfg.setdefault("parameters", {}).update(params)
        cfgs.append(cfg)
    merge_config(fam["cat"], parse_config(yaml.safe_dump(cfgs[0])), out / "mp", model_id=tag)
    ours = load_dir(out / "mp")
    theirs = mergekit_merge(cfgs[1], out / "mk", seed=SEED)
    return ours, theirs


def test_random_streams_do_not_depend_on_the_catalog(fam, tmp_path):
    """The same YAML over the same files gives the same bits in another catalog whose ids differ: the
    random streams are seeded by the experts' block contents, not by catalog ids (ops/streams.py)."""
    from mergepipe.api import analyze
    cat = Catalog(tmp_path / "other.sqlite")
    try:
        register(cat, "the-base", fam["base"])
        for i, e in enumerate(fam["experts"]):
            register(cat, f"other-{2 - i}", e, base_id="the-base")
        analyze(cat, block_bytes=4096)
        for method in ("dare_ties", "della_linear"):
            cfg = parse_config(yaml.safe_dump(_config(fam, method, [0, 1, 2], WEIGHTS, False)))
            merge_config(fam["cat"], cfg, tmp_path / f"{method}-here", model_id=f"{method}-here")
            merge_config(cat, cfg, tmp_path / f"{method}-there", model_id=f"{method}-there")
            a, b = load_dir(tmp_path / f"{method}-here"), load_dir(tmp_path / f"{method}-there")
            assert all(torch.equal(a[k], b[k]) for k in a), method
    finally:
        cat.close()
