"""Parameters where mergekit 0.1.5 allows them (issue 15, item 5): per-model gamma (breadcrumbs) and epsilon
(DELLA), which mergekit declares per model (NON_BASE); ``int8_mask``, a no-op in mergekit's arithmetic.

* per-model gamma: each expert's own top-gamma cut; breadcrumbs and breadcrumbs_ties equal mergekit's output
  except at entries where an expert's |delta| equals one of its own cut-off magnitudes (mergekit's unstable
  sort keeps an arbitrary subset of tied entries, MergePipe the first in flat order, the count the same);
* per-model epsilon: the expert's own keep-probability spread: a one-expert merge with its own epsilon is
  bit-equal to the merge-wide epsilon (the per-model value reaches the kernel), and the three-expert update
  is statistically equal to mergekit's (L1 within 3 %);
* int8_mask: mergekit's int8 sign mask selects exactly the same entries as its float mask (sign values
  -1, 0, 1 are exact in both): its outputs are bit-equal with and without, and so are MergePipe's, which
  accepts the key and computes its mask as it always does;
* lambda, a merge-wide (SHARED) parameter in mergekit, given per model is ignored by both, with a warning here
  (tests/parity/test_parity_ignored.py).
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.api import merge_config
from mergepipe.config.parse import parse_config

from mergekit_runner import PARAM_DENSITY, merge_both, params_config, params_family

DENSITY = PARAM_DENSITY


@pytest.fixture(scope="module")
def pfam(tmp_path_factory):
    fam = params_family(tmp_path_factory, "params")
    yield fam
    fam["cat"].close()


_cfg, _merge = params_config, merge_both


def _tied(fam, name, gammas) -> torch.Tensor:
    """Entries where some expert's non-zero |delta| equals one of its own breadcrumbs cut-offs (k_hi, k_hi + k)."""
    base = fam["base_t"][name].float()
    tied = torch.zeros(base.shape, dtype=torch.bool)
    for i, g in enumerate(gammas):
        a = (fam["experts_t"][i][name].float() - base).abs()
        n = a.numel()
        srt = torch.sort(a.reshape(-1), descending=True).values
        k_hi = min(int(g * n), n - int(DENSITY * n))
        for k in (k_hi, k_hi + int(DENSITY * n)):
            if 0 < k <= n and srt[k - 1] > 0:  # a zero delta kept or dropped changes nothing
                tied |= a == srt[k - 1]
    return tied


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
def test_per_model_gamma_equals_mergekit(pfam, method):
    gammas = [0.02, 0.0, 0.1]
    plan, ours, theirs = _merge(pfam, _cfg(pfam, method, {"gamma": gammas}), f"{method}-gamma")
    assert [e.get("gamma") for e in plan["experts"]] == gammas
    differing = at_ties = 0
    for name in ours:
        diff = ours[name] != theirs[name]
        tied = _tied(pfam, name, gammas)
        assert not (diff & ~tied).any(), (name, int((diff & ~tied).sum()))
        differing += int(diff.sum())
        at_ties += int(tied.sum())
    print(method, "differing", differing, "entries at a cut-off", at_ties)
    # one model per gamma: its own cut, exactly mergekit's kept count
    for i, g in enumerate(gammas):
        _, o1, t1 = _merge(pfam, _cfg(pfam, method, {"gamma": [g]}, experts=(i,), weights=[1.0]), f"{method}-g{i}")
        base = pfam["base_t"]
        assert sum(int((o1[n] != base[n]).sum()) for n in o1) == sum(int((t1[n] != base[n]).sum()) for n in t1)


def test_per_model_epsilon_reaches_the_kernel_and_matches_mergekit(pfam):
    epsilons = [0.05, 0.15, 0.3]
    plan, ours, theirs = _merge(pfam, _cfg(pfam, "della_linear", {"epsilon": epsilons}), "della-eps")
    assert [e.get("epsilon") for e in plan["experts"]] == epsilons
    base = pfam["base_t"]
    l1_o = sum(float((ours[n].double() - base[n].double()).abs().sum()) for n in base)
    l1_t = sum(float((theirs[n].double() - base[n].double()).abs().sum()) for n in base)
    assert abs(l1_o - l1_t) <= 0.03 * l1_t, (l1_o, l1_t)
    # the expert's own epsilon is the one used: the same bits as that epsilon given merge-wide
    _, own, _ = _merge(pfam, _cfg(pfam, "della_linear", {"epsilon": [0.3]}, experts=(2,), weights=[1.0]),
                       "della-own", mergekit=False)
    _, wide, _ = _merge(pfam, _cfg(pfam, "della_linear", {}, experts=(2,), weights=[1.0],
                                   parameters={"epsilon": 0.3}), "della-wide", mergekit=False)
    _, other, _ = _merge(pfam, _cfg(pfam, "della_linear", {}, experts=(2,), weights=[1.0],
                                    parameters={"epsilon": 0.05}), "della-other", mergekit=False)
    assert all(torch.equal(own[n], wide[n]) for n in own)
    assert not all(torch.equal(own[n], other[n]) for n in own)


