"""Per-tensor gamma and epsilon (issue 15, item 5): mergekit's per-model parameters given as filters or a gradient,
merge-wide (each model falls back to it) or per model, against mergekit 0.1.5.

* breadcrumbs with gamma as a gradient per model and as merge-wide filters: equal to mergekit's output except
  at entries where an expert's |delta| equals one of its own cut-off magnitudes on that tensor (mergekit's
  unstable sort keeps an arbitrary subset of tied entries; MergePipe the first in flat order);
* della with epsilon as filters: on every tensor, bit-equal to the merge with that tensor's epsilon given
  merge-wide (the per-tensor value reaches the kernel; DARE/DELLA are seeded by content, not by name), and the
  update statistically equal to mergekit's (L1 within 3 %);
* a per-tensor gamma outside its range, or one that makes gamma + density > 1 on a tensor, is refused naming the
  model and the tensor; the catalog is unchanged.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe.api import merge_config
from mergepipe.catalog.models import model_ids
from mergepipe.config.parse import parse_config
from mergepipe.errors import MergePipeError
from mergepipe.planner.settings import LAYER

from mergekit_runner import PARAM_DENSITY, merge_both, params_config, params_family

DENSITY = PARAM_DENSITY


@pytest.fixture(scope="module")
def tfam(tmp_path_factory):
    fam = params_family(tmp_path_factory, "tparams")
    fam["layers"] = 1 + max(int(m.group(1)) for n in fam["base_t"] if (m := LAYER.search(n)))
    yield fam
    fam["cat"].close()


_cfg, _merge = params_config, merge_both


def _gamma_on(setting, name: str, layers: int) -> float:
    """An independent reading of mergekit's setting semantics: a gradient over the layer index (t = 0 off
    layers), or the first matching filter."""
    if isinstance(setting, (int, float)):
        return float(setting)
    if isinstance(setting[0], dict):
        for cond in setting:
            if cond.get("filter") is None or cond["filter"] in name:
                return _gamma_on(cond["value"], name, layers)
        raise AssertionError(name)
    m = LAYER.search(name)
    t = int(m.group(1)) / (layers - 1) if m else 0.0
    pos = t * (len(setting) - 1)
    i = min(int(pos), len(setting) - 2)
    return setting[i] + (setting[i + 1] - setting[i]) * (pos - i)


def _tied(fam, name, gammas) -> torch.Tensor:
    base = fam["base_t"][name].float()
    tied = torch.zeros(base.shape, dtype=torch.bool)
    for i, setting in enumerate(gammas):
        g = _gamma_on(setting, name, fam["layers"])
        a = (fam["experts_t"][i][name].float() - base).abs()
        n = a.numel()
        srt = torch.sort(a.reshape(-1), descending=True).values
        k_hi = min(int(g * n), n - int(DENSITY * n))
        for k in (k_hi, k_hi + int(DENSITY * n)):
            if 0 < k <= n and srt[k - 1] > 0:
                tied |= a == srt[k - 1]
    return tied


def _check_breadcrumbs(fam, ours, theirs, gammas):
    for name in ours:
        diff = ours[name] != theirs[name]
        tied = _tied(fam, name, gammas)
        assert not (diff & ~tied).any(), (name, int((diff & ~tied).sum()))


def test_gamma_gradient_per_model_equals_mergekit(tfam):
    gammas = [[0.0, 0.1], [0.05, 0.02, 0.2], 0.01]
    plan, ours, theirs = _merge(tfam, _cfg(tfam, "breadcrumbs", {"gamma": gammas}), "bc-gradient")
    e = plan["experts"]
    assert e[0]["gamma"] == [0.0, 0.1] and e[2]["gamma"] == 0.01 and "tensor_params" not in e[2]
    for name, own in e[1]["tensor_params"].items():
        assert own["gamma"] == pytest.approx(_gamma_on(gammas[1], name, tfam["layers"]), abs=1e-12)
    assert {v["gamma"] for v in e[0]["tensor_params"].values()} == {0.0, 0.1}  # embeddings/layer 0, last layer
    _check_breadcrumbs(tfam, ours, theirs, gammas)


def test_gamma_filters_merge_wide_equal_mergekit(tfam):
    wide = [{"filter": "mlp", "value": 0.15}, {"filter": "self_attn", "value": [0.0, 0.08]}, {"value": 0.02}]
    plan, ours, theirs = _merge(tfam, _cfg(tfam, "breadcrumbs_ties", parameters={"gamma": wide}), "bc-filters")
    for x in plan["experts"]:
        assert {n: v["gamma"] for n, v in x["tensor_params"].items()} == {
            n: _gamma_on(wide, n, tfam["layers"]) for n in x["tensor_params"]}
    _check_breadcrumbs(tfam, ours, theirs, [wide] * 3)
    # a model's own condition list falls back to the merge-wide one where none of its conditions matches
    own = [{"filter": "mlp", "value": 0.0}]
    plan, ours, theirs = _merge(tfam, _cfg(tfam, "breadcrumbs", {"gamma": [own, own, own]},
                                           parameters={"gamma": 0.1}), "bc-fallback")
    tp = plan["experts"][0]["tensor_params"]
    assert {n: v["gamma"] for n, v in tp.items() if "mlp" in n} and all(
        v["gamma"] == (0.0 if "mlp" in n else 0.1) for n, v in tp.items())
    _check_breadcrumbs(tfam, ours, theirs, [own + [{"value": 0.1}]] * 3)


def test_epsilon_filters_reach_the_kernel_per_tensor(tfam):
    eps = [{"filter": "mlp", "value": 0.3}, {"value": 0.05}]
    _, ours, theirs = _merge(tfam, _cfg(tfam, "della_linear", parameters={"epsilon": eps}), "della-filters")
    _, hi, _ = _merge(tfam, _cfg(tfam, "della_linear", parameters={"epsilon": 0.3}), "della-03", mergekit=False)
    _, lo, _ = _merge(tfam, _cfg(tfam, "della_linear", parameters={"epsilon": 0.05}), "della-005", mergekit=False)
    for name in ours:
        assert torch.equal(ours[name], (hi if "mlp" in name else lo)[name]), name
    assert any(not torch.equal(hi[n], lo[n]) for n in hi if "mlp" in n)
    base = tfam["base_t"]
    l1_o = sum(float((ours[n].double() - base[n].double()).abs().sum()) for n in base)
    l1_t = sum(float((theirs[n].double() - base[n].double()).abs().sum()) for n in base)
    assert abs(l1_o - l1_t) <= 0.03 * l1_t, (l1_o, l1_t)


@pytest.mark.parametrize("gamma,message", [
    ([{"filter": "mlp", "value": 1.5}, {"value": 0.0}],
     r"gamma of e1 on model\.layers\.0\.mlp\.\w+\.weight 1\.5 is outside the range \[0, 1\] of gamma"),
    ([{"filter": "mlp", "value": 0.7}, {"value": 0.0}],
     r"breadcrumbs needs gamma \+ density <= 1 \(gamma 0\.7 \+ density 0\.5 of e1 on model\.layers\.0\.mlp"),
])
def test_bad_per_tensor_gamma_refused_catalog_unchanged(tfam, gamma, message):
    cat = tfam["cat"]
    before = (model_ids(cat), cat.conn.execute("SELECT COUNT(*) FROM plans").fetchone())
    with pytest.raises(MergePipeError, match=message):
        merge_config(cat, parse_config(yaml.safe_dump(_cfg(tfam, "breadcrumbs", parameters={"gamma": gamma}))),
                     tfam["root"] / "refused", model_id="refused")
    assert (model_ids(cat), cat.conn.execute("SELECT COUNT(*) FROM plans").fetchone()) == before
    assert not (tfam["root"] / "refused").exists()
