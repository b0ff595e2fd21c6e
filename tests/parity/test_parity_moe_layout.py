"""MoE output layout (issue 32, part 4) against mergekit 0.1.5, on tiny fp32 Mixtral and Qwen3-MoE families in the
per-expert layout of most Hub checkpoints (4 experts of 48x32 per layer, 2 layers, 2 fine-tuned models).

mergekit 0.1.5 loads those through transformers v5's conversion and writes the fused layout
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I], Mixtral's router as
``mlp.gate.weight``). MergePipe writes the same by default (``moe_layout: fused``), or the base's per-expert
names with ``mergepipe: {moe_layout: per-expert}``. Asserted:

* fused (default): the same tensor names, shapes and dtypes as mergekit's output; linear and task arithmetic
  within 4 float32 ulps of each tensor's largest value (the summation order, as test_parity_existing);
* per-expert: the base's names; mergekit's fused tensors split back per expert within the same tolerance;
* TIES: the tensors outside the experts as above; the fused expert tensors differ where the top-k threshold
  does: MergePipe takes it per expert matrix (its catalog statistics), mergekit over the fused stack of all
  experts (measured, printed with ``-s``, bounded here);
* a 50 % budget reads exactly its plan, and the fused output is the per-expert output of the same plan fused;
* the fused output loads with transformers (MixtralForCausalLM / Qwen3MoeForCausalLM)."""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe.api import merge_config
from mergepipe.catalog.db import Catalog
from mergepipe.config.parse import parse_config

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge
from moe_helpers import ARCHS, make_moe_family, per_expert_view

EPS32 = 2.0 ** -23
WEIGHTS = [0.6, 0.4]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def fam(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"moe-{request.param}")
    paths = make_moe_family(root / "fam", request.param, dtype="float32")
    cat = Catalog(root / "c.sqlite")
    yield {"type": request.param, "root": root, "cat": cat, "n": 0, **paths}
    cat.close()


def _config(fam, method: str, layout: str | None = None, budget: str | None = None, for_mergekit=False) -> dict:
    models = [{"model": e, "parameters": {"weight": w, **({"density": 0.5} if method == "ties" else {})}}
              for e, w in zip(fam["experts"], WEIGHTS)]
    cfg = {"merge_method": method, "base_model": fam["base"], "models": models, "dtype": "float32"}
    ext = {k: v for k, v in (("moe_layout", layout), ("budget", budget)) if v}
    if ext and not for_mergekit:
        cfg["mergepipe"] = ext
    if for_mergekit and method == "linear":
        del cfg["base_model"]  # mergekit's linear averages the models listed
    return cfg


def _merge(fam, method, layout=None, budget=None):
    fam["n"] += 1
    out = fam["root"] / f"mp-{fam['n']}"
    plan, _, manifest = merge_config(fam["cat"], parse_config(yaml.safe_dump(_config(fam, method, layout, budget))),
                                     out, model_id=f"mp-{fam['n']}")
    return plan, manifest, load_dir(out), out


def _mergekit(fam, method):
    fam["n"] += 1
    return mergekit_merge(_config(fam, method, for_mergekit=True), fam["root"] / f"mk-{fam['n']}")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (EPS32 * float(b.abs().max()))


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
def test_fused_by_default_as_mergekit_writes(fam, method):
    plan, manifest, got, out = _merge(fam, method)
    ref = _mergekit(fam, method)
    assert plan.moe_layout == {"layout": "fused", "architecture": ARCHS[fam["type"]]}
    assert sorted(got) == sorted(ref)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in got)
    for name in ref:
        assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype, name
        assert _ulps(got[name], ref[name]) <= 4, name
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    assert "experts written fused as transformers v5 and mergekit 0.1.5 write" in plan.explain()
    assert fam["cat"].model(f"mp-{fam['n'] - 1}")["base_id"] is None  # other names than the base: its own model


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
def test_per_expert_layout_keeps_the_base_names(fam, method):
    plan, _, got, _ = _merge(fam, method, layout="per-expert")
    ref = per_expert_view(_mergekit(fam, method), fam["type"])
    base = load_dir(fam["base"])
    assert plan.moe_layout["layout"] == "per-expert" and sorted(got) == sorted(base) == sorted(ref)
    for name in ref:
        assert _ulps(got[name], ref[name]) <= 4, name
    assert "experts written per expert" in plan.explain()


def test_ties_fused_differs_only_where_the_threshold_is_taken_over_the_stack(fam):
    plan, _, got, _ = _merge(fam, "ties")
    ref = _mergekit(fam, "ties")
    assert sorted(got) == sorted(ref)
    fused = [n for n in ref if ".mlp.experts." in n]
    for name in ref:
        if name not in fused:
            assert _ulps(got[name], ref[name]) <= 4, name
    differ = sum(int((got[n] != ref[n]).sum()) for n in fused) / sum(ref[n].numel() for n in fused)
    print(f"\n{fam['type']} ties, fused expert tensors: {differ:.2%} of entries differ from mergekit's")
    assert differ < 0.10


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_half_budget_reads_its_plan_and_fusing_changes_only_names(fam, method):
    plan, manifest, got, _ = _merge(fam, method, budget="50%")
    per, per_manifest, per_got, _ = _merge(fam, method, layout="per-expert", budget="50%")
    assert plan["access"] == per["access"] and plan.digest != per.digest
    realized = manifest.core["realized"]["expert_read"]
    assert realized == plan["estimate"]["expert_read"] == per_manifest.core["realized"]["expert_read"]
    assert 0 < realized <= plan["budget"]["bytes"] < plan["full_expert_bytes"]
    split = per_expert_view(got, fam["type"])
    assert sorted(split) == sorted(per_got) and all(torch.equal(split[n], per_got[n]) for n in per_got)


def test_fused_output_loads_with_transformers(fam):
    import transformers

    _, _, got, out = _merge(fam, "linear")
    model = getattr(transformers, ARCHS[fam["type"]]).from_pretrained(str(out))
    state = model.state_dict()
    for name, t in got.items():
        assert torch.equal(state[name], t), name
