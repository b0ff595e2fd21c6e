"""Crash safety of register and analyze: SIGKILL a real `mergepipe register` / `mergepipe analyze` at
points spread over its run; the catalog is intact (integrity_check) and holds all of the batch or
none of it, never part; the next run completes."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from mergepipe.research.family import make_family

from merge_helpers import cli_cmd, rows, run_cli_proc

FRACTIONS = (0.05, 0.2, 0.4, 0.6, 0.8, 0.95)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    return make_family(root / "fam", experts=4, size="small", dtype="fp32", shard_bytes=8 << 20, seed=7)


def _integrity(db: Path) -> str:
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def _timed(argv) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return time.perf_counter() - t0


def _kill_after(argv, delay: float) -> int:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    return proc.wait(timeout=60)


def test_sigkill_during_register(family, tmp_path):
    template = tmp_path / "template.sqlite"
    assert run_cli_proc(["--db", template, "register", "--model-id", "base", "--uri", family["base"]]).returncode == 0
    argv = cli_cmd() + ["--db", str(tmp_path / "probe.sqlite"), "register", "--base", "base", *family["experts"]]
    shutil.copy(template, tmp_path / "probe.sqlite")
    total = _timed(argv)
    killed = 0
    for i, f in enumerate(FRACTIONS):
        db = tmp_path / f"r{i}.sqlite"
        shutil.copy(template, db)
        argv[argv.index("--db") + 1] = str(db)
        killed += _kill_after(argv, f * total) == -signal.SIGKILL
        assert _integrity(db) == "ok"
        ids = [m["id"] for m in rows(db, "SELECT id FROM models ORDER BY id")]
        assert ids in (["base"], ["base", "expert_1", "expert_2", "expert_3", "expert_4"]), ids
        assert {r["model_id"] for r in rows(db, "SELECT DISTINCT model_id FROM tensors")} == set(ids)
        res = run_cli_proc(["--db", db, "register", "--base", "base", *family["experts"]])
        assert res.returncode == 0, res.stderr
        assert len(rows(db, "SELECT id FROM models")) == 5
    assert killed >= 3


def test_sigkill_during_analyze(family, tmp_path):
    template = tmp_path / "template.sqlite"
    assert run_cli_proc(["--db", template, "register", "--model-id", "base", "--uri", family["base"]]).returncode == 0
    assert run_cli_proc(["--db", template, "register", "--base", "base", *family["experts"]]).returncode == 0
    shutil.copy(template, tmp_path / "probe.sqlite")
    argv = cli_cmd() + ["--db", str(tmp_path / "probe.sqlite"), "analyze", "--block-bytes", "65536"]
    total = _timed(argv)
    full = len(rows(tmp_path / "probe.sqlite", "SELECT 1 FROM blocks"))
    assert full > 0
    killed = 0
    for i, f in enumerate(FRACTIONS):
        db = tmp_path / f"a{i}.sqlite"
        shutil.copy(template, db)
        argv[argv.index("--db") + 1] = str(db)
        killed += _kill_after(argv, f * total) == -signal.SIGKILL
        assert _integrity(db) == "ok"
        analyzed = len(rows(db, "SELECT model_id FROM analyses"))
        blocks = len(rows(db, "SELECT 1 FROM blocks"))
        grids = len(rows(db, "SELECT 1 FROM grids"))
        assert (analyzed, blocks, grids) in ((0, 0, 0), (4, full, 1)), (analyzed, blocks, grids)
        res = run_cli_proc(["--db", db, "analyze", "--block-bytes", "65536"])
        assert res.returncode == 0, res.stderr
        assert len(rows(db, "SELECT 1 FROM blocks")) == full
    assert killed >= 3
