"""mergekit ``modules:`` over a multi-module (modular) architecture against mergekit 0.1.5 at full budget.

The family is built here: Qwen2.5-VL-shaped checkpoints (config.json ``Qwen2_5_VLForConditionalGeneration``,
the tensor names of mergekit's qwen2_5_vl.json: a text decoder ``model.layers.N``, a vision tower
``visual.blocks.N``, a projector ``visual.merger``), tiny fp32 shapes, a base and two experts. mergekit merges
each module with its own models' parameters (a model's, the slice's, the module's, the merge-wide ones), t
over the module's own layers; MergePipe plans the same as per-tensor settings (config/modules.py).
Everything here is bit-equal in fp32. Refusals: one message, one ``error:`` line, catalog unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe import api
from mergepipe.config.architectures import MODULAR
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config
from mergepipe.research.family import _write_tokenizer

from merge_helpers import assert_config_refused, catalog_counts, load_dir
from mergekit_runner import config_merge_both, mergekit_merge

ARCH = "Qwen2_5_VLForConditionalGeneration"
H, V, I, VH, VI = 32, 64, 48, 32, 48  # text hidden, vocab, text MLP; vision hidden, vision MLP
LAYERS = {"text_decoder": 2, "vision_tower": 3, "multi_modal_projector": 2}


def _shape(n: str) -> tuple:
    if "embed_tokens" in n or "lm_head" in n:
        return (V, H)
    if n.startswith("visual.patch_embed"):
        return (VH, 3, 2, 2, 2)
    if n.startswith("visual.merger"):
        return {"ln_q.weight": (VH,), "mlp.0.weight": (4 * VH, 4 * VH), "mlp.0.bias": (4 * VH,),
                "mlp.2.weight": (H, 4 * VH), "mlp.2.bias": (H,)}[n[len("visual.merger."):]]
    if n.startswith("visual.blocks"):
        for key, shape in (("qkv.weight", (3 * VH, VH)), ("qkv.bias", (3 * VH,)), ("attn.proj.weight", (VH, VH)),
                           ("down_proj.weight", (VH, VI)), ("proj.weight", (VI, VH)), ("down_proj.bias", (VH,)),
                           ("proj.bias", (VI,))):
            if n.endswith(key) and not (key == "proj.bias" and "attn" in n):
                return shape
        return (VH,)
    for key, shape in (("k_proj.weight", (8, H)), ("v_proj.weight", (8, H)), ("k_proj.bias", (8,)),
                       ("v_proj.bias", (8,)), ("q_proj.bias", (H,)), ("down_proj", (H, I)), ("up_proj", (I, H)),
                       ("gate_proj", (I, H)), ("norm", (H,))):
        if key in n:
            return shape
    return (H, H)


def _names() -> list[str]:
    """Every tensor mergekit's qwen2_5_vl definition lists, at LAYERS layers per module."""
    out = []
    for module, spec in MODULAR[ARCH][0]["modules"].items():
        names = list(spec["pre"])
        for i in range(LAYERS[module]):
            names += [t.replace("${layer_index}", str(i)) for t in spec["layer"]]
        names += spec["post"]
        out += [n.rstrip("?") for n in names if n.rstrip("?") not in out]
    return out


