"""`mergepipe dashboard` / `demo` on a taken port, a server that dies early, the demo's next steps, and
help text on every option of every command."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from mergepipe.cli.app import build_parser, main
from mergepipe.cli.demo import next_steps
from mergepipe.dashboard.server import check_port_free, wait_until_serving
from mergepipe.errors import MergePipeError


@pytest.fixture
def taken_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_dashboard_on_a_taken_port_is_one_error_line(taken_port, tmp_path, capsys):
    rc = main(["dashboard", "--db", str(tmp_path / "c.sqlite"), "--port", str(taken_port)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""  # no URL printed
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"port {taken_port}" in lines[0]
    assert "already in use" in lines[0]


def test_demo_on_a_taken_port_fails_before_building(taken_port, tmp_path, capsys):
    rc = main(["demo", "--dir", str(tmp_path / "demo"), "--port", str(taken_port)])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "http://" not in out
    assert not (tmp_path / "demo").exists()


def test_check_port_free_accepts_a_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free(port)


def test_a_server_exiting_early_is_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(MergePipeError, match="exited with status 3 before serving"):
        wait_until_serving(proc, 1, timeout=30)


def test_demo_next_steps():
    lines = next_steps({"db": "/tmp/my demo/catalog.sqlite", "base": "base", "experts": ["expert_1", "expert_2"],
                        "model_id": "demo-ties-25pct-1", "snapshot_id": "snap-abc", "plan_id": "plan-1"})
    text = "\n".join(lines)
    assert "export MERGEPIPE_DB='/tmp/my demo/catalog.sqlite'" in text
    assert "--db '/tmp/my demo/catalog.sqlite'" in text
    assert "mergepipe explain snap-abc" in text and "mergepipe snapshots" in text
    assert "demo-ties-25pct-1" in text and "expert_1, expert_2" in text
    assert all(len(line) <= 100 for line in lines if "MERGEPIPE_DB" not in line and "plan --base" not in line)


def _walk(parser: argparse.ArgumentParser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        else:
            yield path, action


def test_every_option_has_help():
    missing = []
    for path, action in _walk(build_parser()):
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if not (action.help or "").strip():
            missing.append(f"{' '.join(path) or 'mergepipe'} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_listings_fit_80_columns(tmp_path, monkeypatch, capsys):
    from dashboard_helpers import build_catalog
    built = build_catalog(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    for cmd in (["models"], ["snapshots"], ["blocks", "--model-id", "expert_1"]):
        assert main(["--db", str(built.db), *cmd]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines and all(len(line) <= 80 for line in lines), cmd
        assert "…" not in out, cmd  # nothing cut: long cells wrap
    main(["--db", str(built.db), "snapshots"])
    out = capsys.readouterr().out
    assert built.snapshot_id in out and "merged-1" in out and "(" in out  # read bytes with the share of full
    monkeypatch.setenv("COLUMNS", "160")
    main(["--db", str(built.db), "snapshots"])
    assert str(built.merged) in capsys.readouterr().out  # the output folder on a wide terminal
