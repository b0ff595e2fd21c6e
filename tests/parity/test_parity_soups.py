"""Model soups (issue 15, item 3): mergekit's ``linear`` (and ``karcher``) over models without a base_model,
and linear with the base_model listed among the models, against mergekit 0.1.5 (tests/parity/mergekit_runner.py).

MergePipe plans a soup against a reference model (the first model listed, config/soup.py): at full budget
the output is bit-equal to mergekit's (fp32 and bf16 families, fp32 compute: every block goes through
mergekit's operation order); under a budget the omitted blocks of a model are the reference's values
there, the expert bytes read equal the plan's, and the output's distance from the full soup is within the
plan's additive error bound; EXPLAIN names the reference and why. Methods that need a base refuse a config
without one, naming base_model, and leave the catalog unchanged.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe.api import analyze, merge_config
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import model_ids, register
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config
from mergepipe.planner.explain import explain_plan
from mergepipe.research.family import make_family

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge

WEIGHTS = [0.6, 1.3, 0.35]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def soup_fam(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"soup-{request.param}")
    paths = make_family(root / "fam", experts=3, size="tiny", dtype=request.param, shard_bytes=1 << 30, seed=11)
    return {"dtype": request.param, "root": root, "base": paths["base"], "models": paths["experts"]}


def _soup(fam, weights, base: str | None = None, normalize: bool | None = None, models=None) -> dict:
    models = models or fam["models"]
    cfg = {"merge_method": "linear", "dtype": "float32",
           "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)]}
    if base is not None:
        cfg["base_model"] = base
    if normalize is not None:
        cfg["parameters"] = {"normalize": normalize}
    if fam["dtype"] == "bf16":
        cfg["out_dtype"] = "bfloat16"
    return cfg


def _both(fam, cfg: dict, tag: str):
    """Merge ``cfg`` with MergePipe (a fresh catalog) and with mergekit: (plan, manifest, ours, theirs)."""
    out = fam["root"] / tag
    out.mkdir()
    cat = Catalog(out / "c.sqlite")
    try:
        plan, _, manifest = merge_config(cat, parse_config(yaml.safe_dump(cfg)), out / "mp", model_id=tag)
    finally:
        cat.close()
    return plan, manifest, load_dir(out / "mp"), mergekit_merge(cfg, out / "mk")


def _assert_bit_equal(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name]), (name, int((ours[name] != theirs[name]).sum()))


@pytest.mark.parametrize("normalize", [None, False])
def test_soup_without_base_is_bit_equal_to_mergekit(soup_fam, normalize):
    weights = WEIGHTS if normalize is None else [0.3, 0.5, 0.2]
    plan, manifest, ours, theirs = _both(soup_fam, _soup(soup_fam, weights, normalize=normalize),
                                         f"soup-{normalize}")
    _assert_bit_equal(ours, theirs)
    # the first model is the reference (the plan's base), averaged in with its weight
    assert plan["base"]["uri"] == str(soup_fam["models"][0])
    assert plan["base_member"] == {"weight": weights[0], "position": 0, "reference": True}
    assert [e["weight"] for e in plan["experts"]] == weights[1:]
    assert manifest.core["parents"][0] == {"id": plan["base"]["id"], "role": "reference", "weight": weights[0]}


def test_soup_with_gradient_weights_is_bit_equal_to_mergekit(soup_fam):
    weights = [[0.2, 1.0], 0.7, [{"filter": "mlp", "value": 0.1}, {"value": 0.9}]]
    plan, _, ours, theirs = _both(soup_fam, _soup(soup_fam, weights), "soup-gradient")
    _assert_bit_equal(ours, theirs)
    assert plan["base_member"]["weight"] is None and plan["base_member"]["settings"] == {"weight": [0.2, 1.0]}


def test_base_listed_among_the_models_is_averaged_in_at_its_position(soup_fam):
    """mergekit's linear ignores base_model unless it is listed: then it is averaged in, in list order."""
    models = [soup_fam["models"][0], soup_fam["base"], soup_fam["models"][1]]
    cfg = _soup(soup_fam, WEIGHTS, base=soup_fam["base"], models=models)
    plan, manifest, ours, theirs = _both(soup_fam, cfg, "soup-listed-base")
    _assert_bit_equal(ours, theirs)
    assert plan["base_member"] == {"weight": WEIGHTS[1], "position": 1, "reference": False}
    assert manifest.core["parents"][0]["role"] == "base"


