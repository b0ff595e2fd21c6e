"""The Snapshots page's "Publish to the Hub" (AppTest), against the Hub-shaped server on 127.0.0.1
(tests/hub_upload_server.py) through the real huggingface_hub client: publish with a progress bar and a
summary, publishing again commits nothing, a pull request, and refusals and server failures as one error
line with nothing committed."""

from __future__ import annotations

import pytest

from dashboard_helpers import open_page
from mergepipe.dashboard import snapshots as dash_snapshots
from mergepipe.errors import MergePipeError

from hub_upload_server import TOKEN, HubServer, point_hub_at

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def hub(env, tmp_path, monkeypatch):
    with HubServer(tmp_path / "served", token=TOKEN) as server:
        point_hub_at(monkeypatch, server, tmp_path / "hf-home")
        yield server


def publish(at, repo: str, pr: bool = False):
    at.text_input(key="hub_repo").set_value(repo)
    at.checkbox(key="hub_pr").set_value(pr)
    at.button(key="hub_publish").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_publish_from_the_snapshots_page(hub, built):
    at = publish(open_page("snapshots"), "me/dash")
    assert [e.value for e in at.error] == []
    done = [s.value for s in at.success]
    assert len(done) == 1 and done[0].startswith(f"Published {built.snapshot_id} to hf://me/dash (commit ")
    assert "files uploaded" in done[0] and "verified by range reads" in done[0]
    bars = at.get("progress")
    assert bars and bars[-1].proto.value == 100 and "verified" in bars[-1].proto.text
    files = hub.files("me/dash")
    assert {"model.safetensors", "mergepipe_manifest.json", "README.md"} <= set(files)
    assert TOKEN not in files["README.md"].decode()
    commits = len(hub.commit_paths)
    at = publish(at, "me/dash")  # again: every file unchanged, no commit
    assert "nothing changed, no commit" in at.success[0].value and len(hub.commit_paths) == commits
    at = publish(at, "hf://me/dash", pr=True)  # also as a URI; nothing changed, so no pull request either
    assert "nothing changed" in at.success[0].value and hub.repos["me/dash"].prs == 0


def test_a_pull_request_from_the_page(hub):
    at = publish(open_page("snapshots"), "me/reviewed", pr=True)
    assert "/me/reviewed/discussions/1" in at.success[0].value
    assert set(hub.files("me/reviewed", "main")) == {".gitattributes"}


@pytest.mark.parametrize("repo, says", [
    ("", "name the Hub repository to publish to"),
    ("me", "not a Hub URI"),
    ("me/x/sub", "not in a subfolder"),
])
def test_bad_repository_names_are_one_error_line(hub, repo, says):
    at = publish(open_page("snapshots"), repo)
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and says in errors[0] and "\n" not in errors[0]
    assert not at.success and hub.calls == []


def test_a_server_failure_is_one_error_line_and_nothing_committed(hub):
    hub.fail_commits = 1
    at = publish(open_page("snapshots"), "me/broken")
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "HTTP 500" in errors[0] and "nothing was committed" in errors[0]
    assert "\n" not in errors[0] and TOKEN not in errors[0]
    assert set(hub.files("me/broken")) == {".gitattributes"}


def test_the_page_helpers():
    assert dash_snapshots.hub_target(" org/name@dev ") == "hf://org/name@dev"
    assert dash_snapshots.hub_target("hf://org/name") == "hf://org/name"
    with pytest.raises(MergePipeError):
        dash_snapshots.hub_target("  ")
    assert dash_snapshots.publish_progress("upload", 1, 2) == (pytest.approx(0.425), "uploading (1 of 2)")
    assert dash_snapshots.publish_progress("verify", 4, 4)[0] == 1.0
