"""The command line's shape: each command module declares its commands and their flags together
(cli/common.py: command), imports the api once at its top, the cli's modules import each other without a
cycle, `recipe` is a group of sub-commands, one context manager keeps a run's row, and `--help` stays
light (no torch, numpy or rich)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mergepipe
from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.runs import insert_analyze_run, run_rows
from mergepipe.cli.app import build_parser
from mergepipe.cli.common import COMMANDS
from mergepipe.errors import PlanError

CLI = Path(mergepipe.__file__).resolve().parent / "cli"
MODULES = sorted(CLI.glob("*.py"))


def _module_name(path: Path) -> str:
    return "mergepipe.cli" if path.stem == "__init__" else f"mergepipe.cli.{path.stem}"


def _imports(path: Path) -> set[str]:
    """The mergepipe.cli modules ``path`` imports, read literally: `from mergepipe.cli import x` imports
    the package mergepipe.cli (its __init__)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mergepipe.cli"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("mergepipe.cli")}
    return names


def test_cli_modules_import_each_other_without_a_cycle():
    graph = {_module_name(p): _imports(p) for p in MODULES}

    def reach(start, seen):
        for m in graph.get(start, ()):
            if m not in seen:
                seen.add(m)
                reach(m, seen)
        return seen
    cycles = sorted(m for m in graph if m in reach(m, set()))
    assert not cycles, {m: graph[m] for m in cycles}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_the_api_is_imported_once_at_the_top(path):
    tree = ast.parse(path.read_text())
    local = [n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.Lambda))
             for n in ast.walk(f) if isinstance(n, ast.ImportFrom) and n.module in ("mergepipe", "mergepipe.api")]
    assert not local, f"{path.name}: the api imported inside functions at lines {local}"
    top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "mergepipe"
           and any(a.name == "api" for a in n.names)]
    assert len(top) <= 1


def test_build_parser_declares_no_command_flags():
    """Only the flags every command shares are declared in build_parser; each command's are beside it."""
    tree = ast.parse((CLI / "app.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_parser")
    added = [ast.unparse(c.args[0]) for c in ast.walk(fn) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"]
    assert added == ["'--db'", "'--json'"]
    for c in COMMANDS.values():
        for cmd in [c, *c.children.values()]:
            if cmd.func is not None and cmd.arguments is not None and cmd.arguments.__name__ != "<lambda>":
                assert cmd.arguments.__module__ == cmd.func.__module__, cmd.name


def test_recipe_is_a_group_of_sub_commands():
    parser = build_parser()
    assert list(COMMANDS["recipe"].children) == ["save", "show", "list", "explain", "run"]
    args = parser.parse_args(["recipe", "save", "c", "--base", "b", "--experts", "e1", "e*", "--weight", "e*=0.5",
                              "--density", "0.3", "--json"])
    assert (args.action, args.name, args.base, args.experts, args.weight, args.density, args.json) == (
        "save", "c", "b", ["e1", "e*"], ["e*=0.5"], 0.3, True)
    assert args.func.__name__ == "cmd_recipe_save"
    for argv, action, func in ((["recipe", "list"], "list", "cmd_recipe_list"),
                               (["--db", "x", "recipe", "show", "c", "--version", "2"], "show", "cmd_recipe_show"),
                               (["recipe", "explain", "c"], "explain", "cmd_recipe_explain"),
                               (["recipe", "run", "c", "--db", "y"], "run", "cmd_recipe_run")):
        args = parser.parse_args(argv)
        assert (args.command, args.action, args.func.__name__) == ("recipe", action, func)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["recipe"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["recipe", "list", "--base", "b"])  # save's flags go with save


def _run_row(folder: Path, body, **kw) -> dict:
    folder.mkdir()
    cat = Catalog(folder / "c.sqlite", create=True)
    with cat.transaction():
        run_id = insert_analyze_run(cat, ["e1"])
    try:
        with api.recorded_run(cat, run_id, **kw) as run:
            assert run.run_id == run_id and run_rows(cat, run_id)[0]["status"] == "running"
            body(run)
    except (KeyboardInterrupt, Exception):  # noqa: BLE001  (the error is the row's to record)
        pass
    return run_rows(cat, run_id)[0]


def _raise(exc):
    def body(run):
        raise exc
    return body


def test_recorded_run_keeps_the_row(tmp_path):
    row = _run_row(tmp_path / "ok", lambda run: run(1, 2, 3))
    assert (row["status"], row["blocks_done"], row["blocks_total"], row["error"]) == ("succeeded", 1, 2, None)
    assert row["finished_at"]
    assert _run_row(tmp_path / "engine", lambda run: None, finish=False)["status"] == "running"  # the engine's
    row = _run_row(tmp_path / "cancel", _raise(KeyboardInterrupt()))
    assert (row["status"], row["error"]) == ("cancelled", "cancelled by the user")
    row = _run_row(tmp_path / "user", _raise(PlanError("unknown plan 'p'")))
    assert (row["status"], row["error"]) == ("failed", "unknown plan 'p'")
    row = _run_row(tmp_path / "bug", _raise(KeyError("x")))
    assert (row["status"], row["error"]) == ("failed", "KeyError: 'x'")
    with api.recorded_run(None, None) as run:  # no run id: nothing recorded
        assert run is None


def test_help_is_light():
    code = ("import sys, io, contextlib, runpy; sys.argv = ['mergepipe', '--help']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: runpy.run_module('mergepipe.cli', run_name='__main__')\n"
            "    except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'rich', 'safetensors') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
