"""mergekit ``slices:`` configs against mergekit 0.1.5 at full budget: gradient SLERP over a slice
(LazyMergekit's recipe), passthrough frankenmerges (repeated and reordered layers from two models, with
and without ``scale``), multi-slice configs with per-slice and per-source parameters and reordered merged
layers; and the refusals of what cannot be expressed, with their exact messages, leaving the catalog
unchanged.

Tolerances: passthrough copies are bit-equal; merged tensors are within 8 float32 ulps of the tensor's
largest value (the slerp angle and task arithmetic sums come from the catalog's float64 statistics, as
in test_parity_methods.py / test_parity_existing.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mergepipe import api
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config

from merge_helpers import assert_config_refused, catalog_counts, load_dir, open_copy, run_cli, shared_family, slice_source as _src
from mergekit_runner import config_merge_both, mergekit_merge

EPS32 = 2.0 ** -23
ULPS = 8  # the small family's larger tensors: float32 reductions in mergekit, float64 statistics here
GRADIENT_T = [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
              {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    fam = shared_family(tmp_path_factory, "small-fp32")  # 4 layers
    work = tmp_path_factory.mktemp("slices-small")
    cat = open_copy(fam, work / "cat.sqlite")
    yield fam, cat, work
    cat.close()


@pytest.fixture(scope="module", params=["tiny-fp32", "tiny-bf16"])
def tiny(request, tmp_path_factory):
    fam = shared_family(tmp_path_factory, request.param)  # 2 layers
    work = tmp_path_factory.mktemp(f"slices-{request.param}")
    cat = open_copy(fam, work / "cat.sqlite")
    yield request.param, fam, cat, work
    cat.close()


def _both(fam, start, end, **slice_params):
    sl = {"sources": [_src(fam.base, start, end), _src(fam.experts[0], start, end)]}
    if slice_params:
        sl["parameters"] = slice_params
    return sl


def _merge_both(cat, work, cfg, name, out_dtype=None):
    cfg = dict(cfg, dtype="float32", **({"out_dtype": out_dtype} if out_dtype else {}))
    return config_merge_both(cat, work, cfg, name)


def _close(got, ref):
    assert sorted(got) == sorted(ref)
    for name in ref:
        a, b = got[name], ref[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert float((a - b).abs().max()) <= ULPS * EPS32 * float(b.abs().max()), name


def _layers(path):
    return json.loads((path / "config.json").read_text())["num_hidden_layers"]


def test_gradient_slerp_over_a_slice_equals_mergekit(small):
    """LazyMergekit's default: one slice over every layer of two models, slerp with filtered gradients."""
    fam, cat, work = small
    cfg = {"slices": [_both(fam, 0, 4)], "merge_method": "slerp", "base_model": str(fam.base),
           "parameters": {"t": GRADIENT_T}}
    plan, manifest, got, ref = _merge_both(cat, work, cfg, "gradient")
    _close(got, ref)
    assert "layout" not in plan.data  # the base's own tensors in place: a plain merge with per-tensor t
    t = {c["filter"]: c["value"] for c in plan["params"]["t"]}
    # t = layer / 3 over the slice; gradient [0, .5, .3, .7, 1] at 1/3 -> scaled 4/3 -> .5 + (.3 - .5) / 3
    assert t["model.layers.1.self_attn.q_proj.weight"] == pytest.approx(0.5 - 0.2 / 3)
    assert t["model.layers.3.mlp.up_proj.weight"] == 0.0 and t["model.norm.weight"] == 0.5
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    assert _layers(work / "mp-gradient") == 4


