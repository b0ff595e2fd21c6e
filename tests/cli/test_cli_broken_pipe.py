"""Output into a closed pipe ends quietly (issue 28): `mergepipe explain ID | head -5`, `plan ... | head`,
`lineage --dot | head`, `merge --help | head`. The real CLI writes into a real pipe whose reader has gone:
exit 0 or 141 (128 + SIGPIPE, as the shell reports it), nothing on stderr (no BrokenPipeError traceback,
no "Exception ignored" at exit), with stdout buffered (as in a shell) and unbuffered."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess

import pytest

from merge_helpers import cli_cmd, copy_catalog, run_cli, shared_family


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    """A private catalog with a stored plan and a merged snapshot (for lineage); (db, plan id)."""
    fam = shared_family(tmp_path_factory, "tiny-fp32")
    root = tmp_path_factory.mktemp("broken-pipe")
    db = copy_catalog(fam, root / "c.sqlite")
    r = run_cli(["--db", db, "plan", "--json", "--base", "base", "--experts", "e1", "e2", "e3", "--op", "ties",
                 "--density", "0.3", "--budget", "50%"])
    assert r.returncode == 0, r.stderr
    plan_id = json.loads(r.stdout)["plan_id"]
    r = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--out", root / "m1",
                 "--model-id", "m1"])
    assert r.returncode == 0, r.stderr
    return db, plan_id


def _env(buffered: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def _commands(db, plan_id) -> dict[str, list[str]]:
    return {
        "explain": ["--db", str(db), "explain", plan_id],
        "explain-json": ["--db", str(db), "--json", "explain", plan_id],
        "plan": ["--db", str(db), "plan", "--base", "base", "--experts", "e1", "e2", "e3", "--op", "ties",
                 "--density", "0.3"],
        "lineage-dot": ["--db", str(db), "lineage", "--dot"],
        "merge-help": ["merge", "--help"],
    }


def _assert_quiet(rc: int, stderr: bytes) -> None:
    assert rc in (0, 141), (rc, stderr.decode(errors="replace"))
    assert b"Traceback" not in stderr and b"BrokenPipeError" not in stderr, stderr.decode(errors="replace")
    assert stderr == b"", stderr.decode(errors="replace")


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("name", ["explain", "explain-json", "plan", "lineage-dot", "merge-help"])
def test_reader_gone_before_any_output(catalog, name, buffered):
    """The reader closed its end before the command wrote anything: every write fails (EPIPE)."""
    db, plan_id = catalog
    argv = _commands(db, plan_id)[name]
    if buffered:  # the command does print something (once per command)
        ok = subprocess.run(cli_cmd() + argv, capture_output=True, env=_env(True), timeout=120)
        assert ok.returncode == 0 and ok.stdout and not ok.stderr, ok.stderr
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(cli_cmd() + argv, stdout=w, stderr=subprocess.PIPE, env=_env(buffered), timeout=120)
    finally:
        os.close(w)
    _assert_quiet(p.returncode, p.stderr)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_reader_reads_a_little_then_closes(catalog, buffered):
    """As `| head -c 100`: the reader takes the first bytes and goes away while the command still has output
    to write (the pipe holds 4 KiB; `explain --json` of the plan prints more than twice that)."""
    db, plan_id = catalog
    argv = _commands(db, plan_id)["explain-json"]
    assert len(run_cli(argv).stdout.encode()) > 8192
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 4096)
    try:
        p = subprocess.Popen(cli_cmd() + argv, stdout=w, stderr=subprocess.PIPE, env=_env(buffered))
    finally:
        os.close(w)
    try:
        head = os.read(r, 100)
    finally:
        os.close(r)
    assert head.startswith(b"{")
    _, stderr = p.communicate(timeout=120)
    _assert_quiet(p.returncode, stderr)