def test_soup_under_a_budget_reads_the_plan_and_stays_within_the_bound(soup_fam, tmp_path):
    fam = soup_fam
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        register(cat, "ref", fam["models"][0])
        for i, m in enumerate(fam["models"][1:], start=2):
            register(cat, f"m{i}", m, base_id="ref")
        analyze(cat, block_bytes=4096)
        cfg = _soup(fam, WEIGHTS)
        full_plan, _, full_manifest = merge_config(cat, parse_config(yaml.safe_dump(cfg)), tmp_path / "full",
                                                   model_id="full")
        cfg["mergepipe"] = {"budget": "40%"}
        plan, _, manifest = merge_config(cat, parse_config(yaml.safe_dump(cfg)), tmp_path / "part", model_id="part")
        text = explain_plan(plan.data)
    finally:
        cat.close()
    assert plan["base"]["id"] == "ref" and [e["id"] for e in plan["experts"]] == ["m2", "m3"]
    read = manifest.core["realized"]["expert_read"]
    assert read == plan["estimate"]["expert_read"] <= 0.4 * plan["full_expert_bytes"]
    assert full_manifest.core["realized"]["expert_read"] == full_plan["full_expert_bytes"] > read
    # independent reference: each block the sum of w_i x_i over the models (x_i = the reference's values where
    # the plan does not read model i's block) divided by the sum of the weights, in float64
    models = [load_dir(m) for m in fam["models"]]
    ours, full = load_dir(tmp_path / "part"), load_dir(tmp_path / "full")
    worst = 0.0
    diff_sq = 0.0
    for name, ref in models[0].items():
        rows = ref.shape[0]
        row_bytes = ref[0].numel() * ref.element_size() if ref.dim() > 1 else ref.element_size()
        per_block = max(1, 4096 // row_bytes) if ref.dim() > 1 else 4096 // ref.element_size()
        expect = WEIGHTS[0] * ref.double()
        for (eid, x), w in zip(zip(("m2", "m3"), models[1:]), WEIGHTS[1:]):
            xs = ref.double().clone()
            for a, b in plan["access"][eid].get(name, []):
                lo, hi = a * per_block, min(rows, b * per_block)
                xs[lo:hi] = x[name].double()[lo:hi]
            expect += w * xs
        expect /= sum(WEIGHTS)
        scale = expect.abs().max().item() or 1.0
        worst = max(worst, (ours[name].double() - expect).abs().max().item() / scale)
        diff_sq += float(((full[name].float().double() - ours[name].double()) ** 2).sum())
    assert worst <= (1e-6 if fam["dtype"] == "fp32" else 8e-3), worst
    assert diff_sq ** 0.5 <= plan["error_bound"]["absolute"] * (1 + 1e-6) + (0 if fam["dtype"] == "fp32" else 1.0)
    assert plan["error_bound"]["absolute"] > 0
    assert "soup       ref is averaged in with weight 0.6 (model 1 of the soup); it is the reference model" in text
    assert "took the first model listed" in text


def test_karcher_without_base_averages_the_models_like_mergekit(soup_fam):
    """mergekit's karcher ignores base_model: without one it averages the models listed. MergePipe plans it
    against the first model (the reference), which its karcher averages in like the others: the same group.
    Within karcher's float32-iteration tolerance (README: the coefficients are iterated in float64 here)."""
    cfg = _soup(soup_fam, [None] * 3)
    for m in cfg["models"]:
        del m["parameters"]
    cfg["merge_method"] = "karcher"
    plan, manifest, ours, theirs = _both(soup_fam, cfg, "karcher-soup")
    assert plan["base"]["uri"] == str(soup_fam["models"][0]) and len(plan["experts"]) == 2
    assert plan["base_member"] == {"weight": 1.0, "position": 0, "reference": True}
    assert set(ours) == set(theirs)
    for name in ours:
        scale = float(theirs[name].float().abs().max())
        worst = float((ours[name].float() - theirs[name].float()).abs().max())
        assert worst <= (1e-3 if soup_fam["dtype"] == "fp32" else 2 ** -7) * scale, (name, worst / scale)


@pytest.mark.parametrize("method, extra", [("ties", ""), ("task_arithmetic", ""), ("model_stock", "")])
def test_methods_that_need_a_base_refuse_a_config_without_one(soup_fam, tmp_path, method, extra):
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        register(cat, "ref", soup_fam["models"][0])
        before = model_ids(cat)
        cfg = _soup(soup_fam, WEIGHTS)
        cfg["merge_method"] = method
        with pytest.raises(ConfigError) as err:
            plan_from_config(cat, parse_config(yaml.safe_dump(cfg), source="soup.yaml"))
        assert str(err.value) == (f"soup.yaml: `base_model` is required by {method}: MergePipe stores experts as "
                                  f"deltas against their base{extra}")
        assert model_ids(cat) == before
    finally:
        cat.close()


def test_a_soup_of_one_model_is_refused(soup_fam, tmp_path):
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        cfg = _soup(soup_fam, [1.0], models=soup_fam["models"][:1])
        with pytest.raises(ConfigError, match="lists one model: a soup without base_model averages two or more"):
            plan_from_config(cat, parse_config(yaml.safe_dump(cfg), source="one.yaml"))
        assert model_ids(cat) == set()
    finally:
        cat.close()


def test_a_soup_plan_exports_to_the_mergekit_yaml_it_came_from(soup_fam, tmp_path):
    """explain --as-mergekit of a soup writes no base_model and the reference first, with its weight; merging
    that YAML gives the same plan digest."""
    from mergepipe.config.export import export_plan_data
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        cfg = _soup(soup_fam, [[0.2, 1.0], 0.7, 0.35])
        plan, _ = plan_from_config(cat, parse_config(yaml.safe_dump(cfg)))
        text = export_plan_data(cat, plan.data)
        doc = yaml.safe_load(text)
        assert "base_model" not in doc and "tokenizer_source" not in doc
        assert doc["models"][0] == {"model": str(soup_fam["models"][0]), "parameters": {"weight": [0.2, 1.0]}}
        assert [m["parameters"]["weight"] for m in doc["models"]] == [[0.2, 1.0], 0.7, 0.35]
        again, _ = plan_from_config(cat, parse_config(text))
        assert again.digest == plan.digest
    finally:
        cat.close()


def test_a_soup_config_run_with_a_method_that_needs_a_base_is_refused(soup_fam, tmp_path):
    """--op ties over a config without base_model: refused naming base_model (the first model is not taken as a
    base behind the user's back), catalog unchanged."""
    cat = Catalog(tmp_path / "c.sqlite")
    try:
        cfg = parse_config(yaml.safe_dump(_soup(soup_fam, WEIGHTS)), source="soup.yaml").with_overrides(operator="ties")
        with pytest.raises(ConfigError, match=r"^soup\.yaml: `base_model` is required by ties"):
            plan_from_config(cat, cfg)
        assert model_ids(cat) == set()
    finally:
        cat.close()
