"""Writing the float tensors in another dtype than the base's (issue 32, part 3): the plan records the
conversion (its digest, output bytes and EXPLAIN), the engine rounds each output block once from float32 (fused
kernels and torch path alike, merged and copied blocks alike), the shard layout holds the new sizes, and what
cannot follow is refused in one line (an incremental merge of a converted snapshot, a copy overflowing fp16)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.engine.engine import Engine
from mergepipe.engine.memory import merge_in_memory
from mergepipe.errors import ExecutionError, PlanError
from mergepipe.research.family import make_family

from merge_helpers import load_dir

NAMES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def family(root, dtype: str):
    paths = make_family(root / "fam", experts=2, size="tiny", dtype=dtype, shard_bytes=1 << 30, seed=3)
    cat = Catalog(root / "c.sqlite")
    register(cat, "base", paths["base"])
    for i, e in enumerate(paths["experts"], start=1):
        register(cat, f"e{i}", e, base_id="base")
    api.analyze(cat, block_bytes=4096, densities=(0.5,))
    return cat, paths


def request(out_dtype=None, op="ties", **kw):
    return api.merge_request("base", ["e1", "e2"], op, weights=[0.7, 0.5], density=0.5 if op == "ties" else None,
                             out_dtype=out_dtype, **kw)


@pytest.mark.parametrize("dtype,out", [("fp16", "BF16"), ("fp16", "F32"), ("bf16", "F32"), ("fp32", "BF16"),
                                       ("bf16", "F16")])
@pytest.mark.parametrize("op", ["ties", "linear"])
def test_converted_output_is_the_float32_merge_rounded_once(tmp_path, dtype, out, op):
    cat, paths = family(tmp_path, dtype)
    wide = api.plan(cat, request("F32" if dtype != "fp32" else None, op, budget="60%"), save=False)
    Engine(cat).execute(wide, out=tmp_path / "wide")
    results = {}
    for fused in (True, False):  # the fused kernels (bf16/fp32 in and out) and the torch path agree
        plan = api.plan(cat, request(out, op, budget="60%"), save=False)
        assert plan["access"] == wide["access"]
        manifest = Engine(cat, fused=fused).execute(plan, out=tmp_path / f"out-{fused}", model_id=f"m{fused}")[1]
        assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
        assert manifest.core["out_dtype"] == out
        results[fused] = load_dir(tmp_path / f"out-{fused}")
    full = load_dir(tmp_path / "wide")
    for name, t in full.items():
        assert results[True][name].dtype == NAMES[out]
        assert torch.equal(results[True][name], t.float().to(NAMES[out])), name
        assert torch.equal(results[False][name], results[True][name]), name
    assert plan["estimate"]["output_write"] == sum(v.numel() * v.element_size() for v in results[True].values())
    config = json.loads((tmp_path / "out-True" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == str(NAMES[out]).removeprefix("torch.")
    assert cat.model("mTrue")["base_id"] is None  # another dtype: not an expert of the base


def test_digest_unchanged_without_a_conversion_and_recorded_with_one(tmp_path):
    cat, _ = family(tmp_path, "bf16")
    plain = api.plan(cat, request(), save=False)
    same = api.plan(cat, request("BF16"), save=False)  # the base's own dtype: nothing converts
    assert same.id == plain.id and same.out_dtype is None and "conversion" not in same.data
    other = api.plan(cat, request("F32"), save=False)
    assert other.id != plain.id and other.out_dtype == "F32"
    assert other["estimate"]["output_write"] == 2 * plain["estimate"]["output_write"]
    assert other["conversion"] == {"from": ["BF16"], "to": "F32", "bytes": other["estimate"]["output_write"],
                                   "bytes_unconverted": plain["estimate"]["output_write"]}
    assert other["blocks_total"] == plain["blocks_total"]  # the grid is the base's, whatever is written
    text = other.explain()
    assert "dtype      float tensors written in F32 (the base's: BF16)" in text and "instead of" in text
    assert "float tensors written" not in plain.explain()
    with pytest.raises(PlanError, match="unknown output dtype 'I8'"):
        request("I8")


def test_in_memory_merge_returns_the_output_dtype(tmp_path):
    cat, _ = family(tmp_path, "bf16")
    plan = api.plan(cat, request("F16"), save=False)
    got = merge_in_memory(cat, plan).tensors
    Engine(cat).execute(plan, out=tmp_path / "out")
    files = load_dir(tmp_path / "out")
    assert all(got[n].dtype == torch.float16 and torch.equal(got[n], files[n]) for n in files)


def test_incremental_merge_of_a_converted_snapshot_is_refused(tmp_path):
    cat, _ = family(tmp_path, "bf16")
    api.run(cat, api.merge_request("base", ["e1"], "linear", out_dtype="F32"), out=tmp_path / "out", model_id="m")
    assert "out_dtype: float32" in (tmp_path / "out" / "README.md").read_text()  # the card's recipe
    with pytest.raises(PlanError, match="was written in F32, not its base's dtype"):
        api.plan_extend(cat, api.extend_request("m", "add", "e2", weight=0.5, out=tmp_path / "o2"))


def test_a_copied_block_overflowing_fp16_is_refused(tmp_path):
    cat, paths = family(tmp_path, "bf16")
    base = load_file(f"{paths['base']}/model.safetensors")
    name = sorted(base)[0]
    base[name] = base[name].clone()
    base[name].view(-1)[0] = 1e6  # beyond fp16's largest number (65504)
    save_file(base, f"{paths['base']}/model.safetensors", metadata={"format": "pt"})
    cat2 = Catalog(tmp_path / "c2.sqlite")
    register(cat2, "base", paths["base"])
    register(cat2, "e1", paths["experts"][0], base_id="base")
    with pytest.raises(ExecutionError, match=r"non-finite values .* in fp16") as exc:
        api.run(cat2, api.merge_request("base", ["e1"], "task_arithmetic", out_dtype="F16", lam=0.0),
                out=tmp_path / "out", model_id="m")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_union_vocabulary_in_another_dtype_is_the_fp32_merge_rounded(tmp_path):
    """Re-ordered embedding rows (tokenizer_source: union) written in bf16: the fp32 output rounded once, in
    the output vocabulary's shapes."""
    import sys
    from pathlib import Path

    from mergepipe.config.parse import parse_config
    from mergepipe.config.resolve import plan_from_config
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
    from vocab_helpers import added_tokens_family

    base, experts = added_tokens_family(tmp_path / "fam")
    models = "".join(f"  - model: {e}\n    parameters: {{weight: {w}}}\n" for e, w in zip(experts, (0.6, 1.3, 0.35)))
    outs = {}
    for tag, extra in (("wide", ""), ("bf16", "out_dtype: bfloat16\n")):
        cat = Catalog(tmp_path / f"{tag}.sqlite")
        text = (f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n{models}dtype: float32\n"
                f"tokenizer_source: union\n{extra}mergepipe: {{budget: '50%'}}\n")
        plan, _ = plan_from_config(cat, parse_config(text, "vocab.yml"))
        manifest = Engine(cat).execute(plan, out=tmp_path / tag)[1]
        assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
        outs[tag] = (plan, load_dir(tmp_path / tag))
        cat.close()
    (wide_plan, wide), (plan, got) = outs["wide"], outs["bf16"]
    assert plan.out_dtype == "BF16" and plan["access"] == wide_plan["access"]
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in wide.items())
    assert plan["estimate"]["output_write"] == sum(v.numel() * v.element_size() for v in got.values())