def test_multi_slice_per_slice_parameters_equal_mergekit(small):
    """Two slices, each with its own t (a number; a gradient over that slice only); the embeddings take
    the first slice's settings at t = 0, the final norm and lm_head the last slice's."""
    fam, cat, work = small
    cfg = {"slices": [_both(fam, 0, 2, t=0.2), _both(fam, 2, 4, t=[0.9, 0.1])], "merge_method": "slerp",
           "base_model": str(fam.base), "parameters": {"t": 0.5}}
    plan, _, got, ref = _merge_both(cat, work, cfg, "per-slice")
    _close(got, ref)
    t = {c["filter"]: c["value"] for c in plan["params"]["t"]}
    assert t["model.layers.1.mlp.up_proj.weight"] == 0.2 and t["model.embed_tokens.weight"] == 0.2
    assert t["model.layers.2.mlp.up_proj.weight"] == pytest.approx(0.9)
    assert t["model.layers.3.mlp.up_proj.weight"] == pytest.approx(0.1) and t["lm_head.weight"] == pytest.approx(0.9)


def test_per_source_weights_and_reordered_merged_layers_equal_mergekit(small):
    """task_arithmetic over two slices in reverse order (output layers 0-1 are input layers 2-3, merged)
    with a per-source weight that differs between the slices (a number, then a gradient)."""
    fam, cat, work = small
    base, e1 = fam.base, fam.experts[0]
    cfg = {"slices": [{"sources": [_src(base, 2, 4), _src(e1, 2, 4, weight=0.3)]},
                      {"sources": [_src(base, 0, 2), _src(e1, 0, 2, weight=[1.5, 0.5])]}],
           "merge_method": "task_arithmetic", "base_model": str(base)}
    plan, manifest, got, ref = _merge_both(cat, work, cfg, "reordered")
    _close(got, ref)
    layout = {t[0]: t[2] for t in plan["layout"]["tensors"]}
    assert layout["model.layers.0.mlp.up_proj.weight"] == "model.layers.2.mlp.up_proj.weight"
    assert layout["model.layers.3.self_attn.q_proj.weight"] == "model.layers.1.self_attn.q_proj.weight"
    assert plan["layout"]["layers"] == [["base", 2], ["base", 3], ["base", 0], ["base", 1]]
    assert manifest.core["realized_by_expert"] == plan["expert_read_by_expert"]
    assert _layers(work / "mp-reordered") == 4


FRANKEN = lambda fam: [{"sources": [_src(fam.base, 0, 2)]}, {"sources": [_src(fam.experts[0], 1, 2)]},
                       {"sources": [_src(fam.experts[1], 0, 2)]}, {"sources": [_src(fam.base, 0, 1)]}]


def test_passthrough_frankenmerge_is_bit_equal_to_mergekit(tiny):
    """Layers 0-1 of the base, layer 1 of e1, layers 0-1 of e2, layer 0 of the base again: 6 layers,
    renumbered; every tensor a copy (no expert delta read)."""
    dtype, fam, cat, work = tiny
    cfg = {"slices": FRANKEN(fam), "merge_method": "passthrough", "base_model": str(fam.base)}
    out_dtype = "bfloat16" if dtype.endswith("bf16") else None
    plan, manifest, got, ref = _merge_both(cat, work, cfg, "franken", out_dtype)
    assert sorted(got) == sorted(ref)
    assert {n for n in got if ".layers.5." in n} and not {n for n in got if ".layers.6." in n}
    for name in ref:
        assert got[name].dtype == ref[name].dtype and torch.equal(got[name], ref[name]), name
    e1 = load_dir(fam.experts[0])
    assert torch.equal(got["model.layers.2.mlp.up_proj.weight"], e1["model.layers.1.mlp.up_proj.weight"])
    assert _layers(work / "mp-franken") == _layers(work / "mk-franken") == 6
    assert [m for m, _ in plan["layout"]["layers"]] == ["base", "base", "e1", "e2", "e2", "base"]
    core = manifest.core
    assert plan["full_expert_bytes"] == 0 and core["realized"]["expert_read"] == 0
    assert core["realized"]["base_read"] == plan["estimate"]["base_read"] == sum(
        v.numel() * v.element_size() for v in got.values())
    assert cat.model("mp-franken")["base_id"] is None  # other tensors than the base: a model of its own
    text = api.explain(cat, plan.id)
    assert "layout     57 output tensors, 6 layers: 0-1 <- base 0-1, 2 <- e1 1, 3-4 <- e2 0-1, 5 <- base 0" in text


