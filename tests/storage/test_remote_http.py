"""Remote checkpoints over HTTP and the Hub's URL scheme, against a real Range-honouring server on
127.0.0.1 (tests/remote_helpers.py) that counts every request and body byte it sends.

Asserted: registering reads exactly the headers, the shard index and config.json (bytes counted by the
server); a 10 % merge transfers at most the planned expert bytes plus the headers' 8-byte probes and 1 %;
outputs equal the merge of the same checkpoints from local disk bit for bit; transient 500s and dropped
connections are retried; a server that keeps failing ends the merge in one ``error:`` line with nothing
published and the catalog unchanged; URIs with credentials are refused; the Hub token is sent from
HF_TOKEN and stored nowhere.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register, register_many
from mergepipe.errors import StorageError
from mergepipe.research.family import make_family
from mergepipe.storage import registry
from mergepipe.storage.safetensors import INDEX_NAME
from mergepipe.units import human_bytes

from merge_helpers import dir_hashes, dump_db, run_cli
from remote_helpers import RangeServer

BLOCK = 16 << 10
SETTINGS = dict(density=0.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-http")
    fam = make_family(root / "org", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=5)
    with RangeServer(root) as server:
        yield server, fam


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    monkeypatch.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def model_files(folder) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def header_bytes(folder) -> int:
    """8 + header length of every shard, from the local files (independent of the code under test)."""
    return sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in model_files(folder))


def registration_bytes(folder) -> int:
    return header_bytes(folder) + sum((Path(folder) / n).stat().st_size for n in (INDEX_NAME, "config.json"))


def names(fam) -> list[tuple[str, str]]:
    return [("base", fam["base"])] + [(f"e{i}", e) for i, e in enumerate(fam["experts"], start=1)]


def catalog(path: Path, fam, uri) -> Catalog:
    cat = Catalog(path)
    items = names(fam)
    register(cat, "base", uri(items[0][1]))
    register_many(cat, [(mid, uri(p)) for mid, p in items[1:]], base_id="base")
    analyze(cat, block_bytes=BLOCK, densities=(0.5,))
    return cat


def hub_uri(server):
    return lambda p: server.hub_url(f"org/{Path(p).name}")


@pytest.fixture(scope="module")
def local_outputs(served, tmp_path_factory):
    """The same merges of the local files: the reference for bit-for-bit comparisons."""
    _, fam = served
    tmp = tmp_path_factory.mktemp("local-ref")
    cat = catalog(tmp / "local.sqlite", fam, str)
    out = {}
    for budget in ("10%", "100%"):
        plan, _, _ = merge(cat, "base", ["e1", "e2"], tmp / f"out-{budget[:-1]}", "ties", budget=budget, **SETTINGS)
        out[budget] = (plan, dir_hashes(tmp / f"out-{budget[:-1]}", "*.safetensors"))
    cat.close()
    return out


def test_register_reads_only_headers_index_and_config(served, tmp_path, monkeypatch):
    server, fam = served
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    registry._BACKENDS.pop("hf", None)  # a fresh backend: no header cached by an earlier test
    server.reset()
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", "hf://org/base")
    base_dir = fam["base"]
    assert server.total_bytes("org/base/") == registration_bytes(base_dir)
    # two range requests per shard (the 8-byte length, then the header), the index and config.json
    assert server.total_requests("org/base/") == 2 * len(model_files(base_dir)) + 2
    assert sorted(r for r in server.ranges if r[1] == 0) == \
        sorted((f"org/base/{f.name}", 0, 8) for f in model_files(base_dir))
    row = cat.model("base")
    assert row["uri"] == "hf://org/base"
    assert row["n_tensors"] == len(registry.open_checkpoint(base_dir).tensors)


def test_positional_remote_uris_are_named_after_the_model(served, tmp_path, monkeypatch):
    server, fam = served
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    db = tmp_path / "c.sqlite"
    res = run_cli(["register", "--db", db, "hf://org/base@main"])
    assert res.returncode == 0, res.stderr
    res = run_cli(["register", "--db", db, "--base", "base", server.hub_url("org/expert_1")])
    assert res.returncode == 0, res.stderr
    assert sqlite3.connect(db).execute("SELECT id, uri FROM models ORDER BY id").fetchall() == \
        [("base", "hf://org/base@main"), ("expert_1", server.hub_url("org/expert_1"))]


@pytest.mark.parametrize("budget", ["10%", "100%"])
def test_remote_merge_fetches_the_plan_and_equals_the_local_merge(served, local_outputs, tmp_path, budget):
    server, fam = served
    cat = catalog(tmp_path / "remote.sqlite", fam, hub_uri(server))
    server.reset()
    out = tmp_path / "out"
    plan, _, _ = merge(cat, "base", ["e1", "e2"], out, "ties", budget=budget, **SETTINGS)
    local_plan, local_hashes = local_outputs[budget]
    assert plan["access"] == local_plan["access"]
    assert dir_hashes(out, "*.safetensors") == local_hashes
    planned = plan["estimate"]["expert_read"]
    sent = sum(server.total_bytes(f"org/{Path(e).name}/") for e in fam["experts"])
    probes = sum(8 * len(model_files(e)) for e in fam["experts"])
    assert planned <= sent <= planned + probes * 8 + planned // 100  # headers re-checked by 8-byte probes only
    if budget == "10%":
        assert planned <= 0.11 * plan["full_expert_bytes"]
    else:
        assert planned == plan["full_expert_bytes"]
    assert server.total_bytes("org/base/") >= plan["estimate"]["base_read"]
    http = plan["transfer"]["tiers"]["http"]
    assert http["bytes"] == plan["estimate"]["base_read"] + planned and list(plan["transfer"]["tiers"]) == ["http"]
    assert http["requests"] >= sum(len(rs) for ts in plan["access"].values() for rs in ts.values())
    line = next(x for x in plan.explain().splitlines() if x.startswith("  transfer"))
    assert line.startswith("  transfer   ~") and f" http {human_bytes(http['bytes'])} in {http['requests']} requests (50 ms, 100 MB/s)" in line
    # the output carries the base's config and tokenizer files, fetched from the server
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (Path(fam["base"]) / name).read_bytes()
    manifest = json.loads((out / "mergepipe_manifest.json").read_text())
    assert server.url in json.dumps(manifest)  # inputs by URI, as registered


def test_transient_failures_are_retried(served, local_outputs, tmp_path):
    server, fam = served
    cat = catalog(tmp_path / "remote.sqlite", fam, hub_uri(server))
    stats = registry.storage_for(server.url).stats
    before = stats.snapshot()["retries"]
    data_start = max(header_bytes(e) for e in fam["experts"])
    server.faults = type(server.faults)("500", skip=3, count=2, min_offset=data_start)
    plan, _, _ = merge(cat, "base", ["e1", "e2"], tmp_path / "o1", "ties", budget="10%", **SETTINGS)
    assert server.faults.injected == 2
    server.faults = type(server.faults)("drop", skip=1, count=2, min_offset=data_start)
    merge(cat, "base", ["e1", "e2"], tmp_path / "o2", "ties", budget="10%", **SETTINGS)
    assert server.faults.injected == 2
    assert stats.snapshot()["retries"] - before >= 4  # each injected failure was retried (a stale pooled
    # connection may add one more retry of its own)
    for o in ("o1", "o2"):
        assert dir_hashes(tmp_path / o, "*.safetensors") == local_outputs["10%"][1]


@pytest.mark.parametrize("mode", ["500", "drop"])
def test_a_server_failing_mid_merge_is_one_error_and_publishes_nothing(served, tmp_path, monkeypatch, mode):
    server, fam = served
    db = tmp_path / "remote.sqlite"
    catalog(db, fam, hub_uri(server)).close()
    before = dump_db(db)
    data_start = max(header_bytes(e) for e in fam["experts"])
    monkeypatch.setenv("MERGEPIPE_REMOTE_RETRIES", "3")
    server.faults = type(server.faults)(mode, skip=4, count=-1, min_offset=data_start)
    try:
        res = run_cli(["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--op", "ties",
                       "--density", "0.5", "--budget", "10%", "--out", tmp_path / "out"])
    finally:
        server.faults = type(server.faults)()
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: ") and "failed after 3 attempts" in lines[0], res.stderr
    assert ("HTTP 500" in lines[0]) if mode == "500" else ("dropped" in lines[0] or "short body" in lines[0])
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []
    after = dump_db(db)
    assert after["models"] == before["models"] and after.get("snapshots") == before.get("snapshots")


def test_uris_with_credentials_are_refused_and_never_stored(served, tmp_path):
    server, _ = served
    cat = Catalog(tmp_path / "c.sqlite")
    host = server.url.split("//")[1]
    for uri, shown in ((f"http://alice:s3cret@{host}/org/base/resolve/main", f"http://***@{host}/org/base"),
                       (f"{server.hub_url('org/base')}?token=s3cret", f"{server.hub_url('org/base')}?***")):
        with pytest.raises(StorageError) as err:
            register(cat, "base", uri)
        assert "s3cret" not in str(err.value)
        assert str(err.value).startswith(shown)
        assert "must not carry credentials" in str(err.value)
    assert dump_db(tmp_path / "c.sqlite")["models"] == []


def test_the_hub_token_comes_from_hf_token_and_is_stored_nowhere(served, tmp_path, monkeypatch):
    server, fam = served
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    server.token = "hf_secret_token_123"
    try:
        registry._BACKENDS.pop("hf", None)
        res = run_cli(["register", "--db", tmp_path / "c.sqlite", "--model-id", "base", "--uri", "hf://org/base"])
        assert res.returncode == 2
        assert res.stderr == ("error: hf://org/base/model.safetensors.index.json: access denied (HTTP 401); for the "
                              "Hub set HF_TOKEN or log in with `huggingface-cli login`\n")
        monkeypatch.setenv("HF_TOKEN", server.token)
        registry._BACKENDS.pop("hf", None)
        res = run_cli(["register", "--db", tmp_path / "c.sqlite", "--model-id", "base", "--uri", "hf://org/base"])
        assert res.returncode == 0, res.stderr
    finally:
        server.token = None
        registry._BACKENDS.pop("hf", None)
    assert "hf_secret_token_123" not in "\n".join(sqlite3.connect(tmp_path / "c.sqlite").iterdump())


def test_a_file_changed_on_the_server_is_detected(served, tmp_path):
    server, fam = served
    expert = Path(fam["experts"][1])
    cat = catalog(tmp_path / "remote.sqlite", fam, hub_uri(server))
    shard = model_files(expert)[0]
    stat = shard.stat()
    try:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new ETag, same bytes
        res = run_cli(["merge", "--db", tmp_path / "remote.sqlite", "--base", "base", "--experts", "e1", "e2",
                       "--op", "ties", "--density", "0.5", "--budget", "10%", "--out", tmp_path / "out"])
    finally:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert res.returncode != 0
    assert res.stderr.startswith("error: ") and "changed since registration" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
    cat.close()


def test_the_block_cache_serves_a_repeated_merge(served, local_outputs, tmp_path, monkeypatch):
    server, fam = served
    cat = catalog(tmp_path / "remote.sqlite", fam, hub_uri(server))
    monkeypatch.setenv("MERGEPIPE_REMOTE_CACHE", str(tmp_path / "cache"))
    merge(cat, "base", ["e1", "e2"], tmp_path / "o1", "ties", budget="10%", **SETTINGS)
    server.reset()
    merge(cat, "base", ["e1", "e2"], tmp_path / "o2", "ties", budget="10%", **SETTINGS)
    probes = sum(8 * len(model_files(p)) for _, p in names(fam))
    assert server.total_bytes() <= probes * 8  # only the 8-byte change probes went to the server
    assert dir_hashes(tmp_path / "o2", "*.safetensors") == local_outputs["10%"][1]
    assert any((tmp_path / "cache").rglob("*"))


def test_analyze_over_http_gives_the_local_statistics(served, tmp_path):
    server, fam = served
    local = catalog(tmp_path / "local.sqlite", fam, str)
    server.reset()
    remote = catalog(tmp_path / "remote.sqlite", fam, hub_uri(server))
    sql = ("SELECT model_id, tensor, block, row_start, row_end, offset, nbytes, delta_l2, delta_l1, delta_max_abs, "
           "delta_nnz, sketch FROM blocks ORDER BY model_id, tensor, block")
    assert remote.conn.execute(sql).fetchall() == local.conn.execute(sql).fetchall()
    stats = "SELECT model_id, tensor, delta_l2, thresholds, topk FROM tensor_stats ORDER BY model_id, tensor"
    assert remote.conn.execute(stats).fetchall() == local.conn.execute(stats).fetchall()
    expert_tensor_bytes = sum(registry.open_checkpoint(e).nbytes for e in fam["experts"])
    sent = sum(server.total_bytes(f"org/{Path(e).name}/") for e in fam["experts"])
    assert expert_tensor_bytes <= sent <= 2 * expert_tensor_bytes + 2 * sum(registration_bytes(e) for e in fam["experts"])


def test_yaml_configs_name_remote_models_by_id(served, local_outputs, tmp_path, monkeypatch):
    server, fam = served
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    db = tmp_path / "c.sqlite"
    assert run_cli(["register", "--db", db, "hf://org/base"]).returncode == 0
    assert run_cli(["register", "--db", db, "--base", "base", "hf://org/expert_1", "hf://org/expert_2"]).returncode == 0
    experts = "".join(f"  - model: expert_{i}\n    parameters: {{weight: 1.0, density: 0.5}}\n" for i in (1, 2))
    (tmp_path / "ok.yml").write_text(f"merge_method: ties\nbase_model: base\nmodels:\n{experts}")
    res = run_cli(["merge", "--db", db, "--config", tmp_path / "ok.yml", "--out", tmp_path / "o"])
    assert res.returncode == 0, res.stderr
    assert dir_hashes(tmp_path / "o", "*.safetensors") == local_outputs["100%"][1]  # analyzed in flight, 100 %
    # a URI in the config names the registered model with that URI (no second registration)
    (tmp_path / "uri.yml").write_text(f"merge_method: ties\nbase_model: hf://org/base\nmodels:\n{experts}")
    res = run_cli(["merge", "--db", db, "--config", tmp_path / "uri.yml", "--out", tmp_path / "o2"])
    assert res.returncode == 0, res.stderr
    assert "registered" not in res.stderr
    assert dir_hashes(tmp_path / "o2", "*.safetensors") == local_outputs["100%"][1]