def _write(root, seed: int, base=None, extra=()):
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for n in [*_names(), *extra]:
        x = torch.randn(_shape(n), generator=g)
        tensors[n] = x if base is None else base[n] + 0.05 * x
    save_file(tensors, str(root / "model.safetensors"))
    config = {"architectures": [ARCH], "model_type": "qwen2_5_vl", "torch_dtype": "float32", "vocab_size": V,
              "bos_token_id": 1, "eos_token_id": 2,
              "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": H, "intermediate_size": I,
                              "num_hidden_layers": LAYERS["text_decoder"], "num_attention_heads": 4,
                              "num_key_value_heads": 1, "vocab_size": V, "bos_token_id": 1, "eos_token_id": 2},
              "vision_config": {"model_type": "qwen2_5_vl", "depth": LAYERS["vision_tower"], "hidden_size": VH,
                                "intermediate_size": VI, "num_heads": 4, "out_hidden_size": H}}
    (root / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(root, V)  # export writes tokenizer_source: base
    return tensors


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register
    root = tmp_path_factory.mktemp("modules")
    base = _write(root / "base", 0)
    for i in (1, 2):
        _write(root / f"e{i}", i, base)
    _write(root / "odd", 3, extra=("visual.extra.weight",))  # a tensor in no module
    cat = Catalog(root / "cat.sqlite")
    register(cat, "base", root / "base")
    for i in (1, 2):
        register(cat, f"e{i}", root / f"e{i}", base_id="base")
    api.analyze(cat, block_bytes=4096)
    yield root, cat
    cat.close()


def _p(root, name):
    return str(root / name)


def _models(root, *entries):
    """A module's ``models:`` ([(name, parameters or None), ...])."""
    return [{"model": _p(root, n), **({"parameters": p} if p else {})} for n, p in entries]


def _merge_both(vl, cfg, name):
    root, cat = vl
    return config_merge_both(cat, root, dict(cfg, dtype="float32"), name)


def _equal(got, ref):
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and torch.equal(got[name], ref[name]), name


def _weights(plan, expert):
    setting = next(e for e in plan["experts"] if e["id"] == expert)["settings"]["weight"]
    return {c["filter"]: c["value"] for c in setting} if isinstance(setting, list) else setting


def ta_config(root, **ext):
    """task_arithmetic, each module its own weights: a model's own (a gradient over the text decoder's layers,
    a filter in the vision tower falling back to the module's), the module's, the merge-wide ones."""
    return {"merge_method": "task_arithmetic", "base_model": _p(root, "base"), "parameters": {"weight": 0.6},
            "modules": {
                "text_decoder": {"models": _models(root, ("e1", {"weight": [0.2, 0.8]}), ("e2", None)),
                                 "parameters": {"weight": 0.7}},
                "vision_tower": {"models": _models(root, ("e1", None),
                                                   ("e2", {"weight": [{"filter": "attn", "value": 0.1}]})),
                                 "parameters": {"weight": 0.5}},
                "multi_modal_projector": {"models": _models(root, ("e1", {"weight": {"filter": "ln_q", "value": 0.2}}),
                                                            ("e2", None)),
                                          "parameters": {"weight": 0.9}}},
            **({"mergepipe": ext} if ext else {})}


def test_task_arithmetic_with_per_module_weights_is_bit_equal_to_mergekit(vl):
    root, _ = vl
    plan, manifest, got, ref = _merge_both(vl, ta_config(root), "ta")
    _equal(got, ref)
    assert "layout" not in plan.data  # the base's tensors in place: a plain merge with per-tensor weights
    w1, w2 = _weights(plan, "e1"), _weights(plan, "e2")
    # the text decoder's gradient over its 2 layers (t = 0 before them and after them), the vision tower's
    # own filter then the module's 0.5; the projector's: e1's own filter on ln_q, else the module's 0.9
    assert w1["model.embed_tokens.weight"] == w1["lm_head.weight"] == w1["model.layers.0.mlp.up_proj.weight"] == 0.2
    assert w1["model.layers.1.mlp.up_proj.weight"] == pytest.approx(0.8)
    assert w2["model.layers.1.mlp.up_proj.weight"] == 0.7 and w2["visual.blocks.2.attn.qkv.weight"] == 0.1
    assert w2["visual.blocks.2.mlp.up_proj.weight"] == w1["visual.patch_embed.proj.weight"] == 0.5
    assert w1["visual.merger.ln_q.weight"] == 0.2 and w1["visual.merger.mlp.0.weight"] == 0.9 == w2["visual.merger.ln_q.weight"]
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    assert json.loads((root / "mp-ta" / "config.json").read_text()) == json.loads(
        (root / "base" / "config.json").read_text())


def test_linear_with_per_module_weights_is_bit_equal_to_mergekit(vl):
    """linear averages the base too: mergekit appends it to each module's models (weighted by the module's
    parameters); MergePipe averages it in at that place (a soup member, config/soup.py)."""
    root, _ = vl
    cfg = {"merge_method": "linear", "base_model": _p(root, "base"), "modules": {
        "text_decoder": {"models": _models(root, ("e1", {"weight": 0.3}), ("e2", None)),
                         "parameters": {"weight": 0.5}},
        "multi_modal_projector": {"models": _models(root, ("e1", None), ("e2", {"weight": 3.0})),
                                  "parameters": {"weight": 2.0}},
        "vision_tower": {"models": _models(root, ("e1", None), ("e2", None)), "parameters": {"weight": 1.0}}}}
    plan, _, got, ref = _merge_both(vl, cfg, "linear")
    _equal(got, ref)
    member = plan["base_member"]
    assert member["position"] == 2 and not member["reference"]
    weights = {c["filter"]: c["value"] for c in member["settings"]["weight"]}
    assert weights["model.norm.weight"] == 0.5 and weights["visual.blocks.0.norm1.weight"] == 1.0
    assert weights["visual.merger.mlp.2.bias"] == 2.0


def test_in_place_slices_per_module_are_bit_equal_to_mergekit(vl):
    """A module given as slices (mergekit's modules.X.slices): two slices over the text decoder's layers with
    their own parameters (the embeddings take the first slice's, the final norm and lm_head the last one's),
    the vision tower one slice with a per-source gradient over its 3 layers."""
    root, _ = vl
    base, e1, e2 = (_p(root, n) for n in ("base", "e1", "e2"))

    def sl(start, end, params=None, **own):
        s = {"sources": [{"model": base, "layer_range": [start, end]},
                         {"model": e1, "layer_range": [start, end], **({"parameters": own} if own else {})},
                         {"model": e2, "layer_range": [start, end]}]}
        return dict(s, parameters=params) if params else s

    cfg = {"merge_method": "task_arithmetic", "base_model": base, "parameters": {"weight": 1.0}, "modules": {
        "text_decoder": {"slices": [sl(0, 1, {"weight": 0.25}), sl(1, 2, {"weight": 0.75}, weight=1.5)]},
        "vision_tower": {"slices": [sl(0, 3, weight=[0.0, 1.0])], "parameters": {"weight": 0.4}},
        "multi_modal_projector": {"models": _models(root, ("e1", None), ("e2", None))}}}
    plan, _, got, ref = _merge_both(vl, cfg, "slices")
    _equal(got, ref)
    w1, w2 = _weights(plan, "e1"), _weights(plan, "e2")
    assert w1["model.embed_tokens.weight"] == 0.25 and w1["lm_head.weight"] == 1.5 == w1["model.layers.1.mlp.up_proj.weight"]
    assert w2["model.layers.1.mlp.up_proj.weight"] == 0.75 and w2["visual.blocks.2.mlp.up_proj.weight"] == 0.4
    assert w1["visual.blocks.1.mlp.up_proj.weight"] == pytest.approx(0.5)
    assert w1["visual.merger.mlp.0.weight"] == 1.0


def test_budgeted_module_merge_reads_what_the_plan_says(vl):
    """Under 50 %: the bytes read from each expert are the plan's, within the budget, and the output is within
    the plan's error bound of the full-budget merge (task arithmetic is additive)."""
    root, cat = vl
    cfg = dict(ta_config(root, budget="50%"), dtype="float32")
    plan, _, manifest = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), root / "mp-ta-half",
                                         model_id="mp-ta-half")
    read = manifest.core["realized"]["expert_read"]
    assert 0 < read == plan["estimate"]["expert_read"] <= plan["budget"]["bytes"] < plan["full_expert_bytes"]
    assert manifest.core["realized_by_expert"] == plan["expert_read_by_expert"]
    full = load_dir(root / "mk-ta") if (root / "mk-ta").exists() else None
    if full is None:
        full = mergekit_merge({k: v for k, v in dict(ta_config(root), dtype="float32").items()}, root / "mk-ta")
    part = load_dir(root / "mp-ta-half")
    dist = sum(float((part[n].double() - full[n].double()).square().sum()) for n in full) ** 0.5
    assert 0 < dist <= plan["error_bound"]["absolute"] * (1 + 1e-6)