def test_int8_mask_is_a_no_op_in_mergekit_and_here(pfam):
    cfg = _cfg(pfam, "ties", {})
    _, ours, theirs = _merge(pfam, cfg, "ties-float-mask")
    cfg8 = _cfg(pfam, "ties", {}, parameters={"int8_mask": True})
    _, ours8, theirs8 = _merge(pfam, cfg8, "ties-int8-mask")
    assert all(torch.equal(theirs[n], theirs8[n]) for n in theirs)
    assert all(torch.equal(ours[n], ours8[n]) for n in ours)


def _ties_cutoff_entries(fam, name) -> torch.Tensor:
    """Entries where some expert's non-zero |delta| equals its TIES cut-off (the k-th largest, k = int(density n))."""
    base = fam["base_t"][name].float()
    tied = torch.zeros(base.shape, dtype=torch.bool)
    for x in fam["experts_t"]:
        a = (x[name].float() - base).abs()
        k = max(1, int(DENSITY * a.numel()))
        cut = torch.sort(a.reshape(-1), descending=True).values[k - 1]
        if cut > 0:
            tied |= a == cut
    return tied


def test_lambda_gradient_is_bit_equal_to_mergekit(pfam):
    cfg = _cfg(pfam, "task_arithmetic", {}, parameters={"lambda": [0.5, 1.5]})
    plan, ours, theirs = _merge(pfam, cfg, "ta-lambda-gradient")
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    tp = plan["tensor_params"]
    assert tp["model.layers.0.mlp.up_proj.weight"] == {"lambda": 0.5}
    assert tp["model.layers.1.mlp.up_proj.weight"] == {"lambda": 1.5}
    assert tp["model.embed_tokens.weight"] == {"lambda": 0.5}  # outside the layers: t = 0, as mergekit


@pytest.mark.parametrize("parameters", [
    {"normalize": [{"filter": "mlp", "value": False}, {"value": True}],
     "lambda": [{"filter": "self_attn", "value": 0.7}, {"value": 1.2}]},
    {"rescale": [{"filter": "mlp", "value": True}, {"value": False}]},
], ids=["normalize-lambda-filters", "rescale-filters"])
def test_per_tensor_normalize_rescale_lambda_equal_mergekit(pfam, parameters):
    """Filters of normalize/rescale/lambda (mergekit's per-tensor merge-wide parameters): equal to mergekit up to
    float32 rounding (16 ulps with rescale, whose factor is a float64 ratio here) except at TIES' cut-off ties;
    an export of the plan merges to the same digest."""
    from mergepipe.config.export import export_plan_data
    cfg = _cfg(pfam, "ties", {}, parameters=parameters)
    tag = "ties-" + "-".join(sorted(parameters))
    plan, ours, theirs = _merge(pfam, cfg, tag)
    differing = 0
    for name in ours:
        diff = (ours[name].double() - theirs[name].double()).abs()
        scale = torch.stack([pfam["base_t"][name].double().abs()] + [x[name].double().abs() for x in pfam["experts_t"]]
                            + [theirs[name].double().abs()]).amax(0).clamp(min=2.0 ** -126)
        ulps = diff / torch.exp2(torch.floor(torch.log2(scale)) - 23)
        untied = ~_ties_cutoff_entries(pfam, name)
        assert float(ulps[untied].max()) <= 16, (name, float(ulps[untied].max()))
        differing += int((diff > 0).sum())
    print(tag, "differing", differing)
    key = next(iter(parameters))
    values = {n: p[key] for n, p in plan["tensor_params"].items()}
    assert {v for n, v in values.items() if "mlp" in n} == {parameters[key][0]["value"]}
    assert {v for n, v in values.items() if "mlp" not in n and "self_attn" not in n} == {parameters[key][-1]["value"]}
    text = export_plan_data(pfam["cat"], plan.data)
    again = merge_config(pfam["cat"], parse_config(text), pfam["root"] / tag / "again", model_id=tag + "-again")[0]
    assert again.digest == plan.digest
