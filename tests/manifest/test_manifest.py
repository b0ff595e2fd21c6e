"""Manifests (content, hash, verify), lineage and the merged snapshot as a model; the output loads with
safetensors and with transformers' AutoModelForCausalLM (invariant 7)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from mergepipe import __version__
from mergepipe.analyze.runner import analyze
from mergepipe.api import lineage, snapshots
from mergepipe.engine.engine import Engine
from mergepipe.errors import MergePipeError, VerifyError
from mergepipe.manifest.build import MANIFEST_NAME, Manifest
from mergepipe.manifest.verify import load_manifest, verify
from mergepipe.planner.context import Planner

from merge_helpers import (DENSITIES, check_catalog_consistent, dir_hashes, load_dir, manifest_of, open_copy,
                           run_cli, sha256_file, shared_family)

RUN_KEYS = {"snapshot_id", "model_id", "out", "created_at", "seconds", "timing", "peak_rss_bytes"}


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


@pytest.fixture(scope="module")
def merged(fam, tmp_path_factory):
    """One budgeted TIES merge, published; tests here must not modify it (tampering uses copies)."""
    d = tmp_path_factory.mktemp("manifest")
    cat = open_copy(fam, d / "c.sqlite")
    plan = Planner(cat).plan("base", fam.expert_ids, "ties", weights=[0.5, 1.0, 0.3], density=0.3,
                             budget="40%", seed=3)
    sid, manifest = Engine(cat).execute(plan, out=d / "merged", model_id="m1", out_shard_bytes=150_000)
    yield cat, plan, sid, manifest, d / "merged"
    cat.close()


def test_manifest_core_content(fam, merged):
    cat, plan, sid, m, out = merged
    core = m.core
    assert core["format"] == "mergepipe.manifest/1"
    assert core["plan_id"] == plan.id and core["plan_digest"] == plan.digest
    assert core["operator"] == "ties" and core["params"] == plan["params"] and core["seed"] == 3
    assert core["grid"] == {"block_bytes": 4096}
    assert core["inputs"]["base"]["fingerprint"] == cat.model("base")["fingerprint"]
    assert [(e["id"], e["fingerprint"], e["weight"], e["density"]) for e in core["inputs"]["experts"]] == [
        (i, cat.model(i)["fingerprint"], w, 0.3) for i, w in zip(fam.expert_ids, [0.5, 1.0, 0.3])]
    assert core["budget"] == plan["budget"] and core["budget"]["spec"] == "40%"
    assert core["estimated"] == plan["estimate"]
    assert core["estimated_by_expert"] == plan["expert_read_by_expert"] == core["realized_by_expert"]
    assert core["realized"]["expert_read"] == plan["estimate"]["expert_read"] <= plan["budget"]["bytes"]
    assert core["touched"] == plan["access"]  # compact [start, end) ranges per expert per tensor
    assert all(isinstance(r, list) and len(r) == 2 for ts in core["touched"].values()
               for rs in ts.values() for r in rs)
    assert core["software"]["mergepipe"] == __version__ and core["software"]["torch"] == torch.__version__
    assert core["parents"] == [{"id": "base", "role": "base", "weight": None}] + [
        {"id": i, "role": "expert", "weight": w} for i, w in zip(fam.expert_ids, [0.5, 1.0, 0.3])]
    # Output hashes: every file of the directory but the manifest, hashed independently.
    assert {n: o["sha256"] for n, o in core["outputs"].items()} == dir_hashes(out)
    assert {n: o["bytes"] for n, o in core["outputs"].items()} == {
        p.name: p.stat().st_size for p in out.iterdir() if p.name != MANIFEST_NAME}
    # output_write counts every file written (shards with headers, index, config, tokenizer) ...
    assert core["realized"]["output_write"] == sum(p.stat().st_size for p in out.iterdir() if p.name != MANIFEST_NAME)
    # ... the estimate, the tensor bytes alone.
    assert core["estimated"]["output_write"] == sum(t.numel() * t.element_size() for t in load_dir(out).values())
    assert len(list(out.glob("*.safetensors"))) >= 3
    # Run facts (ids, paths, timestamps, timings) stay out of the hashed core.
    assert set(m.run) == RUN_KEYS and m.run["snapshot_id"] == sid and m.run["model_id"] == "m1"
    text = json.dumps(core)
    assert str(out) not in text and sid not in text and m.run["created_at"] not in text


def test_manifest_hash_and_storage(merged):
    cat, plan, sid, m, out = merged
    digest = hashlib.sha256(json.dumps(m.core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert m.manifest_hash == "sha256:" + digest
    on_disk = manifest_of(out)
    assert on_disk == {"manifest_hash": m.manifest_hash, "core": m.core, "run": m.run}
    row = cat.query("SELECT * FROM snapshots WHERE id = ?", [sid])[0]
    assert row["manifest_hash"] == m.manifest_hash and row["plan_id"] == plan.id and row["out"] == str(out)
    stored = json.loads(cat.query("SELECT json FROM manifests WHERE snapshot_id = ?", [sid])[0]["json"])
    assert stored == on_disk
    for ref in (sid, "m1", str(out)):
        assert load_manifest(cat, ref).manifest_hash == m.manifest_hash
    with pytest.raises(MergePipeError, match="unknown snapshot"):
        load_manifest(cat, "snap-nope")
    bad = dict(on_disk, manifest_hash="sha256:" + "0" * 64)
    with pytest.raises(VerifyError):
        Manifest.from_dict(bad)
    listed = snapshots(cat)
    assert [(s["id"], s["operator"], s["expert_read_bytes"]) for s in listed] == [
        (sid, "ties", plan["estimate"]["expert_read"])]


def test_verify_ok_and_tampering(merged, tmp_path):
    cat, plan, sid, m, out = merged
    res = verify(cat, sid)
    assert res["ok"] and res["files_checked"] == len(m.core["outputs"]) and res["problems"] == []
    assert verify(None, str(out))["ok"]
    # Tamper with a copy (the published snapshot itself stays intact for the other tests).
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = sorted(copy.glob("*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    res = verify(None, str(copy))
    assert not res["ok"] and len(res["problems"]) == 1 and res["problems"][0].startswith(shard.name + ":")
    (copy / "config.json").unlink()
    res = verify(None, str(copy))
    assert "config.json: missing" in res["problems"]
    mf = json.loads((copy / MANIFEST_NAME).read_text())
    mf["core"]["seed"] = 4
    (copy / MANIFEST_NAME).write_text(json.dumps(mf))
    with pytest.raises(VerifyError, match="does not match"):
        verify(None, str(copy))
    # A self-consistent rewrite (files and manifest hash redone) is still caught by the catalog.
    shutil.rmtree(copy)
    shutil.copytree(out, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(bytes(raw))
    mf = json.loads((copy / MANIFEST_NAME).read_text())
    mf["core"]["outputs"][shard.name]["sha256"] = sha256_file(shard)
    mf["manifest_hash"] = Manifest(mf["core"], mf["run"]).manifest_hash
    (copy / MANIFEST_NAME).write_text(json.dumps(mf))
    assert verify(None, str(copy))["ok"]  # no catalog: nothing to compare against
    res = verify(cat, str(copy))
    assert not res["ok"] and any("catalog records manifest hash" in p for p in res["problems"])


def test_output_loads_with_safetensors(fam, merged):
    cat, plan, sid, m, out = merged
    base, merged_t = load_dir(fam.base), load_dir(out)
    assert list(sorted(base)) == list(sorted(merged_t))
    for n, t in base.items():
        assert merged_t[n].dtype == t.dtype and merged_t[n].shape == t.shape
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for n, f in index["weight_map"].items():
        assert n in load_dir_file(out / f)


def load_dir_file(path):
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as fh:
        return set(fh.keys())


@pytest.mark.parametrize("famname", ["tiny-fp32", "tiny-bf16"])
def test_output_loads_with_transformers(tmp_path_factory, tmp_path, famname):
    from transformers import AutoModelForCausalLM
    fam = shared_family(tmp_path_factory, famname)
    cat = open_copy(fam, tmp_path / "c.sqlite")
    plan = Planner(cat).plan("base", fam.expert_ids, "dare_ties", density=0.3, budget="50%")
    Engine(cat).execute(plan, out=tmp_path / "hf", out_shard_bytes=100_000)
    cat.close()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype="auto")
    want = torch.float32 if fam.spec.dtype == "fp32" else torch.bfloat16
    sd = model.state_dict()
    merged_t = load_dir(tmp_path / "hf")
    for name, t in merged_t.items():
        assert sd[name].dtype == want == t.dtype
        assert torch.equal(sd[name], t), name
    ids = torch.tensor([[1, 5, 17, 42, 200]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, 256)
    assert torch.isfinite(logits.float()).all()
    base_model = AutoModelForCausalLM.from_pretrained(str(fam.base), dtype="auto")
    with torch.no_grad():
        base_logits = base_model(input_ids=ids).logits
    assert not torch.equal(base_logits, logits)  # the merged weights are really used


def test_merged_model_is_registered_with_lineage_and_can_be_merged_again(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    plan1 = Planner(cat).plan("base", ["e1", "e2"], "task_arithmetic", weights=[0.6, 0.4], budget="70%")
    sid1, m1 = Engine(cat).execute(plan1, out=tmp_path / "gen1", model_id="gen1")
    row = cat.model("gen1")
    assert row["kind"] == "full" and row["base_id"] == "base" and row["snapshot_id"] == sid1
    assert row["uri"] == str(tmp_path / "gen1")
    edges = cat.query("SELECT parent_id, role, weight FROM lineage WHERE child_id = 'gen1' ORDER BY parent_id")
    assert edges == [{"parent_id": "base", "role": "base", "weight": None},
                     {"parent_id": "e1", "role": "expert", "weight": 0.6},
                     {"parent_id": "e2", "role": "expert", "weight": 0.4}]
    # The snapshot is an expert of the next merge: not analyzed yet, so a plan would analyze it on the way.
    first = Planner(cat).plan("base", ["gen1", "e3"], "ties", density=0.3, save=False)
    assert first["experts"][0]["analyze"] == "not analyzed" and "analyze" not in first["experts"][1]
    analyze(cat, ["gen1"], densities=DENSITIES)
    assert cat.is_analyzed("gen1")
    plan2 = Planner(cat).plan("base", ["gen1", "e3"], "ties", density=0.3, weights=[1.0, 0.5])
    sid2, m2 = Engine(cat).execute(plan2, out=tmp_path / "gen2", model_id="gen2")
    assert m2.core["parents"][1] == {"id": "gen1", "role": "expert", "weight": 1.0}
    g = lineage(cat, "gen2")
    assert {(e["parent_id"], e["child_id"]) for e in g["edges"]} == {
        ("base", "gen2"), ("gen1", "gen2"), ("e3", "gen2"), ("base", "gen1"), ("e1", "gen1"), ("e2", "gen1")}
    kinds = {n["id"]: n["kind"] for n in g["nodes"]}
    assert kinds == {"gen2": "snapshot", "gen1": "snapshot", "base": "base", "e1": "expert", "e2": "expert",
                     "e3": "expert"}
    down = lineage(cat, "e1")
    assert {"gen1", "gen2"} <= {n["id"] for n in down["nodes"]}
    # Through the CLI.
    res = run_cli(["--db", cat.path, "lineage", "gen2", "--json"])
    assert res.returncode == 0 and json.loads(res.stdout) == json.loads(json.dumps(g))
    res = run_cli(["--db", cat.path, "lineage", "gen2"])
    assert "gen1 -[expert w=1]-> gen2" in res.stdout and "e1 -[expert w=0.6]-> gen1" in res.stdout
    assert verify(cat, sid1)["ok"] and verify(cat, sid2)["ok"]
    check_catalog_consistent(cat.path)
    # A published snapshot's model cannot be replaced.
    from mergepipe.catalog.models import register
    with pytest.raises(MergePipeError):
        register(cat, "gen1", str(fam.experts[3]), base_id="base", replace=True)
    cat.close()


def test_same_plan_twice_same_manifest_core(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    plan = Planner(cat).plan("base", fam.expert_ids, "della", density=0.3, budget="55%", seed=1)
    _, a = Engine(cat).execute(plan, out=tmp_path / "a")
    _, b = Engine(cat).execute(plan, out=tmp_path / "b")
    assert a.core == b.core and a.manifest_hash == b.manifest_hash
    assert a.run["snapshot_id"] != b.run["snapshot_id"] and a.run["out"] != b.run["out"]
    assert dir_hashes(tmp_path / "a") == dir_hashes(tmp_path / "b")
    assert sha256_file(tmp_path / "a" / MANIFEST_NAME) != sha256_file(tmp_path / "b" / MANIFEST_NAME)
    cat.close()
