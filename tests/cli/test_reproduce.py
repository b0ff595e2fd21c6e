"""``mergepipe reproduce DIR|hf://org/name[@rev]`` against a Hub-shaped server on 127.0.0.1
(tests/hub_upload_server.py) that serves the inputs (hf://org/base, hf://org/expert_1, hf://org/expert_2) and
the snapshot published from them with the real huggingface_hub client.

Asserted: a snapshot folder and the published repository reproduce bit for bit (exit 0), with the catalog
or without one (the inputs then by their recorded hf:// URIs), and the catalog is not changed; an input
whose served file changed since the merge makes it exit 1 naming the first differing tensor and that input;
bad sources are one ``error:`` line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mergepipe.api.publishing import publish_to_hub

from hub_upload_server import TOKEN, HubServer, hub_snapshot, point_hub_at
from merge_helpers import dump_db, run_cli

# huggingface_hub's own upload call (httpx's data= for raw bytes), not MergePipe's
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce")
    with HubServer(root / "served", token=TOKEN) as server, pytest.MonkeyPatch.context() as mp:
        point_hub_at(mp, server, root / "hf-home")
        cat, sid = hub_snapshot(root / "served", root / "c.sqlite", root / "out")
        res = publish_to_hub(cat, sid, "hf://me/repro")
        cat.close()
        yield {"server": server, "root": root, "db": root / "c.sqlite", "out": root / "out", "commit": res["commit"]}


@pytest.fixture(autouse=True)
def env(published, monkeypatch):
    point_hub_at(monkeypatch, published["server"], published["root"] / "hf-home")


def test_a_snapshot_folder_reproduces_bit_for_bit(published):
    before = dump_db(published["db"])
    res = run_cli(["reproduce", "--db", published["db"], published["out"]])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"reproduced bit for bit: {published['out']} (")
    assert "found in the catalog by fingerprint" in res.stdout
    assert dump_db(published["db"]) == before  # the catalog is only read


def test_the_published_repository_reproduces_bit_for_bit_without_a_catalog(published, tmp_path):
    res = run_cli(["--json", "reproduce", "--db", tmp_path / "none.sqlite", "hf://me/repro"])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] and out["first_difference"] is None and out["changed_inputs"] == []
    assert out["source"] == f"hf://me/repro (commit {published['commit'][:12]})"
    assert [i["uri"] for i in out["inputs"]] == ["hf://org/base", "hf://org/expert_1", "hf://org/expert_2"]
    assert {i["found"] for i in out["inputs"]} == {"as recorded"}
    assert out["reproduced_manifest_hash"] == out["manifest_hash"]
    assert not (tmp_path / "none.sqlite").exists()
    # a revision pinned to the published commit reads the same files
    res = run_cli(["reproduce", "--db", tmp_path / "none.sqlite", f"hf://me/repro@{published['commit']}"])
    assert res.returncode == 0 and "reproduced bit for bit" in res.stdout, res.stderr


def _scale_tensor(shard: Path, name: str) -> None:
    """Double one bf16 tensor of a safetensors file in place (same layout, other values)."""
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8:8 + n])[name]
    start, end = (8 + n + o for o in info["data_offsets"])
    values = torch.frombuffer(bytearray(raw[start:end]), dtype=torch.bfloat16) * 2 + 0.125
    raw[start:end] = values.view(torch.uint8).numpy().tobytes()
    shard.write_bytes(bytes(raw))


def test_a_changed_input_names_the_first_differing_tensor(published):
    manifest = json.loads((published["out"] / "mergepipe_manifest.json").read_text())
    touched = sorted(manifest["core"]["touched"]["e1"])
    expert = published["root"] / "served" / "org" / "expert_1"
    index = json.loads((expert / "model.safetensors.index.json").read_text())["weight_map"]
    shard = expert / index[touched[0]]
    saved, st = shard.read_bytes(), shard.stat()
    try:
        _scale_tensor(shard, touched[0])
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new file: a new ETag
        res = run_cli(["--json", "reproduce", "hf://me/repro"])
    finally:
        shard.write_bytes(saved)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    diff = out["first_difference"]
    assert not out["ok"] and out["changed_inputs"] == ["e1"]
    assert diff["tensor"] in manifest["core"]["realized_by_tensor"] or diff["tensor"].startswith("model.")
    assert diff["file"] == "model.safetensors"
    assert diff["why"].startswith("input e1 changed since the merge (hf://org/expert_1: fingerprint sha256:")
    assert out["message"] == (f"not reproduced: first differing tensor {diff['tensor']} (in model.safetensors): "
                              f"{diff['why']}")
    res = run_cli(["reproduce", "hf://me/repro"])  # the file is back: bit for bit again
    assert res.returncode == 0 and "reproduced bit for bit" in res.stdout, res.stderr


@pytest.mark.parametrize("source, says", [
    ("{tmp}/nowhere", "not a snapshot folder or hf://org/name[@revision]"),
    ("{tmp}", "not a MergePipe snapshot"),
    ("hf://me/no-such-repo", "not found (HTTP 404)"),
    ("hf://me/repro@no-such-branch", "not found (HTTP 404)"),
])
def test_bad_sources_are_one_error_line(published, tmp_path, source, says):
    res = run_cli(["reproduce", "--db", tmp_path / "none.sqlite", source.format(tmp=tmp_path)])
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr


def test_inputs_read_from_the_hugging_face_cache_are_found_on_the_hub_at_their_commit(tmp_path, monkeypatch):
    """Inputs registered from huggingface_hub's cache (.../models--org--name/snapshots/<commit>) are the card's
    base_model; on a machine without that cache, reproduce reads each from the Hub at the recorded commit."""
    import shutil

    from huggingface_hub import HfApi, snapshot_download

    from mergepipe.analyze.runner import analyze
    from mergepipe.api import merge
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register, register_many
    from mergepipe.research.family import make_family
    with HubServer(tmp_path / "served", token=TOKEN) as server:
        point_hub_at(monkeypatch, server, tmp_path / "hf-home")
        fam = make_family(tmp_path / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=9)
        hf, cache, folders, commits = HfApi(endpoint=server.url, token=TOKEN), tmp_path / "cache", {}, {}
        for name, path in [("base", fam["base"]), *((Path(e).name, e) for e in fam["experts"])]:
            hf.create_repo(f"org/{name}")
            commits[name] = hf.upload_folder(repo_id=f"org/{name}", folder_path=path).oid
            folders[name] = snapshot_download(f"org/{name}", endpoint=server.url, cache_dir=cache, token=TOKEN)
        cat = Catalog(tmp_path / "c.sqlite")
        register(cat, "base", folders["base"])
        register_many(cat, [("e1", folders["expert_1"]), ("e2", folders["expert_2"])], base_id="base")
        analyze(cat, block_bytes=16 << 10, densities=(0.5,))
        _, sid, _ = merge(cat, "base", ["e1", "e2"], tmp_path / "out", "ties", budget="30%", density=0.5)
        publish_to_hub(cat, sid, "hf://me/from-cache")
        cat.close()
        card = server.files("me/from-cache")["README.md"].decode()
        assert "base_model:\n- org/base\n- org/expert_1\n- org/expert_2\n" in card
        shutil.rmtree(cache)
        res = run_cli(["--json", "reproduce", "--db", tmp_path / "none.sqlite", "hf://me/from-cache"])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"], out["message"]
    assert [i["uri"] for i in out["inputs"]] == [f"hf://org/{n}@{commits[n]}" for n in ("base", "expert_1", "expert_2")]
    assert {i["found"] for i in out["inputs"]} == {
        "from the Hub at the recorded commit (the cached folder is not here)"}
    assert out["changed_inputs"] == []  # read from another place: their fingerprints do not compare
