"""Remote inputs beyond full checkpoints, against a real Range server on 127.0.0.1 (tests/remote_helpers.py):
PEFT LoRA adapters at ``hf://`` / ``https://`` URIs, tokenizer files of a remote tokenizer source, and
remote URIs written inside mergekit YAML configs (registered on the fly, as local paths are), and PyTorch
``.bin`` checkpoints over HTTP.

Asserted: a remote adapter registers from its config and safetensors header only (bytes counted by the
server), and a budgeted merge of it reads the plan's bytes and equals the merge of the same adapter on
local disk bit for bit; a config naming ``hf://`` models merges like the local config and registers them
under their repo names; a remote ``tokenizer_source`` has its files fetched into the output; a remote
adapter saved as ``adapter_model.bin`` is refused in one line; a remote ``.bin`` checkpoint registers from
its zip directory, data.pkl and local headers only (a small fraction of its bytes, counted by the server)
and merges like the same ``.bin`` files on local disk, bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family
from mergepipe.storage import registry

from merge_helpers import dir_hashes, dump_db, run_cli
from remote_helpers import RangeServer
from test_bin_checkpoints import to_bin
from test_sources import _peft_adapter

BLOCK = 16 << 10
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-inputs")
    org = root / "org"
    fam = make_family(org, experts=2, size="tiny", dtype="fp32", shard_bytes=64 << 10, seed=11)
    _peft_adapter(Path(fam["base"]), org / "adapter", root / "adapter_twin", seed=4, **LORA)
    # a tokenizer-only folder: the base's files with another tokenizer_config.json (same vocabulary)
    tok = org / "tok"
    tok.mkdir()
    for f in Path(fam["base"]).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tok / f.name)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    # an adapter saved the old way (adapter_model.bin only)
    (org / "bin_adapter").mkdir()
    shutil.copy(org / "adapter" / "adapter_config.json", org / "bin_adapter" / "adapter_config.json")
    (org / "bin_adapter" / "adapter_model.bin").write_bytes(b"PK\x03\x04")
    # the family re-saved as PyTorch .bin checkpoints: the base in 3 shards with an index, experts single files
    to_bin(Path(fam["base"]), org / "bin_base", 3)
    for i, e in enumerate(fam["experts"], start=1):
        to_bin(Path(e), org / f"bin_e{i}", 1 if i == 1 else 2)
    with RangeServer(root) as server:
        yield server, fam, org


@pytest.fixture(autouse=True)
def hub(served, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", served[0].url)
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    monkeypatch.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    registry._BACKENDS.pop("hf", None)  # transports are per hf:// folder: none left from another module's server
    yield
    registry._BACKENDS.pop("hf", None)


def adapter_catalog(path: Path, base_uri: str, adapter_uri: str) -> Catalog:
    cat = Catalog(path)
    register(cat, "base", base_uri)
    register(cat, "adapter", adapter_uri, base_id="base", kind="lora")
    analyze(cat, block_bytes=BLOCK, densities=(0.5,))
    return cat


def test_a_remote_lora_adapter_registers_from_headers_and_merges_like_the_local_one(served, tmp_path):
    server, fam, org = served
    weights = org / "adapter" / "adapter_model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    server.reset()
    cat = Catalog(tmp_path / "probe.sqlite")
    register(cat, "base", str(fam["base"]))
    register(cat, "adapter", "hf://org/adapter", base_id="base", kind="lora")
    assert server.total_bytes("org/adapter/") == header + (org / "adapter" / "adapter_config.json").stat().st_size
    assert cat.model("adapter")["uri"] == "hf://org/adapter" and cat.model("adapter")["kind"] == "lora"
    cat.close()

    local = adapter_catalog(tmp_path / "local.sqlite", str(fam["base"]), str(org / "adapter"))
    remote = adapter_catalog(tmp_path / "remote.sqlite", "hf://org/base", "hf://org/adapter")
    plan_l, _, _ = merge(local, "base", ["adapter"], tmp_path / "out-local", "linear", budget="40%", coalesce="off")
    server.reset()
    plan_r, _, _ = merge(remote, "base", ["adapter"], tmp_path / "out-remote", "linear", budget="40%", coalesce="off")
    assert plan_r["access"] == plan_l["access"]
    assert dir_hashes(tmp_path / "out-remote", "*.safetensors") == dir_hashes(tmp_path / "out-local", "*.safetensors")
    planned = plan_r["estimate"]["expert_read"]
    assert 0 < planned < weights.stat().st_size - header
    # B rows of the plan and each A once, plus the 8-byte re-check probe and the config (re-read on re-check)
    sent = server.total_bytes("org/adapter/")
    assert planned <= sent <= planned + 8 + 2 * (org / "adapter" / "adapter_config.json").stat().st_size
    local.close()
    remote.close()


def test_a_remote_adapter_without_safetensors_is_refused(served, tmp_path):
    db = tmp_path / "c.sqlite"
    assert run_cli(["register", "--db", db, "hf://org/base"]).returncode == 0
    before = dump_db(db)
    res = run_cli(["register", "--db", db, "--base", "base", "--kind", "lora", "hf://org/bin_adapter"])
    assert res.returncode != 0
    assert res.stderr == ("error: hf://org/bin_adapter: no adapter_model.safetensors (an adapter saved as "
                          "adapter_model.bin is not supported: save it with safe_serialization=True)\n")
    assert dump_db(db) == before


def models_yaml(base: str, experts: list[str], extra: str = "") -> str:
    rows = "".join(f"  - model: {e}\n    parameters: {{weight: 1.0, density: 0.5}}\n" for e in experts)
    return f"merge_method: ties\nbase_model: {base}\nmodels:\n{rows}{extra}"


def test_remote_uris_in_a_yaml_config_are_registered_on_the_fly(served, tmp_path):
    server, fam, org = served
    local = [str(fam["base"]), *map(str, fam["experts"])]
    (tmp_path / "local.yml").write_text(models_yaml(local[0], local[1:]))
    res = run_cli(["merge", "--db", tmp_path / "l.sqlite", "--config", tmp_path / "local.yml", "--out", tmp_path / "ol"])
    assert res.returncode == 0, res.stderr
    uris = ["hf://org/base@main", "hf://org/expert_1", server.hub_url("org/expert_2")]
    (tmp_path / "remote.yml").write_text(models_yaml(uris[0], uris[1:]))
    db = tmp_path / "r.sqlite"
    res = run_cli(["merge", "--db", db, "--config", tmp_path / "remote.yml", "--out", tmp_path / "or"])
    assert res.returncode == 0, res.stderr
    assert dir_hashes(tmp_path / "or", "*.safetensors") == dir_hashes(tmp_path / "ol", "*.safetensors")
    assert [line for line in res.stderr.splitlines() if line.startswith("registered")] == [
        "registered base (full) from hf://org/base@main",
        "registered expert_1 (full) from hf://org/expert_1",
        f"registered expert_2 (full) from {server.hub_url('org/expert_2')}"]
    # a second run reuses the registrations (matched by URI)
    res = run_cli(["merge", "--db", db, "--config", tmp_path / "remote.yml", "--out", tmp_path / "or2"])
    assert res.returncode == 0, res.stderr
    assert "registered" not in res.stderr
    assert dir_hashes(tmp_path / "or2", "*.safetensors") == dir_hashes(tmp_path / "ol", "*.safetensors")


def test_a_remote_uri_that_is_not_a_checkpoint_is_one_error(served, tmp_path):
    (tmp_path / "bad.yml").write_text(models_yaml("hf://org/base", ["hf://org/nothing"]))
    db = tmp_path / "c.sqlite"
    res = run_cli(["merge", "--db", db, "--config", tmp_path / "bad.yml", "--out", tmp_path / "o"])
    assert res.returncode != 0
    assert res.stderr == ("error: hf://org/nothing: no model.safetensors, pytorch_model.bin or shard index at "
                          "this location\n")
    assert not (tmp_path / "o").exists()


def test_a_remote_tokenizer_source_is_fetched_into_the_output(served, tmp_path):
    server, fam, org = served
    (tmp_path / "tok.yml").write_text(models_yaml("hf://org/base", ["hf://org/expert_1", "hf://org/expert_2"],
                                                  "tokenizer_source: hf://org/tok\n"))
    res = run_cli(["merge", "--db", tmp_path / "c.sqlite", "--config", tmp_path / "tok.yml", "--out", tmp_path / "o"])
    assert res.returncode == 0, res.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "o" / name).read_bytes() == (org / "tok" / name).read_bytes()
    assert json.loads((tmp_path / "o" / "tokenizer_config.json").read_text())["model_max_length"] == 1234
    manifest = json.loads((tmp_path / "o" / "mergepipe_manifest.json").read_text())
    assert "hf://org/tok" in json.dumps(manifest)


def test_remote_bin_checkpoints_register_by_ranges_and_merge_like_local_ones(served, tmp_path):
    server, fam, org = served
    names = ["bin_base", "bin_e1", "bin_e2"]
    server.reset()
    remote = Catalog(tmp_path / "remote.sqlite")
    register(remote, "base", "hf://org/bin_base")
    for n in names[1:]:
        register(remote, n[4:], f"hf://org/{n}", base_id="base")
    for n in names:
        weights = sum(f.stat().st_size for f in (org / n).glob("*.bin"))
        assert 0 < server.total_bytes(f"org/{n}/") < 0.2 * weights  # the layout only, never the tensors
    assert remote.tensors("base") and [t["name"] for t in remote.tensors("e1")] == [t["name"] for t in remote.tensors("base")]
    local = Catalog(tmp_path / "local.sqlite")
    register(local, "base", str(org / "bin_base"))
    for n in names[1:]:
        register(local, n[4:], str(org / n), base_id="base")
    outs = {}
    for tag, cat in (("local", local), ("remote", remote)):
        analyze(cat, block_bytes=BLOCK, densities=(0.5,))
        plan, _, _ = merge(cat, "base", ["e1", "e2"], tmp_path / tag, "ties", budget="30%", density=0.5,
                           coalesce="off")
        outs[tag] = (plan["access"], dir_hashes(tmp_path / tag, "*.safetensors"))
        cat.close()
    assert outs["remote"] == outs["local"]
