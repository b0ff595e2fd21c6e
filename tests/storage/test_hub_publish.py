"""Publishing a snapshot to the Hub (``mergepipe publish``) through the real huggingface_hub client against
a Hub-shaped server on 127.0.0.1 (tests/hub_upload_server.py: create_repo, preupload, LFS batch + PUT,
commit; Xet off), whose inputs it merged from are served by the same server as hf://org/... .

Asserted: a round trip (publish, download with huggingface_hub, every file equal, ``mergepipe verify`` of the
download, the remote files re-hashed by range requests, the download reproduced bit for bit); publishing again uploads no unchanged file and a
new evaluation uploads README.md alone (requests counted server-side); a 500 on the commit leaves the
repository without a commit and the command one error line; the card's front matter parses with
huggingface_hub's ModelCard and carries base_model, base_model_relation, tags, library_name and a
model-index, the body the mergekit recipe, budget, bytes, bound and manifest hash; branches and pull
requests; bad targets refused before any request; the token is sent but never printed or logged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from mergepipe import api
from mergepipe.api.publishing import publish_to_hub
from mergepipe.catalog.evaluations import record_evaluation
from mergepipe.errors import MergePipeError, StorageError
from mergepipe.manifest.build import MANIFEST_NAME
from mergepipe.manifest.verify import verify

from hub_upload_server import TOKEN, HubServer, hub_snapshot, point_hub_at
from merge_helpers import run_cli

# huggingface_hub's own upload call (httpx's data= for raw bytes), not MergePipe's
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-publish")
    with HubServer(root / "served", token=TOKEN) as server, pytest.MonkeyPatch.context() as mp:
        point_hub_at(mp, server, root / "hf-home")
        cat, sid = hub_snapshot(root / "served", root / "c.sqlite", root / "out")
        yield {"server": server, "cat": cat, "sid": sid, "db": root / "c.sqlite", "out": root / "out", "root": root,
               "mp": mp}
        cat.close()


@pytest.fixture(autouse=True)
def env(hub, monkeypatch):
    point_hub_at(monkeypatch, hub["server"], hub["root"] / "hf-home")


def test_publish_round_trip(hub, tmp_path):
    from huggingface_hub import snapshot_download
    server, out = hub["server"], hub["out"]
    stages = []
    res = publish_to_hub(hub["cat"], hub["sid"], "hf://me/round-trip", progress=lambda *a: stages.append(a[0]))
    assert res["created_commit"] and res["commit"] == server.head("me/round-trip")
    assert {"check", "compare", "upload", "verify"} <= set(stages)
    local = {p.name for p in out.iterdir()}
    assert set(res["uploaded"]) == local and res["verified"] == len(local)
    assert res["uploaded_bytes"] == sum(len(server.files("me/round-trip")[n]) for n in local)
    # the weights went as LFS objects (one PUT each), the rest inline in the commit
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(server.lfs_puts) >= len(weights) and server.commit_paths[-1] and set(server.commit_paths[-1]) == local
    down = Path(snapshot_download("me/round-trip", revision=res["commit"], endpoint=server.url,
                                  cache_dir=tmp_path / "cache", token=TOKEN))
    for name in local - {"README.md"}:
        assert (down / name).read_bytes() == (out / name).read_bytes(), name
    card = (down / "README.md").read_text()
    assert res["manifest_hash"] in card and "## Recipe (mergekit)" in card
    checked = verify(None, str(down), check_inputs=False)  # the Hub card stands in for the snapshot's own card
    assert checked["ok"], checked["problems"]
    assert checked["files_checked"] == len(json.loads((out / MANIFEST_NAME).read_text())["core"]["outputs"])
    again = api.reproduce(None, str(down))  # the download, merged again from its card's recipe
    assert again["ok"] and again["message"].startswith("reproduced bit for bit"), again["message"]


def test_publishing_again_uploads_no_unchanged_file(hub):
    server = hub["server"]
    first = publish_to_hub(hub["cat"], hub["sid"], "hf://me/again")
    puts, commits, head = len(server.lfs_puts), len(server.commit_paths), server.head("me/again")
    server.calls.clear()
    again = publish_to_hub(hub["cat"], hub["sid"], "hf://me/again")
    assert again["uploaded"] == [] and not again["created_commit"] and again["commit"] == head
    assert set(again["unchanged"]) == set(first["uploaded"])
    assert len(server.lfs_puts) == puts and len(server.commit_paths) == commits
    assert server.count("PUT", "/lfs-upload/") == 0 and server.count("POST", "/api/models/me/again/commit") == 0
    assert server.count("POST", "/api/models/me/again/preupload") == 0
    # a stored evaluation changes the card only: one commit of README.md, no weight uploaded again
    model = hub["cat"].model("merged")
    record_evaluation(hub["cat"], "merged", model["fingerprint"], "sha256:" + "ab" * 32 + ";window=256",
                      "heldout.txt", "perplexity", 12.5, 4096)
    third = publish_to_hub(hub["cat"], hub["sid"], "hf://me/again")
    assert third["uploaded"] == ["README.md"] and server.commit_paths[-1] == ["README.md"]
    assert len(server.lfs_puts) == puts and server.head("me/again") == third["commit"] != head


def test_a_500_on_the_commit_leaves_no_commit_and_one_error_line(hub):
    server = hub["server"]
    server.fail_commits = 1
    try:
        res = run_cli(["publish", "--db", hub["db"], hub["sid"], "hf://me/failing"])
    finally:
        server.fail_commits = 0
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr
    assert "HTTP 500" in res.stderr and "nothing was committed" in res.stderr, res.stderr
    assert TOKEN not in res.stdout + res.stderr
    # the repository was created, but holds only what the Hub puts in a new one: no half commit
    assert set(server.files("me/failing")) == {".gitattributes"}
    assert server.count("POST", "/api/models/me/failing/commit") == 1
    ok = publish_to_hub(hub["cat"], hub["sid"], "hf://me/failing")  # the same publish, once the server is well
    assert ok["created_commit"] and "model.safetensors" in server.files("me/failing")


def test_the_card_parses_with_modelcard_and_carries_the_fields(hub):
    from huggingface_hub import ModelCard
    model = hub["cat"].model("merged")
    record_evaluation(hub["cat"], "merged", model["fingerprint"], "sha256:" + "cd" * 32, "suite.jsonl",
                      "accuracy", 0.75, 0)
    res = publish_to_hub(hub["cat"], hub["sid"], "hf://me/card")
    text = hub["server"].files("me/card")["README.md"].decode()
    card = ModelCard(text)
    data = card.data.to_dict()
    assert data["base_model"] == ["org/base", "org/expert_1", "org/expert_2"]
    assert data["base_model_relation"] == "merge"
    assert {"merge", "mergepipe", "ties"} <= set(data["tags"]) and data["library_name"] == "transformers"
    results = {(r.metric_type, r.dataset_name): r.metric_value for r in card.data.eval_results}
    assert results[("accuracy", "suite.jsonl")] == 0.75
    recipe = yaml.safe_load(text.split("## Recipe (mergekit)\n\n```yaml\n", 1)[1].split("\n```", 1)[0])
    assert recipe["merge_method"] == "ties" and recipe["base_model"] == "hf://org/base"
    assert recipe["mergepipe"]["budget"] == "30%" and recipe["mergepipe"]["seed"] == 0
    assert "- budget: 30% = " in text and "| expert read |" in text and "- error bound: " in text
    assert f"- manifest hash: `{res['manifest_hash']}`" in text


def test_a_branch_and_a_pull_request(hub):
    server = hub["server"]
    on_branch = publish_to_hub(hub["cat"], hub["sid"], "hf://me/branched@dev")
    assert server.head("me/branched", "dev") == on_branch["commit"]
    assert set(server.files("me/branched", "main")) == {".gitattributes"}
    pr = publish_to_hub(hub["cat"], hub["sid"], "hf://me/pr", create_pr=True)
    assert pr["pr_url"].endswith("/me/pr/discussions/1")
    assert set(server.files("me/pr", "main")) == {".gitattributes"}
    assert "model.safetensors" in server.files("me/pr", "refs/pr/1")


@pytest.mark.parametrize("target, says", [
    ("https://example.com/me/m", "publish to a Hub repository, hf://org/name[@branch]"),
    ("hf://me", "not a Hub URI"),
    ("hf://me/m/sub", "not in a subfolder"),
    ("hf://me/m?token=x", "must not carry credentials"),
])
def test_bad_targets_are_refused_before_any_request(hub, target, says):
    server = hub["server"]
    server.calls.clear()
    with pytest.raises(StorageError, match=None) as err:
        publish_to_hub(hub["cat"], hub["sid"], target)
    assert says in str(err.value)
    res = run_cli(["publish", "--db", hub["db"], hub["sid"], target])
    assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1
    assert server.calls == []


def test_unknown_snapshot_and_missing_folder(hub, tmp_path):
    with pytest.raises(MergePipeError, match="unknown snapshot"):
        publish_to_hub(hub["cat"], "snap-nope", "hf://me/x")
    with pytest.raises(MergePipeError, match="not a directory|not a MergePipe snapshot"):
        publish_to_hub(None, str(tmp_path), "hf://me/x")
    assert "me/x" not in hub["server"].repos


def test_the_token_is_sent_but_never_printed_or_logged(hub, caplog):
    server = hub["server"]
    caplog.set_level(logging.DEBUG)
    server.seen_auth.clear()
    res = run_cli(["publish", "--db", hub["db"], hub["sid"], "hf://me/secret", "--private"])
    assert res.returncode == 0, res.stderr
    assert f"Bearer {TOKEN}" in server.seen_auth
    assert server.repos["me/secret"].private
    assert "hf://me/secret" in res.stdout and "verified" in res.stdout
    publish_to_hub(hub["cat"], hub["sid"], "hf://me/secret")
    assert TOKEN not in res.stdout + res.stderr + caplog.text
    server.token = "another-token"  # the server now refuses ours: the error names where a token comes from
    try:
        denied = run_cli(["publish", "--db", hub["db"], hub["sid"], "hf://me/secret2"])
    finally:
        server.token = TOKEN
    assert denied.returncode == 2 and "access denied (HTTP 401)" in denied.stderr and "HF_TOKEN" in denied.stderr
    assert TOKEN not in denied.stdout + denied.stderr


def test_the_api_names_publish_and_reproduce():
    assert callable(api.publish_to_hub) and callable(api.reproduce)
