"""`mergepipe watch` and a writer that preallocated its checkpoint and stalled (issue 28): header written, files
at full size, data still zeros, nothing changing. The watcher must not register or merge it; once the writer
finishes (the files change) it is taken, and the merge holds the real data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dashboard_helpers import build_catalog
from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.storage.registry import open_checkpoint
from merge_helpers import load_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("watch-stalled"), merged=False)


def watch_once(db: Path, watched: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "mergepipe.cli", "--db", str(db), "watch", str(watched),
                           "--recipe", "r", "--interval", "0.2", "--once"], capture_output=True, text=True,
                          env=env, cwd=db.parent, timeout=300)


def preallocate(src: Path, dst: Path, written: float = 0.0) -> None:
    """``dst``: ``src``'s files with each safetensors file's header and first ``written`` of its data, and
    zeros to its full size (a writer that preallocated and stalled)."""
    shutil.copytree(src, dst)
    ck = open_checkpoint(str(src))
    for f in sorted(dst.glob("*.safetensors")):
        start = min(t.offset for t in ck.tensors.values() if t.file == f.name)
        size = f.stat().st_size
        keep = start + int((size - start) * written)
        with open(f, "r+b") as fh:
            fh.seek(keep)
            fh.write(bytes(size - keep))


def finish_writing(src: Path, dst: Path) -> None:
    """The writer resumes: the real bytes, in place (the files' mtimes change)."""
    for f in sorted(dst.glob("*.safetensors")):
        with open(f, "r+b") as fh:
            fh.write((src / f.name).read_bytes())


def recipe_experts(db: Path) -> list[list[str]]:
    cat = Catalog(db)
    try:
        sids = [r["snapshot_id"] for r in cat.query("SELECT snapshot_id FROM recipe_snapshots WHERE name = 'r' "
                                                      "ORDER BY rowid")]
        return [[e["id"] for e in api.load_manifest(cat, s).core["inputs"]["experts"]] for s in sids]
    finally:
        cat.close()


@pytest.mark.parametrize("written", [0.0, 0.6])
def test_a_stalled_preallocated_checkpoint_waits_and_is_taken_once_written(built, tmp_path, written):
    db = tmp_path / "c.sqlite"
    shutil.copy(built.db, db)
    watched = tmp_path / "incoming"
    watched.mkdir()
    cat = Catalog(db)
    api.recipe_save(cat, "r", "base", ["expert_1", "w-*"], "task_arithmetic", out=str(tmp_path / "out" / "{name}-{n}"))
    cat.close()
    preallocate(built.family / "expert_3", watched / "w-3", written)
    first = watch_once(db, watched)
    assert first.returncode == 0, first.stderr
    assert f"waiting: {watched / 'w-3'}: " in first.stderr and "(still being written?)" in first.stderr
    assert "registered w-3" not in first.stderr
    cat = Catalog(db)
    try:
        assert not cat.has_model("w-3")
    finally:
        cat.close()
    assert recipe_experts(db) == [["expert_1"]]
    again = watch_once(db, watched)  # nothing changed: still waiting, nothing read into the catalog
    assert again.returncode == 0 and "registered w-3" not in again.stderr, again.stderr
    finish_writing(built.family / "expert_3", watched / "w-3")
    done = watch_once(db, watched)
    assert done.returncode == 0 and "registered w-3 from" in done.stderr, done.stderr
    assert recipe_experts(db) == [["expert_1"], ["expert_1", "w-3"]]
    check_merge_holds_the_real_expert(db, built, tmp_path)


def check_merge_holds_the_real_expert(db: Path, built, tmp_path: Path) -> None:
    """The watcher's merge equals task arithmetic of expert_1 and the real expert_3 (not a zero expert)."""
    cat = Catalog(db)
    try:
        out = sorted((tmp_path / "out").iterdir())[-1]
        api.merge(cat, "base", ["expert_1", "expert_3"], tmp_path / "ref", operator="task_arithmetic")
    finally:
        cat.close()
    got, ref = load_dir(out), load_dir(tmp_path / "ref")
    assert set(got) == set(ref)
    for name in ref:
        assert torch.allclose(got[name].double(), ref[name].double(), rtol=1e-5, atol=1e-6), name