def test_passthrough_scale_per_slice_equals_mergekit(tiny):
    """mergekit's per-input ``scale`` (filter conditions on a slice, a number on a source)."""
    dtype, fam, cat, work = tiny
    slices = FRANKEN(fam)
    slices[1]["parameters"] = {"scale": [{"filter": "o_proj", "value": 0.0}, {"filter": "down_proj", "value": 0.5},
                                         {"value": 1.0}]}
    slices[2]["sources"][0]["parameters"] = {"scale": 0.75}
    cfg = {"slices": slices, "merge_method": "passthrough", "base_model": str(fam.base)}
    out_dtype = "bfloat16" if dtype.endswith("bf16") else None
    _, _, got, ref = _merge_both(cat, work, cfg, "scaled", out_dtype)
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert not got["model.layers.2.self_attn.o_proj.weight"].any()


REFUSALS = [
    (lambda f: {"slices": [{"sources": [_src(f.base, 0, 3)]}], "merge_method": "passthrough"},
     "slices[0].sources[0].layer_range [0, 3] is out of range: {base} has 2 layers (0-1)"),
    (lambda f: {"slices": [{"sources": [_src(f.base, 0, 2), _src(f.experts[0], 0, 1)]}], "merge_method": "slerp",
                "base_model": str(f.base), "parameters": {"t": 0.5}},
     "slices[0]: the sources cover different numbers of layers ({base} [0, 2], {e1} [0, 1]); every source of a "
     "slice must cover the same number of layers"),
    (lambda f: {"slices": [{"sources": [_src(f.base, 1, 0)]}], "merge_method": "passthrough"},
     "slices[0].sources[0].layer_range must be [start, end] with 0 <= start < end (integers), not [1, 0]"),
    (lambda f: {"slices": [_both(f, 0, 2), _both(f, 1, 2)], "merge_method": "slerp", "base_model": str(f.base),
                "parameters": {"t": 0.5}},
     "slices[1]: layer 1 of the base is merged again (also in slices[0]); MergePipe merges each base layer once "
     "(repeat layers with `merge_method: passthrough`)"),
    (lambda f: {"slices": [_both(f, 0, 2)], "merge_method": "passthrough"},
     "slices[0]: passthrough copies one source per slice (2 given)"),
]


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_bad_slices_are_refused_and_change_nothing(tmp_path, tiny, case):
    dtype, fam, cat, work = tiny
    make, message = REFUSALS[case]
    cfg = make(fam)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    db = work / "cat.sqlite"
    expected = f"bad.yaml: {message.format(base=fam.base, e1=fam.experts[0])}"
    assert_config_refused(cat, db, path, tmp_path, expected)


@pytest.mark.parametrize("name", ["franken", "scaled"])
def test_passthrough_plan_exports_as_slices_and_round_trips(tiny, name):
    """``explain --as-mergekit`` of a frankenmerge writes `slices:` that mergekit merges to the same bytes
    and MergePipe plans to the same digest."""
    dtype, fam, cat, work = tiny
    from mergepipe.config.export import export_mergekit
    from mergepipe.config.resolve import plan_from_config
    plan_id = cat.conn.execute("SELECT plan_id FROM snapshots WHERE model_id = ?", (f"mp-{name}",)).fetchone()[0]
    text = export_mergekit(cat, plan_id)
    assert "slices:" in text and "models:" not in text
    again, _ = plan_from_config(cat, parse_config(text), save=False)
    assert again.id == plan_id
    cfg = yaml.safe_load(text)
    cfg.pop("mergepipe")
    ref = mergekit_merge(cfg, work / f"mk-export-{name}")
    got = load_dir(work / f"mp-{name}")
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_reordered_merge_exports_as_slices_and_round_trips(small):
    fam, cat, work = small
    from mergepipe.config.export import export_mergekit
    from mergepipe.config.resolve import plan_from_config
    for name in ("reordered", "per-slice"):
        plan_id = cat.conn.execute("SELECT plan_id FROM snapshots WHERE model_id = ?", (f"mp-{name}",)).fetchone()[0]
        again, _ = plan_from_config(cat, parse_config(export_mergekit(cat, plan_id)), save=False)
        assert again.id == plan_id, name


