"""Two processes registering the same model id at once (issue 28): the race ends as the sequential case
does, never in a raw ``sqlite3.IntegrityError``. Two real ``mergepipe register`` processes are started
while the test holds the catalog's write lock, so that both have checked the id (not yet registered)
and wait to write; the lock is then released and they write one after the other.

Different checkpoints under one id: exactly one registers (exit 0), the other gets the ordinary one-line
``error: model 'X' is already registered ...`` (exit 2) and changes nothing. The same checkpoint twice:
both succeed, one "registered" and one "unchanged", as when run one after the other."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from merge_helpers import cli_cmd, dump_db, run_cli_proc
from mergepipe.research.family import make_family


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("race")
    return make_family(root / "fam", experts=2, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=0)


def _opened(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # exited, or an fd closed while listing
        return False


def _race(db: Path, uris: list[str], model_id: str = "X") -> list[tuple[int, str, str]]:
    """Start one `register --model-id model_id --uri U` per U while the write lock is held; release it once
    every process has opened the catalog (and had time to check the id); (rc, stdout, stderr) of each."""
    holder = sqlite3.connect(str(db), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # every writer now waits (busy timeout 30 s) in its BEGIN IMMEDIATE
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen(cli_cmd() + ["register", "--db", str(db), "--model-id", model_id, "--uri", str(u)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for u in uris]
    try:
        wal = Path(str(db) + "-wal")
        deadline = time.monotonic() + 60
        while not all(_opened(p.pid, wal) or p.poll() is not None for p in procs):
            assert time.monotonic() < deadline, "the register processes never opened the catalog"
            time.sleep(0.02)
        time.sleep(3.0)  # from opening the catalog to BEGIN IMMEDIATE: parse the headers, look up the id
        assert all(p.poll() is None for p in procs), "a register process ended while the catalog was locked"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append((p.returncode, stdout, stderr))
    return out


def _catalog(tmp_path: Path, fam: dict) -> Path:
    db = tmp_path / "c.sqlite"
    r = run_cli_proc(["register", "--db", db, "--model-id", "base", "--uri", fam["base"]])
    assert r.returncode == 0, r.stderr
    return db


def test_two_checkpoints_one_id_one_wins_other_one_line_error(fam, tmp_path):
    db = _catalog(tmp_path, fam)
    uris = [str(fam["experts"][0]), str(fam["experts"][1])]
    results = _race(db, uris)
    for _, _, err in results:
        assert "Traceback" not in err and "IntegrityError" not in err, err
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    (win,) = [i for i, r in enumerate(results) if r[0] == 0]
    lose = 1 - win
    assert results[win][1].startswith("registered: X ")
    lines = results[lose][2].strip().splitlines()
    assert len(lines) == 1, results[lose][2]
    assert lines[0].startswith("error: model 'X' is already registered with different content or settings"), lines
    assert "pass --replace" in lines[0]
    # the catalog holds the winner's registration, whole
    after = dump_db(db)
    assert sorted(r[0] for r in after["models"]) == ["X", "base"]
    conn = sqlite3.connect(str(db))
    try:
        uri = conn.execute("SELECT uri FROM models WHERE id = 'X'").fetchone()[0]
        n = conn.execute("SELECT n_tensors FROM models WHERE id = 'X'").fetchone()[0]
        rows = conn.execute("SELECT COUNT(*) FROM tensors WHERE model_id = 'X'").fetchone()[0]
    finally:
        conn.close()
    assert Path(uri).resolve() == Path(uris[win]).resolve() and rows == n
    # and the loser's command, run again now, is refused the same way and leaves the catalog byte for byte
    before = dump_db(db)
    again = run_cli_proc(["register", "--db", db, "--model-id", "X", "--uri", uris[lose]])
    assert again.returncode == 2 and again.stderr.strip() == lines[0]
    assert dump_db(db) == before


def test_same_checkpoint_twice_both_succeed(fam, tmp_path):
    db = _catalog(tmp_path, fam)
    uri = str(fam["experts"][0])
    results = _race(db, [uri, uri])
    for _, _, err in results:
        assert "Traceback" not in err and "IntegrityError" not in err, err
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert sorted(out.split(":")[0] for _, out, _ in results) == ["registered", "unchanged"], results
    assert sorted(r[0] for r in dump_db(db)["models"]) == ["X", "base"]
