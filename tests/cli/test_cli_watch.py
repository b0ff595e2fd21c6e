"""`mergepipe watch DIR --recipe NAME` as a real process (issue 17): it picks up a new and a changed
expert, stops cleanly on SIGTERM, refuses a second watcher, and survives a SIGKILL in the middle of a
merge (the next start recovers and finishes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from dashboard_helpers import build_catalog, wait_until
from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family

REPO = Path(__file__).resolve().parents[2]
STAGING = ".mergepipe-staging-"


def start_watch(db: Path, watched: Path, recipe: str, log: Path, *extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "mergepipe.cli", "--db", str(db), "watch", str(watched),
                             "--recipe", recipe, "--interval", "0.2", *extra],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), env=env, cwd=db.parent)


def recipe_snaps(db: Path, recipe: str) -> list[dict]:
    cat = Catalog(db)
    try:
        return cat.query("SELECT snapshot_id, mode FROM recipe_snapshots WHERE name = ? ORDER BY rowid", [recipe])
    finally:
        cat.close()


def retrain(folder: Path) -> None:
    """Rewrite one tensor of a checkpoint in place (what a new training run leaves behind)."""
    shard = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2)
    tensors[name] = tensors[name] * 1.5
    tmp = shard.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, shard)


def test_watch_picks_up_a_new_and_a_changed_expert_and_stops_on_sigterm(tmp_path):
    built = build_catalog(tmp_path / "b", merged=False)
    db, watched = built.db, tmp_path / "incoming"
    watched.mkdir()
    cat = Catalog(db)
    api.recipe_save(cat, "r", "base", ["expert_1", "expert_2", "w-*"], "task_arithmetic",
                    out=str(tmp_path / "out" / "{name}-{n}"))
    cat.close()
    proc = start_watch(db, watched, "r", tmp_path / "watch.log")
    try:
        wait_until(lambda: len(recipe_snaps(db, "r")) == 1, 120, what="the first run")
        second = subprocess.run([sys.executable, "-m", "mergepipe.cli", "--db", str(db), "watch", str(watched),
                                 "--recipe", "r", "--once"], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert second.returncode != 0 and second.stderr.startswith("error: another `mergepipe watch` is running")
        shutil.copytree(built.family / "expert_3", watched / "w-3")
        wait_until(lambda: len(recipe_snaps(db, "r")) == 2, 120, what="the new expert's merge")
        retrain(watched / "w-3")
        wait_until(lambda: len(recipe_snaps(db, "r")) == 3, 120, what="the changed expert's merge")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "watch.log").read_text()
    assert "registered w-3 from" in log and "re-registered (changed) w-3" in log and "stopped on signal 15" in log
    snaps = recipe_snaps(db, "r")
    assert [s["mode"] for s in snaps] == ["scratch", "incremental", "scratch"]
    cat = Catalog(db)
    try:
        added = api.diff_snapshots(cat, snaps[0]["snapshot_id"], snaps[1]["snapshot_id"])
        assert [e["id"] for e in added["added"]] == ["w-3"]
        changed = api.diff_snapshots(cat, snaps[1]["snapshot_id"], snaps[2]["snapshot_id"])
        assert [e["id"] for e in changed["retrained"]] == ["w-3"]
        # the old statistics are not used: the analysis is of the files as they are now
        row, analysis = cat.model("w-3"), cat.analysis("w-3")
        assert analysis["fingerprint"] == row["fingerprint"] == changed["retrained"][0]["to"] and cat.is_analyzed("w-3")
        assert api.doctor(db)["healthy"]
    finally:
        cat.close()


def test_watch_survives_sigkill_in_the_middle_of_a_merge(tmp_path):
    paths = make_family(tmp_path / "fam", experts=2, size="small", dtype="fp32", shard_bytes=8 << 20, seed=2)
    db = tmp_path / "catalog.sqlite"
    cat = Catalog(db)
    register(cat, "base", paths["base"])
    register(cat, "e1", paths["experts"][0], base_id="base")
    analyze(cat, ["e1"], block_bytes=64 << 10)
    out = tmp_path / "out"
    api.recipe_save(cat, "k", "base", ["e1", "w-*"], "task_arithmetic", out=str(out / "{name}-{n}"))
    api.recipe_run(cat, "k")
    cat.close()
    watched = tmp_path / "incoming"
    watched.mkdir()
    shutil.copytree(paths["experts"][1], watched / "w-2")
    proc = start_watch(db, watched, "k", tmp_path / "watch1.log")
    caught = False
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if any(STAGING in p.name for p in out.iterdir()):
                proc.send_signal(signal.SIGKILL)
                caught = True
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert caught, (tmp_path / "watch1.log").read_text()
    assert len(recipe_snaps(db, "k")) == 1 and not api.doctor(db)["healthy"]  # a merge died half-way
    again = start_watch(db, watched, "k", tmp_path / "watch2.log", "--once")
    assert again.wait(180) == 0, (tmp_path / "watch2.log").read_text()
    log = (tmp_path / "watch2.log").read_text()
    assert "recovered 1 unfinished merge(s) of an earlier run" in log
    snaps = recipe_snaps(db, "k")
    assert len(snaps) == 2 and not any(STAGING in p.name for p in out.iterdir())
    cat = Catalog(db)
    try:
        core = api.load_manifest(cat, snaps[1]["snapshot_id"]).core
        assert [e["id"] for e in core["inputs"]["experts"]] == ["e1", "w-2"]
        assert api.verify(cat, snaps[1]["snapshot_id"])["ok"]
    finally:
        cat.close()
    assert api.doctor(db)["healthy"]
