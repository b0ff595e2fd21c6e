"""`delete` and `merge --extend` of the same snapshot are exclusive (issue 28): never a child published from a
deleted parent. Each interleaving is produced with real processes: a delete while the extend reads the parent
(the extend is paused with SIGSTOP while it holds its lock), a delete that commits between the extend's reads
and its commit, an extend that commits between the delete's first check and its transaction, and free races."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from merge_helpers import (STAGING_MARK, cli_cmd, copy_catalog, dump_db, manifest_of, rows, run_cli_proc,
                           shared_family)
from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.engine import delete as delete_mod
from mergepipe.engine.extend import ExtendPipeline
from mergepipe.engine.txn import Transaction
from mergepipe.errors import CatalogError, ExecutionError


@pytest.fixture
def small(tmp_path_factory, tmp_path):
    """Snapshot `a` = task_arithmetic(e1) of the small family (20 MB: an extend takes a noticeable time)."""
    db = copy_catalog(shared_family(tmp_path_factory, "small-fp32"), tmp_path / "c.sqlite")
    r = run_cli_proc(["--db", db, "merge", "--base", "base", "--experts", "e1", "--op", "task_arithmetic",
                      "--out", tmp_path / "a"])
    assert r.returncode == 0, r.stderr
    return db


def extend_proc(db: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(cli_cmd() + ["--db", str(db), "merge", "--extend", "a", "--add", "e2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def holds_flock(pid: int, path: Path) -> bool:
    """Whether process ``pid`` holds a flock on ``path`` (/proc/locks: ``N: FLOCK ADVISORY READ PID MAJ:MIN:INO ...``)."""
    ino = str(path.stat().st_ino)
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if f[1] == "FLOCK" and f[4] == str(pid) and f[5].rsplit(":", 1)[-1] == ino:
            return True
    return False


def check_consistent(db: Path, tmp_path: Path) -> str:
    """One of the two outcomes, never a child whose parent is gone: 'extend' (a and b published, b extends a,
    both verify) or 'delete' (a gone, nothing published at b). No staging leftovers either way."""
    snaps = {r["model_id"] for r in rows(db, "SELECT model_id FROM snapshots")}
    assert not [p for p in tmp_path.iterdir() if STAGING_MARK in p.name or ".deleting-" in p.name]
    if "b" in snaps:
        assert snaps == {"a", "b"} and (tmp_path / "a").is_dir()
        edges = rows(db, "SELECT parent_id FROM lineage WHERE child_id = 'b' AND role = 'extends'")
        assert [e["parent_id"] for e in edges] == ["a"]
        for ref in ("a", "b"):
            v = run_cli_proc(["--db", db, "verify", ref])
            assert v.returncode == 0, v.stdout + v.stderr
        return "extend"
    assert snaps == set() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert rows(db, "SELECT id FROM models WHERE id IN ('a', 'b')") == []
    return "delete"


def test_delete_is_refused_while_an_extend_reads_the_snapshot(small, tmp_path):
    manifest = tmp_path / "a" / "mergepipe_manifest.json"
    sid = manifest_of(tmp_path / "a")["run"]["snapshot_id"]
    for attempt in range(3):  # the extend could end between seeing its lock and stopping it: then again
        out = tmp_path / f"b{attempt}"
        proc = extend_proc(small, out)
        while not holds_flock(proc.pid, manifest):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            if holds_flock(proc.pid, manifest):
                break
        finally:
            if not holds_flock(proc.pid, manifest):
                os.kill(proc.pid, signal.SIGCONT)
                assert proc.wait(120) == 0
    else:
        pytest.fail("the extend never stayed in its reading phase long enough to be paused")
    try:
        before = dump_db(small)
        d = run_cli_proc(["--db", small, "delete", "a"])
        assert d.returncode == 2 and d.stdout == ""
        assert d.stderr == (f"error: {sid} (a) is being read by a running `merge --extend`; delete it once that "
                            f"merge has ended\n")
        assert dump_db(small) == before and manifest.exists()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert rows(small, "SELECT model_id FROM snapshots WHERE model_id = ?", [out.name])
    d = run_cli_proc(["--db", small, "delete", "a"])  # now its lineage needs it
    assert d.returncode == 2 and f"is needed by {out.name}" in d.stderr


@pytest.mark.parametrize("hook,message", [
    # after the reads, before the engine's input check: the parent's folder is gone
    ("finish", r"^a \(.*/a\) is no longer readable: .*: no such file or directory while the merge ran; nothing was "
               r"published \(merge again\)$"),
    # after every check, before the rename and the commit: the commit's own check refuses
    ("publish", r"^snapshot snap-\w+ \(a\) was deleted while this extend ran; nothing was published$"),
])
def test_a_delete_that_commits_before_the_extend_wins_and_nothing_is_published(small, tmp_path, monkeypatch, hook,
                                                                             message):
    owner = ExtendPipeline if hook == "finish" else Transaction
    original = getattr(owner, hook)
    deleted = []

    def delete_then(self):  # the extend has read everything and released its lock: a real delete now
        deleted.append(run_cli_proc(["--db", small, "delete", "a"]))
        return original(self)
    monkeypatch.setattr(owner, hook, delete_then)
    cat = Catalog(small)
    try:
        with pytest.raises(ExecutionError, match=message):
            api.extend(cat, api.extend_request("a", "add", "e2", out=tmp_path / "b"))
    finally:
        cat.close()
    assert deleted[0].returncode == 0, deleted[0].stderr
    assert check_consistent(small, tmp_path) == "delete"


def test_an_extend_that_commits_first_makes_the_delete_refuse_and_put_the_folder_back(small, tmp_path, monkeypatch):
    owns = delete_mod._owns
    extended = []

    def extend_then_own(out, sid):  # after the delete's first lineage check, before its rename and transaction
        extended.append(run_cli_proc(["--db", small, "merge", "--extend", "a", "--add", "e2", "--out",
                                      tmp_path / "b"]))
        return owns(out, sid)
    monkeypatch.setattr(delete_mod, "_owns", extend_then_own)
    cat = Catalog(small)
    try:
        with pytest.raises(CatalogError, match=r"\(a\) is needed by b \(lineage\)"):
            api.delete_snapshot(cat, "a")
    finally:
        cat.close()
    assert extended[0].returncode == 0, extended[0].stderr
    assert check_consistent(small, tmp_path) == "extend"


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_free_races_end_in_one_consistent_outcome(small, tmp_path, delay):
    """The delete starts as the extend's staging directory appears (plus ``delay``): whichever wins, the other
    publishes or removes nothing."""
    proc = extend_proc(small, tmp_path / "b")
    while not any(STAGING_MARK in p.name for p in tmp_path.iterdir()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.001)
    time.sleep(delay)
    d = run_cli_proc(["--db", small, "delete", "a"])
    _, err = proc.communicate(timeout=180)
    outcome = check_consistent(small, tmp_path)
    if outcome == "extend":
        assert proc.returncode == 0 and d.returncode == 2, (err, d.stderr)
    else:
        assert d.returncode == 0 and proc.returncode != 0, (err, d.stderr)
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
