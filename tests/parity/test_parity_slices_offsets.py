"""``slices:`` whose sources start at different layers (layer i of the base merged with layer j of an
expert), against mergekit 0.1.5 at full budget, and under a budget.

MergePipe merges such an expert through a layer view (storage/views.py): the expert's tensors read under
the base's layer names, registered against the base and analyzed like any expert, so the plan's budget,
bound and byte ranges are the view's.

Tolerances, as in test_parity_slices.py: merged tensors within 8 float32 ulps of the tensor's largest value
(the slerp angle and task-arithmetic sums come from the catalog's float64 statistics); most are bit-equal
(the measured numbers are in the README's slices paragraph).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mergepipe import api
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config
from mergepipe.storage.views import LAYER, renumber

from merge_helpers import dump_db, load_dir, open_copy, run_cli, shared_family
from mergekit_runner import mergekit_merge

EPS32 = 2.0 ** -23
ULPS = 8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    fam = shared_family(tmp_path_factory, "small-fp32")  # 4 layers, 2 experts
    work = tmp_path_factory.mktemp("slices-offsets")
    cat = open_copy(fam, work / "cat.sqlite")
    yield fam, cat, work
    cat.close()


def _src(model, start, end, **params):
    s = {"model": str(model), "layer_range": [start, end]}
    if params:
        s["parameters"] = params
    return s


def _merge_both(cat, work, cfg, name):
    cfg = dict(cfg, dtype="float32")
    ref = mergekit_merge(cfg, work / f"mk-{name}")
    plan, _, manifest = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / f"mp-{name}",
                                         model_id=f"mp-{name}")
    return plan, manifest, load_dir(work / f"mp-{name}"), ref


def _ulps(got, ref, tied=None) -> tuple[float, int]:
    """(the largest difference in ulps of the tensor's largest value, how many tensors are bit-equal); ``tied``:
    per tensor, entries left out of the difference (TIES' tied cut-off magnitudes)."""
    assert sorted(got) == sorted(ref)
    worst, equal = 0.0, 0
    for name in ref:
        a, b = got[name], ref[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        d = (a.double() - b.double()).abs()
        diff = float(d[~tied[name]].max()) if tied is not None and (~tied[name]).any() else float(d.max())
        worst = max(worst, diff / (EPS32 * float(b.abs().max())))
        equal += bool(torch.equal(a, b))
    return worst, equal


def _inputs(cfg, out_name: str) -> list[tuple[str, str, float]]:
    """(model path, input tensor name, density) of every source of the output tensor ``out_name``, as mergekit
    pairs them (layer start + i of every source of a slice; outside the layers, the same name)."""
    m = LAYER.search(out_name)
    if m is None:
        sl, i = cfg["slices"][0], None
    else:
        j = int(m.group(1))
        for sl in cfg["slices"]:
            n = sl["sources"][0]["layer_range"][1] - sl["sources"][0]["layer_range"][0]
            if j < n:
                i = j
                break
            j -= n
    return [(s["model"], out_name if i is None else renumber(out_name, s["layer_range"][0] + i),
             (s.get("parameters") or {}).get("density", 1.0)) for s in sl["sources"]]


def _tied(cfg, got) -> dict[str, torch.Tensor]:
    """Per output tensor, the entries where some expert's |delta| (its input tensor minus the base's) equals its
    TIES cut-off magnitude (the k-th largest): there mergekit's unstable sort keeps an arbitrary subset of the
    tied entries, MergePipe the first in flat order (as in test_parity_existing.py)."""
    loaded = {}
    out = {}
    for name in got:
        srcs = _inputs(cfg, name)
        base_model, base_name, _ = next(x for x in srcs if x[0] == cfg["base_model"])
        load = lambda path: loaded.setdefault(path, load_dir(path))
        base = load(base_model)[base_name].float()
        tied = torch.zeros(base.shape, dtype=torch.bool)
        for model, inp, density in srcs:
            if model == cfg["base_model"]:
                continue
            a = (load(model)[inp].float() - base).abs()
            cut = torch.sort(a.reshape(-1), descending=True).values[max(1, int(density * a.numel())) - 1]
            tied |= a == cut
        out[name] = tied
    return out


def _layers(path):
    return json.loads((path / "config.json").read_text())["num_hidden_layers"]


def _offsets(fam, **params):
    """Output layers 0-1: base layers 0-1 with e1's layers 2-3 (the brief's example)."""
    return [{"sources": [_src(fam.base, 0, 2), _src(fam.experts[0], 2, 4, **params)]}]


CASES = {
    "slerp": lambda f: {"slices": _offsets(f), "merge_method": "slerp", "base_model": str(f.base),
                        "parameters": {"t": 0.5}},
    "slerp-gradient": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[0], 2, 4)]},
                   {"sources": [_src(f.base, 2, 4), _src(f.experts[0], 0, 2)], "parameters": {"t": 0.3}}],
        "merge_method": "slerp", "base_model": str(f.base),
        "parameters": {"t": [{"filter": "mlp", "value": [0.9, 0.1]}, {"value": 0.6}]}},
    "task_arithmetic": lambda f: {
        "slices": [{"sources": [_src(f.base, 1, 3), _src(f.experts[0], 2, 4, weight=0.7),
                                _src(f.experts[1], 0, 2, weight=[1.2, 0.4])]}],
        "merge_method": "task_arithmetic", "base_model": str(f.base)},
    "ties": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[0], 2, 4, weight=0.8, density=0.5),
                                _src(f.experts[1], 1, 3, weight=0.6, density=0.7)]},
                   {"sources": [_src(f.base, 3, 4), _src(f.experts[0], 0, 1, weight=0.5, density=0.5),
                                _src(f.experts[1], 3, 4, weight=0.6, density=0.7)]}],
        "merge_method": "ties", "base_model": str(f.base), "parameters": {"normalize": True}},
    "linear": lambda f: {
        "slices": [{"sources": [_src(f.base, 0, 2, weight=0.5), _src(f.experts[0], 2, 4),
                                _src(f.experts[1], 1, 3, weight=0.25)]}],
        "merge_method": "linear", "base_model": str(f.base), "parameters": {"weight": 1.0}},
}
MEASURED: dict[str, tuple[float, int, int]] = {}


@pytest.mark.parametrize("case", list(CASES))
def test_sources_at_other_layers_equal_mergekit(small, case):
    fam, cat, work = small
    cfg = CASES[case](fam)
    plan, manifest, got, ref = _merge_both(cat, work, cfg, case)
    tied = _tied(cfg, got) if case == "ties" else None
    worst, equal = _ulps(got, ref, tied)
    MEASURED[case] = (worst, equal, len(ref))
    at_ties = sum(int(((got[n] != ref[n]) & tied[n]).sum()) for n in ref) if tied else 0
    print(f"{case}: {worst:.2f} ulp, {equal}/{len(ref)} tensors bit-equal, {at_ties} entries differ at tied "
          f"magnitudes")
    assert worst <= ULPS, case
    n_out = sum(sl["sources"][0]["layer_range"][1] - sl["sources"][0]["layer_range"][0] for sl in cfg["slices"])
    assert _layers(work / f"mp-{case}") == n_out
    # every shifted expert is merged through its layer view, analyzed against the base
    views = [e for e in plan["experts"] if "::layers=" in e["uri"]]
    assert views and all(cat.is_analyzed(e["id"]) for e in views)
    assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
    assert manifest.core["realized_by_expert"] == plan["expert_read_by_expert"]
