"""`mergepipe diff A B` and the dashboard's "what changed since snapshot X" (issue 17)."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from dashboard_helpers import EXPERTS, build_catalog, copy_catalog, open_page, page_env
from merge_helpers import run_cli
from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.models import register
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.evaluations import record_evaluation
from mergepipe.dashboard import views
from mergepipe.errors import MergePipeError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("diff"))


@pytest.fixture
def cat(built, tmp_path):
    c = Catalog(copy_catalog(built.db, tmp_path / "catalog.sqlite"))
    yield c
    c.close()


def _chain(cat, tmp_path):
    """merged-1 (linear 30 % of expert_1..3) -> m2 (expert_2 reweighted to 2) -> m3 (expert_3 removed),
    and a from-scratch ties merge of expert_1 and expert_2."""
    api.extend(cat, api.extend_request("merged-1", "reweight", "expert_2", weight=2.0, out=tmp_path / "m2"))
    api.extend(cat, api.extend_request("m2", "remove", "expert_3", out=tmp_path / "m3"))
    api.merge(cat, "base", ["expert_1", "expert_2"], tmp_path / "t", operator="ties", density=0.5)


def test_diff_names_every_kind_of_change(cat, tmp_path):
    _chain(cat, tmp_path)
    d = api.diff_snapshots(cat, "merged-1", "m3")
    assert d["added"] == [] and d["removed"] == [{"id": "expert_3", "weight": 1.0}]
    assert d["reweighted"] == [{"id": "expert_2", "from": 1.0, "to": 2.0}] and d["retrained"] == []
    assert d["b"]["extends"] == api.load_manifest(cat, "m2").snapshot_id
    m3 = api.load_manifest(cat, "m3").core
    assert d["b"]["bound"] == m3["error_bound"]["absolute"]
    assert d["b"]["read_bytes"] == sum(m3["realized"][k] for k in ("snapshot_read", "base_read", "expert_read"))
    t = api.diff_snapshots(cat, "m2", "t")
    assert t["settings"]["operator"] == {"from": "linear", "to": "ties"}
    assert t["removed"] == [{"id": "expert_3", "weight": 1.0}] and t["reweighted"] == [
        {"id": "expert_2", "from": 2.0, "to": 1.0}]
    back = api.diff_snapshots(cat, "m3", "merged-1")
    assert back["added"] == [{"id": "expert_3", "weight": 1.0}]


def test_diff_reports_a_retrained_expert_and_scores(cat, built, tmp_path):
    # expert_1 re-trained: new files registered under the same id, analyzed again, merged again
    retrained = tmp_path / "expert_1"
    shutil.copytree(built.family / "expert_1", retrained)
    shard = sorted(retrained.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2)
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(shard), metadata={"format": "pt"})
    register(cat, "expert_1", str(retrained), base_id="base", replace=True)
    analyze(cat, ["expert_1"], block_bytes=4096)
    api.merge(cat, "base", list(EXPERTS), tmp_path / "m2", operator="linear", budget="30%")
    for model, value in (("merged-1", 12.5), ("m2", 11.0)):
        record_evaluation(cat, model, cat.model(model)["fingerprint"], "sha256:text", "held-out.txt", "perplexity",
                          value, 100)
    d = api.diff_snapshots(cat, "merged-1", "m2")
    assert [e["id"] for e in d["retrained"]] == ["expert_1"] and d["retrained"][0]["to"] == cat.model(
        "expert_1")["fingerprint"] != d["retrained"][0]["from"]
    assert d["added"] == d["removed"] == d["reweighted"] == []
    assert d["scores"] == {"held-out.txt:perplexity": {"from": 12.5, "to": 11.0}}
    text = api.diff_text(d, api.human_bytes)
    assert "  ! expert_1 re-trained: " in text and "  score held-out.txt:perplexity: 12.5 -> 11" in text
    # the old delta of a re-trained expert cannot be taken out of merged-1 incrementally
    with pytest.raises(MergePipeError, match="re-registered"):
        api.plan_extend(cat, api.extend_request("merged-1", "remove", "expert_1", out=tmp_path / "x"))


def test_cli_diff_and_unknown_snapshot(built, tmp_path):
    db = copy_catalog(built.db, tmp_path / "catalog.sqlite")
    c = Catalog(db)
    api.extend(c, api.extend_request("merged-1", "reweight", "expert_3", weight=0.5, out=tmp_path / "m2"))
    c.close()
    r = run_cli(["--db", str(db), "diff", "merged-1", "m2"])
    rc, out, err = r.returncode, r.stdout, r.stderr
    assert rc == 0, err
    assert out.splitlines()[1] == "  ~ expert_3 weight 1.0 -> 0.5"
    assert out.splitlines()[0].endswith("(m2)  [B extends A]")
    r = run_cli(["--db", str(db), "diff", "merged-1", "nope"])
    rc, out, err = r.returncode, r.stdout, r.stderr
    assert rc != 0 and err.startswith("error: unknown snapshot 'nope'") and err.count("\n") == 1


def test_changes_since_lists_later_snapshots_on_the_base(cat, tmp_path):
    _chain(cat, tmp_path)
    df = views.changes_since(cat, "merged-1")
    assert df["model"].tolist() == ["m2", "m3", "t"]
    assert df["extends X"].tolist() == [True, False, False]
    assert df["reweighted"].tolist() == ["expert_2 1.0 -> 2.0", "expert_2 1.0 -> 2.0", ""]
    assert df["removed"].tolist() == ["", "expert_3", "expert_3"]
    assert df["settings"].tolist()[2].startswith("operator linear -> ties")
    assert views.changes_since(cat, "t").empty
    with pytest.raises(MergePipeError):
        views.changes_since(cat, "nope")


def test_lineage_page_shows_changes_since(built, tmp_path, monkeypatch):
    env = page_env(built, tmp_path, monkeypatch)
    c = Catalog(env["db"])
    api.extend(c, api.extend_request("merged-1", "remove", "expert_1", out=tmp_path / "m2"))
    c.close()
    at = open_page("lineage")
    at.selectbox(key="changes_since").select("merged-1").run()
    assert not at.exception
    assert at.subheader[-1].value == "What changed since a snapshot"
    df = at.dataframe[-1].value  # the last table of the page: the changes (AppTest keeps no key without selection)
    assert df["model"].tolist() == ["m2"] and df["removed"].tolist() == ["expert_1"]
