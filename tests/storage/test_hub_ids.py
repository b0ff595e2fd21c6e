"""Bare Hugging Face repo ids as model references (storage/hub_ids.py, config/references.py): ``org/name``,
``org/name@revision``, ``org/name/subfolder`` and ``BASE+ADAPTER`` with repo ids on both sides, in configs,
``register`` and ``--base/--experts``, against a real Hub-shaped server on 127.0.0.1 (tests/hub_server.py) and a
Hugging Face cache made by huggingface_hub itself (snapshot_download through the same server).

Asserted: a config with bare ids merges bit for bit as the same config with ``hf://`` URIs, its models registered
under their repo names at ``hf://org/name@<commit>``; a cached snapshot is read locally, with ``HF_HUB_OFFLINE=1``
and the server stopped, and the merge transfers 0 bytes; offline and not cached is one ``error:`` line naming the
repo, sent before any request, with the catalog unchanged; a folder that exists wins over a repo id spelled the
same way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergepipe.storage import registry
from mergepipe.api import hub_location
from mergepipe.storage.hub_ids import HubId, hub_origin, parse_hub_id, transferred

from hub_server import HubServer, commit_of, download, hub_repos
from merge_helpers import dir_hashes, dump_db, run_cli

EXPERTS = ("org/expert_1", "org/expert_2@main")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-ids")
    fam = hub_repos(root)
    with HubServer(root) as server:
        yield server, fam, root


@pytest.fixture(autouse=True)
def env(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub[0].url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "MERGEPIPE_REMOTE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    registry._BACKENDS.pop("hf", None)
    yield
    registry._BACKENDS.pop("hf", None)


def config(base: str, experts, method: str = "ties") -> str:
    params = "\n    parameters: {weight: 1.0, density: 0.5}" if method == "ties" else ""
    rows = "".join(f"  - model: {e}{params}\n" for e in experts)
    return f"merge_method: {method}\nbase_model: {base}\nmodels:\n{rows}"


def merge(tmp_path: Path, name: str, text: str, db: Path | None = None):
    (tmp_path / f"{name}.yml").write_text(text)
    return run_cli(["merge", "--db", db or tmp_path / f"{name}.sqlite", "--config", tmp_path / f"{name}.yml",
                    "--out", tmp_path / name])


def registered(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("registered")]


def test_what_a_repo_id_is():
    assert parse_hub_id("org/name") == HubId("org/name", None, "")
    assert parse_hub_id("Org-1/na.me_2@v1.0") == HubId("Org-1/na.me_2", "v1.0", "")
    assert parse_hub_id("org/name/sub/dir") == HubId("org/name", None, "sub/dir")
    assert parse_hub_id("org/name@dev/sub") == parse_hub_id("org/name/sub@dev") == HubId("org/name", "dev", "sub")
    for text in ("name", "/abs/org/name", "./org/name", "~/org/name", "hf://org/name", "org/a+org/b", "org/na--me",
                 "org/name@a@b", "org/name@a/sub@b", "org/name/../x", "org/ name", "-org/name", "org/name."):
        assert parse_hub_id(text) is None, text
    sha = "a" * 40
    assert hub_origin(f"hf://org/name@{sha}/sub") == HubId("org/name", sha, "sub")
    assert hub_origin(f"/c/hub/models--org--na-me/snapshots/{sha}") == HubId("org/na-me", sha, "")
    assert hub_origin("/some/local/folder") is None


def test_a_config_with_bare_ids_merges_as_the_same_config_with_hf_uris(hub, tmp_path):
    server, _, _ = hub
    res = merge(tmp_path, "hf", config("hf://org/base", [f"hf://{e}" for e in EXPERTS]))
    assert res.returncode == 0, res.stderr
    db = tmp_path / "bare.sqlite"
    res = merge(tmp_path, "bare", config("org/base", EXPERTS), db)
    assert res.returncode == 0, res.stderr
    assert dir_hashes(tmp_path / "bare", "*.safetensors") == dir_hashes(tmp_path / "hf", "*.safetensors")
    pinned = [f"hf://org/{n}@{commit_of('org/' + n)}" for n in ("base", "expert_1", "expert_2")]
    assert registered(res) == [f"registered {n} (full) from {u}" for n, u in
                               zip(("base", "expert_1", "expert_2"), pinned)]
    models = {row[0]: row[1] for row in dump_db(db)["models"]}
    assert [models[n] for n in ("base", "expert_1", "expert_2")] == pinned
    manifest = json.loads((tmp_path / "bare" / "mergepipe_manifest.json").read_text())
    assert all(u in json.dumps(manifest) for u in pinned)  # the commit travels with the snapshot
    res = run_cli(["merge", "--db", db, "--config", tmp_path / "bare.yml", "--out", tmp_path / "again"])
    assert res.returncode == 0 and not registered(res), res.stderr  # matched by URI: reused


def test_register_and_base_experts_take_repo_ids(hub, tmp_path):
    db = tmp_path / "c.sqlite"
    res = run_cli(["register", "--db", db, "org/base"])
    assert res.returncode == 0 and res.stdout.startswith("registered: base ("), res.stderr
    res = run_cli(["merge", "--db", db, "--base", "base", "--experts", *EXPERTS, "--op", "linear",
                   "--out", tmp_path / "flags"])
    assert res.returncode == 0, res.stderr
    assert registered(res) == [f"registered expert_{i} (full) from hf://org/expert_{i}@{commit_of(f'org/expert_{i}')}"
                               for i in (1, 2)]
    res = merge(tmp_path, "cfg", config("hf://org/base", [f"hf://{e}" for e in EXPERTS], "linear"))
    assert res.returncode == 0, res.stderr
    assert dir_hashes(tmp_path / "flags", "*.safetensors") == dir_hashes(tmp_path / "cfg", "*.safetensors")


def test_an_adapter_and_its_base_both_named_by_repo_id(hub, tmp_path):
    res = merge(tmp_path, "hf", config("hf://org/base", ["hf://org/base+hf://org/adapter", "hf://org/expert_1"]))
    assert res.returncode == 0, res.stderr
    res = merge(tmp_path, "bare", config("org/base", ["org/base+org/adapter", "org/expert_1"]))
    assert res.returncode == 0, res.stderr
    assert f"registered adapter (lora) from hf://org/adapter@{commit_of('org/adapter')}" in registered(res)
    assert dir_hashes(tmp_path / "bare", "*.safetensors") == dir_hashes(tmp_path / "hf", "*.safetensors")


def test_a_cached_snapshot_is_read_locally_offline_with_the_server_stopped(hub, tmp_path, monkeypatch):
    _, fam, root = hub
    cache = tmp_path / "hf-cache"
    with HubServer(root) as own:  # a server of its own, stopped before the merge
        for repo in ("org/base", "org/expert_1", "org/expert_2"):
            download(own, repo, cache)
    local = [fam["base"], *fam["experts"]]
    assert merge(tmp_path, "local", config(local[0], local[1:])).returncode == 0
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", own.url)  # nothing listens there any more
    before = transferred()
    res = merge(tmp_path, "cached", config("org/base", EXPERTS))
    assert res.returncode == 0, res.stderr
    assert transferred() == before  # 0 bytes over the network
    assert dir_hashes(tmp_path / "cached", "*.safetensors") == dir_hashes(tmp_path / "local", "*.safetensors")
    uris = {row[0]: row[1] for row in dump_db(tmp_path / "cached.sqlite")["models"]}
    for name in ("base", "expert_1", "expert_2"):
        origin = hub_origin(uris[name])
        assert Path(uris[name]).is_dir() and Path(uris[name]).is_relative_to(cache.resolve())
        assert origin == HubId(f"org/{name}", commit_of(f"org/{name}"), "")


def test_offline_and_not_cached_is_one_error_naming_the_repo(hub, tmp_path, monkeypatch):
    server = hub[0]
    db = tmp_path / "c.sqlite"
    assert run_cli(["init-db", "--db", db]).returncode == 0
    before = dump_db(db)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    requests, api = server.total_requests(), server.api_bytes
    res = merge(tmp_path, "off", config("org/base", EXPERTS), db)
    cache = tmp_path / "empty-hf-cache"
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == ("error: off.yml: base_model: org/base: the Hugging Face repo org/base "
                          f"(revision main) is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                          "set, so nothing is fetched; download it once online (huggingface-cli download org/base) or "
                          "unset HF_HUB_OFFLINE\n")
    res = run_cli(["register", "--db", db, "org/expert_1"])
    assert res.returncode == 2 and res.stderr.startswith("error: org/expert_1: the Hugging Face repo org/expert_1")
    assert len(res.stderr.splitlines()) == 1
    assert (server.total_requests(), server.api_bytes) == (requests, api)  # stopped before the network
    assert dump_db(db) == before and not (tmp_path / "off").exists()


def test_a_repo_id_that_is_nowhere_is_one_error(hub, tmp_path):
    res = merge(tmp_path, "nowhere", config("org/base", ["org/nothing"]))
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith("error: nowhere.yml: models[0].model: org/nothing is not a local "
                                 "path; as a Hugging Face repo id (hf://org/nothing@main): ")
    assert "Traceback" not in res.stderr


def test_a_folder_that_exists_wins_over_a_repo_id(hub, tmp_path, monkeypatch):
    _, fam, _ = hub
    (tmp_path / "org").mkdir()
    shutil.copytree(fam["experts"][1], tmp_path / "org" / "expert_1")  # expert_2's files, at ./org/expert_1
    monkeypatch.chdir(tmp_path)
    res = merge(tmp_path, "mixed", config("org/base", ["org/expert_1"]))
    assert res.returncode == 0, res.stderr
    assert registered(res) == [f"registered base (full) from hf://org/base@{commit_of('org/base')}",
                               f"registered expert_1 (full) from {(tmp_path / 'org' / 'expert_1').resolve()}"]


def test_a_sweep_names_its_models_by_repo_id(hub, tmp_path):
    db = tmp_path / "c.sqlite"
    assert run_cli(["init-db", "--db", db]).returncode == 0
    (tmp_path / "sweep.yml").write_text(f"name: s\nbase: org/base\nexperts: [{', '.join(EXPERTS)}]\n"
                                        f"out: {tmp_path / 'points'}\npoints:\n  - {{operator: linear}}\n")
    res = run_cli(["sweep", "--db", db, "--config", tmp_path / "sweep.yml"])
    assert res.returncode == 0, res.stderr
    models = {row[0]: row[1] for row in dump_db(db)["models"]}
    assert models["expert_1"] == f"hf://org/expert_1@{commit_of('org/expert_1')}"
    res = merge(tmp_path, "cfg", config("hf://org/base", [f"hf://{e}" for e in EXPERTS], "linear"))
    assert res.returncode == 0, res.stderr
    assert dir_hashes(tmp_path / "points" / "s-0", "*.safetensors") == dir_hashes(tmp_path / "cfg", "*.safetensors")


def test_a_model_in_a_subfolder_of_a_repo(hub, tmp_path, monkeypatch):
    _, _, root = hub
    res = merge(tmp_path, "sub", config("org/base", ["org/multi/text"]))
    assert res.returncode == 0, res.stderr
    assert f"registered multi (full) from hf://org/multi@{commit_of('org/multi')}/text" in registered(res)
    assert merge(tmp_path, "plain", config("org/base", ["org/expert_1"])).returncode == 0
    assert dir_hashes(tmp_path / "sub", "*.safetensors") == dir_hashes(tmp_path / "plain", "*.safetensors")
    cache = tmp_path / "hf-cache"
    with HubServer(root) as own:
        download(own, "org/multi", cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    found = hub_location("org/multi/text")
    assert found["cached"] and found["uri"].endswith(f"models--org--multi/snapshots/{commit_of('org/multi')}/text")