def test_module_plan_exports_as_mergekit_and_round_trips(vl):
    """``explain --as-mergekit`` writes the per-module settings as per-tensor ones (a top-level `models:`):
    MergePipe plans it to the same digest and mergekit merges it to the same bytes."""
    root, cat = vl
    from mergepipe.config.export import export_mergekit
    from mergepipe.config.resolve import plan_from_config
    cfg = dict(ta_config(root), dtype="float32")
    plan, _ = plan_from_config(cat, parse_config(yaml.safe_dump(cfg)), save=True)
    text = export_mergekit(cat, plan.id)
    assert "models:" in text and "modules:" not in text
    again, _ = plan_from_config(cat, parse_config(text), save=False)
    assert again.id == plan.id
    doc = yaml.safe_load(text)
    doc.pop("mergepipe")
    ref = mergekit_merge(doc, root / "mk-export")
    api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), root / "mp-export", model_id="mp-export")
    _equal(load_dir(root / "mp-export"), ref)


def _three(root, *, text=("e1", "e2"), vision=("e1", "e2"), projector=("e1", "e2"), **more):
    mods = {"text_decoder": {"models": _models(root, *((n, None) for n in text))},
            "vision_tower": {"models": _models(root, *((n, None) for n in vision))},
            "multi_modal_projector": {"models": _models(root, *((n, None) for n in projector))}}
    mods.update(more)
    return {k: v for k, v in mods.items() if v is not None}