def test_budget_over_slices_reads_only_the_layers_used_and_keeps_the_base_where_omitted(small):
    """slerp over layers 2-3 then 0 (layer 1 unused) at 50 %: the plan reads only the input tensors the
    layout names, realized == planned <= budget, and each output block is the full-budget merge's or,
    where omitted, the base's input tensor."""
    fam, cat, work = small
    from mergepipe.planner.plan import expand_ranges
    from mergepipe.storage.grid import tensor_grid
    from mergepipe.storage.registry import open_checkpoint
    base = str(fam.base)
    slices = [_both(fam, 2, 4), _both(fam, 0, 1)]
    full_cfg = {"slices": slices, "merge_method": "slerp", "base_model": base, "parameters": {"t": 0.4}}
    half_cfg = dict(full_cfg, mergepipe={"budget": "50%"})
    full, _, m_full = api.merge_config(cat, parse_config(yaml.safe_dump(full_cfg)), work / "b-full", model_id="b-full")
    half, _, m = api.merge_config(cat, parse_config(yaml.safe_dump(half_cfg)), work / "b-half", model_id="b-half")
    read = {t for ts in full["access"].values() for t in ts}
    assert read and not any(".layers.1." in t for t in read)
    assert {t[2] for t in half["layout"]["tensors"]} >= read
    assert 0 < half["estimate"]["expert_read"] <= half["budget"]["bytes"] < full["estimate"]["expert_read"]
    assert m.core["realized_by_expert"] == half["expert_read_by_expert"]
    assert m.core["layout"] == half["layout"]
    assert _layers(work / "b-half") == 3
    ref = mergekit_merge(dict(full_cfg, dtype="float32"), work / "b-mk")
    got_full, got_half = load_dir(work / "b-full"), load_dir(work / "b-half")
    _close(got_full, ref)
    inputs = load_dir(fam.base)
    infos = open_checkpoint(fam.base).tensors
    omitted = {t: set(expand_ranges(rs)) for t, rs in half["omitted"].items()}
    kept = merged = 0
    for out, _, name, _ in half["layout"]["tensors"]:
        for span in tensor_grid(infos[name], half["grid"]["block_bytes"]):
            rows = slice(span.row_start, span.row_end)
            if span.index in omitted.get(name, ()):
                assert torch.equal(got_half[out][rows], inputs[name][rows]), (out, span.index)
                kept += 1
            else:
                assert torch.equal(got_half[out][rows], got_full[out][rows]), (out, span.index)
                merged += 1
    assert kept >= 5 and merged >= 5


def test_fresh_paths_are_registered_and_analyzed_for_a_slices_merge(small, tmp_path):
    """A slices config naming unregistered paths (a merging method with a layout, and a passthrough):
    registered, analyzed where the merge needs statistics, and equal to the merge from the shared catalog."""
    fam, cat, work = small
    from mergepipe.catalog.db import Catalog
    fresh = Catalog(tmp_path / "fresh.sqlite")
    try:
        for name in ("reordered", "franken-small"):
            if name == "reordered":
                cfg = {"slices": [{"sources": [_src(fam.base, 2, 4), _src(fam.experts[0], 2, 4, weight=0.3)]},
                                  {"sources": [_src(fam.base, 0, 2), _src(fam.experts[0], 0, 2, weight=[1.5, 0.5])]}],
                       "merge_method": "task_arithmetic", "base_model": str(fam.base), "dtype": "float32"}
            else:
                cfg = {"slices": [{"sources": [_src(fam.experts[1], 0, 3)]}, {"sources": [_src(fam.base, 1, 4)]}],
                       "merge_method": "passthrough", "dtype": "float32"}
                api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / f"mp-{name}", model_id=f"mp-{name}")
            api.merge_config(fresh, parse_config(yaml.safe_dump(cfg)), tmp_path / name, model_id=name)
            a, b = load_dir(tmp_path / name), load_dir(work / f"mp-{name}")
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b), name
        ids = {r[0]: r[1] for r in fresh.conn.execute("SELECT id, base_id FROM models")}
        assert ids["franken-small"] is None and ids["reordered"] is not None
    finally:
        fresh.close()


