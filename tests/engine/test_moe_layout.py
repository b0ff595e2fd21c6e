"""The fused MoE layout in the engine and on the command line (issue 32, part 4): a fused tensor is never split
across output shards and the shard index names it; ``--moe-layout`` on ``merge --base/--experts`` and over a
config; non-MoE bases are untouched (their plans record nothing); the naming rules refuse experts that do not
fuse; an incremental merge of a fused snapshot is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.errors import MergePipeError, PlanError
from mergepipe.storage.moe_layout import fused_order
from mergepipe.storage.safetensors import TensorInfo
from mergepipe.storage.writers import plan_shards

from merge_helpers import load_dir, run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
from moe_helpers import make_moe_family, per_expert_view  # noqa: E402


@pytest.fixture
def moe(tmp_path):
    paths = make_moe_family(tmp_path / "fam", "mixtral", dtype="bfloat16")
    db = tmp_path / "c.sqlite"
    cat = Catalog(db)
    register(cat, "base", paths["base"])
    for i, e in enumerate(paths["experts"], start=1):
        register(cat, f"e{i}", e, base_id="base")
    cat.close()
    return tmp_path, db, paths


def test_sharded_fused_output_keeps_each_fused_tensor_in_one_shard(moe):
    root, db, _ = moe
    res = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "task_arithmetic",
                   "--out", root / "out", "--out-shard-size", 20000])
    assert res.returncode == 0, res.stderr
    index = json.loads((root / "out" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in index["weight_map"]
    assert not any(".block_sparse_moe." in n for n in index["weight_map"])
    for name, fname in index["weight_map"].items():
        with safe_open(str(root / "out" / fname), "pt") as f:
            assert name in f.keys()
    got = load_dir(root / "out")
    assert got["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
    res = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "task_arithmetic",
                   "--out", root / "per", "--moe-layout", "per-expert"])
    assert res.returncode == 0, res.stderr
    per = load_dir(root / "per")
    split = per_expert_view(got, "mixtral")
    assert sorted(split) == sorted(per) and all(torch.equal(split[n], per[n]) for n in per)


def test_config_key_and_flag_over_a_config(moe):
    root, db, paths = moe
    cfg = root / "m.yml"
    cfg.write_text(f"merge_method: linear\nbase_model: {paths['base']}\nmodels:\n"
                   + "".join(f"  - model: {e}\n    parameters: {{weight: 0.5}}\n" for e in paths["experts"])
                   + "mergepipe: {moe_layout: per-expert}\n")
    cat = Catalog(db)
    plan, _ = api.plan_from_config(cat, api.load_config(cfg), save=False)
    assert plan.moe_layout["layout"] == "per-expert"
    plan, _ = api.plan_from_config(cat, api.load_config(cfg).with_overrides(moe_layout="fused"), save=False)
    assert plan.moe_layout["layout"] == "fused"
    from mergepipe.config.export import export_plan_data
    per, _ = api.plan_from_config(cat, api.load_config(cfg), save=False)
    assert "moe_layout: per-expert" in export_plan_data(cat, per.data)
    cat.close()
    bad = root / "bad.yml"
    bad.write_text(cfg.read_text().replace("per-expert", "stacked"))
    res = run_cli(["--db", db, "plan", "--config", bad])
    assert res.returncode == 2 and "mergepipe.moe_layout 'stacked' is unknown" in res.stderr


def test_incremental_merge_of_a_fused_snapshot_is_refused(moe):
    root, db, _ = moe
    cat = Catalog(db)
    api.run(cat, api.merge_request("base", ["e1"], "task_arithmetic"), out=root / "out", model_id="m")
    with pytest.raises(PlanError, match="wrote its MoE experts fused"):
        api.plan_extend(cat, api.extend_request("m", "add", "e2", weight=0.5, out=root / "o2"))
    cat.close()


def test_experts_that_do_not_fuse_are_refused_by_name():
    def info(name, shape):
        return TensorInfo(name, "BF16", shape, "f", 0, 2 * shape[0] * shape[1])
    p = "model.layers.0.block_sparse_moe.experts"
    ok = [info(f"{p}.{e}.{w}.weight", (4, 2) if w != "w2" else (2, 4)) for e in (0, 1) for w in ("w1", "w2", "w3")]
    order, heads = fused_order("MixtralForCausalLM", ok)
    assert [t.name for t in order][:4] == [f"{p}.0.w1.weight", f"{p}.0.w3.weight", f"{p}.1.w1.weight",
                                           f"{p}.1.w3.weight"]
    assert heads[f"{p}.1.w3.weight"] == ("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 2))
    shards = plan_shards(order, 1 << 20, heads)
    assert shards[0].names == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(MergePipeError, match="do not fuse"):
        fused_order("MixtralForCausalLM", [t for t in ok if t.name != f"{p}.1.w3.weight"])


def test_non_moe_bases_record_nothing(tmp_path):
    from mergepipe.research.family import make_family
    paths = make_family(tmp_path / "f", experts=1, size="tiny", dtype="bf16")
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", paths["base"])
    register(cat, "e1", paths["experts"][0], base_id="base")
    plain = api.plan(cat, api.merge_request("base", ["e1"], "linear"), save=False)
    fused = api.plan(cat, api.merge_request("base", ["e1"], "linear", moe_layout="fused"), save=False)
    assert plain.moe_layout is None and fused.id == plain.id
    cat.close()
