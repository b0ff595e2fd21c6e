"""Invariant 5: a merge is all-or-nothing. SIGKILL a real `mergepipe merge` at many points; crash
deterministically between publish (rename) and catalog commit and at other steps; check that no
partial snapshot is ever visible, `mergepipe recover` cleans up, `verify` passes for every published
snapshot and the catalog stays consistent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.context import Planner
from mergepipe.engine.txn import pid_alive

from merge_helpers import (STAGING_MARK, check_catalog_consistent, cli_cmd, copy_catalog, dump_db, rows,
                           run_cli, run_cli_proc, shared_family, slowed_cli_cmd)


def staging_dirs(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if STAGING_MARK in p.name]


def committed(db: Path, out: Path) -> bool:
    return bool(rows(db, "SELECT 1 FROM snapshots WHERE out = ?", [str(out)]))


def merge_cmd(db: Path, out: Path, model_id: str) -> list[str]:
    return cli_cmd() + ["--db", str(db), "merge", "--base", "base", "--experts", "e1", "e2", "--op", "della",
                        "--density", "0.3", "--weights", "0.7", "1.2", "--out", str(out), "--model-id", model_id]


def wait_for_staging(alive, parent: Path, out: Path, timeout: float = 60) -> float | None:
    """Poll until the merge's staging directory appears; its time since the call, or None if the
    process (``alive()`` false) ended first."""
    t0 = time.monotonic()
    prefix = f".{out.name}{STAGING_MARK}"
    while time.monotonic() - t0 < timeout:
        if any(p.name.startswith(prefix) for p in parent.iterdir()):
            return time.monotonic() - t0
        if not alive():
            return None
        time.sleep(0.002)
    raise AssertionError("staging directory never appeared")


def wait_for_path(alive, path: Path, timeout: float = 60) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists():
            return time.monotonic() - t0
        if not alive():
            return None
        time.sleep(0.002)
    raise AssertionError(f"{path} never appeared")


# A fork server: one interpreter that has imported mergepipe (and torch) but run no torch op, forking a
# fresh child per merge that runs the real CLI entry point, `mergepipe.cli.main(argv)`. Children start
# in milliseconds instead of the ~1.5 s an interpreter needs to import torch, so one test can kill a
# merge at many points of its staging/publish/commit window. Kills during interpreter start-up use the
# real `mergepipe` executable.
FORK_SERVER = textwrap.dedent("""
    import json, os, sys
    import torch  # noqa: F401  (imported, never used here: forking stays safe)
    import mergepipe.cli.app, mergepipe.engine, mergepipe.planner, mergepipe.api  # noqa: F401
    print("ready", flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            try:
                exec(req.get("pre", ""), {})
                code = mergepipe.cli.main(req["argv"])
            except BaseException:
                code = 99
            os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                          "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
""")


class ForkServer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout.readline().strip() == "ready"

    def start(self, argv: list[str], pre: str = "") -> int:
        """Fork a child that runs ``pre`` (Python code, e.g. a fault injection), then the CLI."""
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "pre": pre}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"]

    def reap(self) -> dict:
        """The exit of the last started child (blocks until it has ended and was reaped)."""
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def verify_all_snapshots(db: Path, out: Path | None = None, real_exe: bool = False) -> int:
    """`mergepipe verify` on every published snapshot (or only the one at ``out``)."""
    snaps = rows(db, "SELECT id, out FROM snapshots" + (" WHERE out = ?" if out else ""), [str(out)] if out else [])
    for s in snaps:
        args = ["--db", db, "verify", s["id"]]
        res = run_cli_proc(args) if real_exe else run_cli(args)
        assert res.returncode == 0, (s, res.stdout, res.stderr)
        assert res.stdout.startswith("OK "), res.stdout
    return len(snaps)


def after_crash_checks(db: Path, parent: Path, out: Path, real_exe: bool = False) -> dict:
    """The invariants that must hold after a crash at any instant, before and after `recover`."""
    facts = {"committed": committed(db, out), "staging_left": bool(staging_dirs(parent)),
             "out_existed": out.exists()}
    if out.exists() and not facts["committed"]:
        # Only possible between the publish rename and the catalog commit: the txn says so, and the
        # catalog does not list the directory as a snapshot or a model.
        txn = rows(db, "SELECT status FROM txns WHERE out = ?", [str(out)])
        assert [t["status"] for t in txn] == ["renamed"], txn
        assert not rows(db, "SELECT 1 FROM models WHERE uri = ?", [str(out)])
    recover = ["--db", db, "recover", "--json"]
    res = run_cli_proc(recover) if real_exe else run_cli(recover)
    assert res.returncode == 0, res.stderr
    facts["recover"] = json.loads(res.stdout)
    assert not staging_dirs(parent), "recover left a staging directory"
    assert out.exists() == facts["committed"]
    assert not rows(db, "SELECT id FROM txns WHERE status IN ('staging', 'renamed')")
    check_catalog_consistent(db)
    verify_all_snapshots(db, out)
    # A second recover finds nothing to do.
    again = json.loads(run_cli(["--db", db, "recover", "--json"]).stdout)
    assert again["rolled_back"] == [] and again["removed"] == []
    return facts


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return shared_family(tmp_path_factory, "small-fp32")


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


def merge_argv(db: Path, out: Path, model_id: str) -> list[str]:
    return merge_cmd(db, out, model_id)[len(cli_cmd()):]


def test_sigkill_merge_at_many_points(small, server, tmp_path):
    db = copy_catalog(small, tmp_path / "c.sqlite")
    outs = tmp_path / "outs"
    outs.mkdir()
    facts = []

    def record(f, **kw):
        f.update(kw)
        facts.append(f)

    # 1. The real executable: a calibration run that completes (with `recover` run while it is alive,
    #    which must leave it alone), then kills during interpreter start-up, imports and planning.
    out0 = outs / "calib"
    proc = subprocess.Popen(merge_cmd(db, out0, "calib"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t_stage = wait_for_staging(lambda: proc.poll() is None, outs, out0)
    assert t_stage is not None
    res = run_cli(["--db", db, "recover", "--json"])
    assert res.returncode == 0 and json.loads(res.stdout)["rolled_back"] == []
    assert staging_dirs(outs)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert committed(db, out0)
    assert verify_all_snapshots(db, real_exe=True) == 1
    for i, delay in enumerate((0.02, 0.6 * t_stage)):
        out = outs / f"exec{i}"
        proc = subprocess.Popen(merge_cmd(db, out, out.name), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        record(after_crash_checks(db, outs, out, real_exe=True), how="exec", delay=round(delay, 3),
               rc=proc.returncode)

    # 2. Forked CLI children: measure the staging -> published window, then kill at points spread
    #    over it (and once during planning, before staging).
    out = outs / "fcalib"
    pid = server.start(merge_argv(db, out, out.name))
    alive = lambda: pid_alive(pid)  # noqa: E731
    assert wait_for_staging(alive, outs, out) is not None
    window = wait_for_path(alive, out)
    assert window is not None
    assert server.reap() == {"signal": None, "code": 0}
    assert committed(db, out)
    points = [("plan", 0.01)] + [("stage", f * window) for f in
                                 (0.0, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97, 1.0, 1.05)]
    for i, (mode, delay) in enumerate(points):
        out = outs / f"fork{i}"
        pid = server.start(merge_argv(db, out, out.name))
        alive = lambda: pid_alive(pid)  # noqa: E731
        if mode == "stage":
            if wait_for_staging(alive, outs, out) is not None:
                time.sleep(delay)
        else:
            time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = server.reap()
        record(after_crash_checks(db, outs, out), how="fork-" + mode, delay=round(delay, 3),
               rc=-status["signal"] if status["signal"] else status["code"])
    print(json.dumps([{k: v for k, v in f.items() if k != "recover"} for f in facts]))
    # The schedule really hit merges in flight: many kills, several of them leaving staging behind.
    assert sum(f["rc"] == -signal.SIGKILL for f in facts) >= 8, facts
    assert sum(f["staging_left"] for f in facts) >= 5, facts
    # Recovered output paths are free again: a new merge into one of them publishes normally.
    reuse = next(outs / f"fork{i - 2}" for i, f in enumerate(facts) if i >= 2 and not f["committed"])
    cat = Catalog(db)
    plan = Planner(cat).plan("base", ["e1", "e2"], "linear")
    Engine(cat).execute(plan, out=reuse, model_id="reused")
    cat.close()
    assert committed(db, reuse)
    check_catalog_consistent(db)
    verify_all_snapshots(db)


def test_sigterm_aborts_cleanly(small, tmp_path):
    """SIGTERM (how the dashboard cancels a run) aborts: staging removed, nothing published, exit 130."""
    db = copy_catalog(small, tmp_path / "c.sqlite")
    outs = tmp_path / "outs"
    outs.mkdir()
    before = dump_db(db)
    out = outs / "term"
    proc = subprocess.Popen(slowed_cli_cmd() + merge_argv(db, out, "term"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    assert wait_for_staging(lambda: proc.poll() is None, outs, out) is not None
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err.decode()
    assert not out.exists() and not staging_dirs(outs)
    assert [t["status"] for t in rows(db, "SELECT status FROM txns")] == ["aborted"]
    after = dump_db(db)
    assert after["snapshots"] == before["snapshots"] and after["models"] == before["models"]


FAULTS = {
    # publish renamed the directory; the catalog commit never ran
    "after-rename": """
from mergepipe.engine.txn import Transaction
import os
Transaction.commit = lambda self, fn: os._exit(17)
""",
    # snapshot rows inserted, the process dies before COMMIT
    "inside-commit": """
from mergepipe.engine.txn import Transaction
import os
real_commit = Transaction.commit
def commit(self, fn):
    def register_then_die():
        fn()
        os._exit(17)
    real_commit(self, register_then_die)
Transaction.commit = commit
""",
    # txn marked 'renamed', the rename itself never happened
    "before-rename": """
from mergepipe.engine import txn
import os
real_rename = os.rename
def rename(a, b):
    if txn.STAGING_MARK in str(a):
        os._exit(17)
    return real_rename(a, b)
txn.os.rename = rename
""",
    # half-written shards in staging
    "mid-write": """
from mergepipe.storage import writers as engine
import os
real_write = engine.ShardWriter.write
count = [0]
def write(self, off, data):
    count[0] += 1
    if count[0] == 40:
        os._exit(17)
    return real_write(self, off, data)
engine.ShardWriter.write = write
""",
    # everything written and the manifest staged, never published
    "after-manifest": """
from mergepipe.engine.txn import Transaction
import os
Transaction.publish = lambda self: os._exit(17)
""",
}


@pytest.mark.parametrize("mode", list(FAULTS))
def test_crash_at_each_step(small, server, tmp_path, mode):
    db = copy_catalog(small, tmp_path / "c.sqlite")
    outs = tmp_path / "outs"
    outs.mkdir()
    out = outs / "merged"
    before = dump_db(db)
    argv = ["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "ties", "--density", "0.3",
            "--budget", "60%", "--out", out, "--out-shard-size", 4 << 20]
    server.start(argv, FAULTS[mode])
    assert server.reap() == {"signal": None, "code": 17}
    assert not committed(db, out)
    assert not rows(db, "SELECT 1 FROM models WHERE id = 'merged'")
    expect_out = mode in ("after-rename", "inside-commit")
    assert out.exists() == expect_out
    if expect_out:
        assert (out / "mergepipe_manifest.json").exists()
    assert bool(staging_dirs(outs)) == (not expect_out)
    facts = after_crash_checks(db, outs, out)
    assert len(facts["recover"]["rolled_back"]) == 1
    assert len(facts["recover"]["removed"]) == 1
    if expect_out:
        assert facts["recover"]["removed"] == [str(out)]
    after = dump_db(db)
    for table in ("models", "snapshots", "manifests", "lineage", "tensors", "blocks"):
        assert after[table] == before[table], table
    # The path is free again: the same merge, without the fault, publishes.
    server.start(argv)
    assert server.reap() == {"signal": None, "code": 0}
    assert committed(db, out)
    check_catalog_consistent(db)
    verify_all_snapshots(db)


def test_failure_inside_register_rolls_back_in_process(small, tmp_path, monkeypatch):
    db = copy_catalog(small, tmp_path / "c.sqlite")
    before = dump_db(db)
    cat = Catalog(db)

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Engine, "_register", boom)
    plan = Planner(cat).plan("base", ["e1", "e2"], "linear", budget="30%")
    with pytest.raises(RuntimeError, match="disk on fire"):
        Engine(cat).execute(plan, out=tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and not staging_dirs(tmp_path)
    assert [t["status"] for t in cat.query("SELECT status FROM txns")] == ["aborted"]
    cat.close()
    after = dump_db(db)
    for table in ("models", "snapshots", "manifests", "lineage"):
        assert after[table] == before[table]