def test_modules_default_equals_mergekit(small):
    """mergekit's ``modules:`` (a single-module model's module is ``default``): module parameters rank below
    a slice's and above the merge-wide ones; a module condition list falls back to the merge-wide value."""
    fam, cat, work = small
    cfg = {"modules": {"default": {"slices": [_both(fam, 0, 2, t=0.3), _both(fam, 2, 4)],
                                   "parameters": {"t": [{"filter": "mlp", "value": [0.9, 0.2]}]}}},
           "merge_method": "slerp", "base_model": str(fam.base), "parameters": {"t": 0.6}}
    plan, _, got, ref = _merge_both(cat, work, cfg, "modules")
    _close(got, ref)
    t = {c["filter"]: c["value"] for c in plan["params"]["t"]}
    assert t["model.layers.0.mlp.up_proj.weight"] == 0.3
    assert t["model.layers.3.mlp.up_proj.weight"] == pytest.approx(0.2)
    assert t["model.layers.3.self_attn.q_proj.weight"] == 0.6
    models = {"modules": {"default": {"models": [{"model": str(fam.experts[0]), "parameters": {"weight": 0.7}},
                                                 {"model": str(fam.experts[1])}],
                                      "parameters": {"weight": 0.4}}},
              "merge_method": "task_arithmetic", "base_model": str(fam.base)}
    _, _, got, ref = _merge_both(cat, work, models, "modules-models")
    _close(got, ref)


@pytest.mark.parametrize("modules, message", [
    ({"decoder": {"models": [{"model": "x"}], "parameters": {"lambda": 2}}},
     "unsupported parameter `lambda` in modules.decoder.parameters (a slice or source may give weight, density, "
     "t, scale; give the others once under the top-level `parameters:`)"),
    ({"default": {"models": [{"model": "x"}], "slices": []}}, "modules.default needs exactly one of `slices:` or "
                                                               "`models:`"),
])
def test_modules_refusals(modules, message):
    with pytest.raises(ConfigError) as exc:
        parse_config(yaml.safe_dump({"modules": modules, "merge_method": "slerp", "base_model": "b"}), "m.yaml")
    assert str(exc.value) == f"m.yaml: {message}"


def test_passthrough_without_a_layout_and_bad_layouts_are_refused(tiny):
    dtype, fam, cat, work = tiny
    from mergepipe.errors import PlanError
    from mergepipe.planner.context import Planner
    planner = Planner(cat)
    with pytest.raises(PlanError) as exc:
        planner.plan("base", [], "passthrough", save=False)
    assert str(exc.value) == ("passthrough copies the layers a `slices:` config names (mergekit frankenmerges): "
                              "merge from such a config (--config)")
    name = "model.layers.0.mlp.up_proj.weight"
    layout = {"tensors": [[name, "e3", name, None]], "layers": [["e3", 0]]}
    with pytest.raises(PlanError) as exc:
        planner.plan("base", ["e1"], "passthrough", layout=layout, save=False)
    assert str(exc.value) == "the layout takes tensors from e3, which is neither the base nor an expert"
    twice = {"tensors": [[name, "base", name, None], [name.replace(".0.", ".1."), "base", name, None]],
             "layers": [["base", 0], ["base", 0]]}
    with pytest.raises(PlanError) as exc:
        planner.plan("base", ["e1"], "slerp", t=0.5, layout=twice, save=False)
    assert str(exc.value) == f"the layout merges {name} twice: a merge reads each input tensor once"