MODULES = "text_decoder, multi_modal_projector, vision_tower"
REFUSALS = [
    (lambda r: _three(r, audio_tower={"models": _models(r, ("e1", None), ("e2", None))}),
     f"modules.audio_tower: {ARCH} has no module audio_tower (mergekit 0.1.5's modules of {ARCH}: {MODULES})"),
    # (the YAML written sorts the modules: multi_modal_projector, text_decoder, vision_tower)
    (lambda r: _three(r, vision=("e1",)),
     "modules.vision_tower.models does not merge {e2}, which modules.multi_modal_projector.models does: MergePipe "
     "merges "
     "the same models, in the same order, in every module (give a model weight 0 where it should not count)"),
    (lambda r: _three(r, projector=("e2", "e1")),
     "modules.text_decoder.models lists the models of modules.multi_modal_projector.models in another order: "
     "MergePipe merges the same models, in the same order, in every module (give a model weight 0 where it "
     "should not count)"),
    (lambda r: _three(r, multi_modal_projector={"models": _models(r, ("e1", None), ("e2", None)),
                                                "parameters": {"weight": [0.2, 0.9]}}),
     "mergekit plans visual.merger.mlp.0.weight 2 times (modules.multi_modal_projector at t = 0, "
     "modules.multi_modal_projector at t = 1) with different values of {e1}'s weight (0.2, 0.9); which one it "
     "writes depends on its task order: give a value that does not vary there"),
    (lambda r: _three(r, vision_tower=None),
     f"modules: vision_tower of {ARCH} not listed: mergekit writes no tensor of a module the config omits; list "
     f"every module ({MODULES})"),
    (lambda r: _three(r, text_decoder={"slices": [
        {"sources": [{"model": _p(r, n), "layer_range": [1, 2]} for n in ("base", "e1", "e2")]}]}),
     "modules.text_decoder.slices[0]: MergePipe merges a module's slices in place (every source with the same "
     "layer_range, the slices covering the module's layers from 0 in order: this one would start at layer 0); "
     "re-ordered, repeated or offset layers are merged through `slices:` of a single-module model"),
    (lambda r: _three(r, text_decoder={"slices": [
        {"sources": [{"model": _p(r, n), "layer_range": [0, 1]} for n in ("base", "e1", "e2")]}]}),
     "modules.text_decoder: the slices cover layers 0-0, module text_decoder of the base has 2 (0-1): MergePipe "
     "merges every layer of a module in place"),
]


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_module_refusals_are_one_line_and_change_nothing(vl, tmp_path, case):
    root, cat = vl
    make, message = REFUSALS[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": _p(root, "base"),
                                    "modules": make(root)}))
    db = root / "cat.sqlite"
    expected = f"bad.yaml: {message.format(e1=_p(root, 'e1'), e2=_p(root, 'e2'))}"
    assert_config_refused(cat, db, path, tmp_path, expected)


def test_a_base_tensor_in_no_module_is_refused(vl, tmp_path):
    """mergekit writes only the tensors its definition lists: a base with another tensor is refused (the
    checkpoint mergekit would write lacks it), catalog unchanged."""
    root, cat = vl
    cfg = {"merge_method": "task_arithmetic", "base_model": _p(root, "odd"),
           "modules": _three(root)}
    db = root / "cat.sqlite"
    before = catalog_counts(db)
    with pytest.raises(ConfigError) as exc:
        api.merge_config(cat, parse_config(yaml.safe_dump(cfg), "odd.yaml"), tmp_path / "out", model_id="odd-out")
    assert str(exc.value) == (f"odd.yaml: modules: 1 tensor(s) of the base are in no module of mergekit 0.1.5's "
                              f"{ARCH} (first: visual.extra.weight): mergekit would not write them")
    assert catalog_counts(db) == before


def test_parse_time_module_refusals():
    def parse(modules, **top):
        return parse_config(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "b",
                                            "modules": modules, **top}), "m.yaml")
    with pytest.raises(ConfigError, match=r"^m.yaml: unsupported parameter `lambda` in modules.vision_tower.parameters"):
        parse({"vision_tower": {"models": ["x"], "parameters": {"lambda": 0.5}}})
    with pytest.raises(ConfigError, match=r"^m.yaml: modules.vision_tower needs exactly one of `slices:` or `models:`$"):
        parse({"vision_tower": {"parameters": {}}})
    with pytest.raises(ConfigError, match=r"^m.yaml: modules: passthrough over the modules of a multi-module model"):
        parse_config(yaml.safe_dump({"merge_method": "passthrough", "modules": {"vision_tower": {"models": ["x"]}}}),
                     "m.yaml")
    with pytest.raises(ConfigError, match=r"^m.yaml: weights and densities are given per module"):
        parse({"vision_tower": {"models": ["x"]}}).with_overrides(weights=[1.0])