def test_linear_over_slices_equals_mergekit(small):
    """linear over slices averages every source, the base among them (a soup whose base member is the base,
    weighted per slice like any source): bit-equal to mergekit, reordered layers included."""
    fam, cat, work = small
    base, e1, e2 = fam.base, fam.experts[0], fam.experts[1]
    cfg = {"slices": [{"sources": [_src(base, 2, 4, weight=0.5), _src(e1, 2, 4), _src(e2, 2, 4, weight=0.25)]},
                      {"sources": [_src(base, 0, 2), _src(e1, 0, 2, weight=[0.2, 0.8]), _src(e2, 0, 2)]}],
           "merge_method": "linear", "base_model": str(base), "parameters": {"weight": 1.0}}
    plan, manifest, got, ref = _merge_both(cat, work, cfg, "linear-slices")
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert plan["base_member"]["position"] == 0 and not plan["base_member"]["reference"]
    assert plan["layout"]["layers"] == [["base", 2], ["base", 3], ["base", 0], ["base", 1]]
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    assert _layers(work / "mp-linear-slices") == 4


def test_linear_over_slices_without_base_model_equals_mergekit(small):
    """No base_model: the first source of the first slice is the reference (averaged in with its weight)."""
    fam, cat, work = small
    e1, e2 = fam.experts[0], fam.experts[1]
    cfg = {"slices": [{"sources": [_src(e1, 0, 3, weight=0.7), _src(e2, 0, 3, weight=0.3)]}],
           "merge_method": "linear", "parameters": {"normalize": False}}
    plan, _, got, ref = _merge_both(cat, work, cfg, "linear-slices-ref")
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert plan["base"]["uri"] == str(e1)
    assert plan["base_member"] == {"weight": 0.7, "position": 0, "reference": True}
    assert _layers(work / "mp-linear-slices-ref") == 3
    # under a budget: the bytes read are the plan's, within it, and the error bound applies (additive soup)
    half = dict(cfg, dtype="float32", mergepipe={"budget": "50%"})
    plan, _, manifest = api.merge_config(cat, parse_config(yaml.safe_dump(half)), work / "mp-linear-slices-half",
                                         model_id="mp-linear-slices-half")
    read = manifest.core["realized"]["expert_read"]
    assert read == plan["estimate"]["expert_read"] <= plan["budget"]["bytes"] < plan["full_expert_bytes"]
    assert plan["error_bound"]["absolute"] > 0
    part = load_dir(work / "mp-linear-slices-half")
    dist = sum(float((part[n].double() - got[n].double()).square().sum()) for n in got) ** 0.5
    assert dist <= plan["error_bound"]["absolute"] * (1 + 1e-6)


def test_multi_module_config_is_refused_by_the_cli_and_changes_nothing(small, tmp_path):
    """mergekit's ``modules:`` with modules other than ``default`` over a single-module architecture (mergekit
    has no such module): one ``error:`` line naming the key, no traceback, catalog unchanged (multi-module
    architectures: test_parity_modules.py)."""
    fam, cat, work = small
    path = tmp_path / "mm.yaml"
    path.write_text(yaml.safe_dump({
        "modules": {"text_decoder": {"models": [{"model": str(fam.experts[0])}]},
                    "vision_tower": {"models": [{"model": str(fam.experts[0])}]}},
        "merge_method": "task_arithmetic", "base_model": str(fam.base)}))
    db = work / "cat.sqlite"
    before = catalog_counts(db)
    r = run_cli(["--db", db, "merge", "--config", path, "--out", tmp_path / "out", "--model-id", "mm"])
    assert r.returncode != 0
    assert r.stderr.startswith("error: mm.yaml: modules: the base is a LlamaForCausalLM, which mergekit 0.1.5 has no "
                               "multi-module definition of (modular architectures: Gemma3ForConditionalGeneration, ")
    assert r.stderr.strip().endswith("a single-module model's one module is `default`") and r.stderr.count("\n") == 1
    assert catalog_counts(db) == before and not (tmp_path / "out").exists()
