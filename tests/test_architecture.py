"""The package layout keeps its shape: import-linter's contracts (pyproject.toml) hold, every SQL
statement lives in mergepipe/catalog/ (none in pages/ or app.py), app.py and the pages import only the
dashboard's public doors, and the dashboard reaches the library through mergepipe.api only."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mergepipe"

# SQL keywords followed by a space, sqlite_utils table access, and execute() on a connection or with a
# statement literal. (Engine(...).execute(plan, ...) runs a merge, not SQL, and is not matched.)
SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE) |\.db\[|\bconn\.execute\(|\.execute\(\s*f?[\"']")


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports is not installed (pip install -e '.[test]')")
    return [exe]


def test_import_contracts_kept():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([*_lint_imports(), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    kept = re.search(r"Contracts: (\d+) kept, (\d+) broken", out)
    assert kept, out
    assert int(kept.group(1)) >= 5 and kept.group(2) == "0", out
    assert " BROKEN" not in out


def test_sql_only_in_catalog():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "catalog") in path.parents:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if SQL.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "SQL outside mergepipe/catalog/:\n" + "\n".join(offenders)


APP_FILES = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py"))]


@pytest.mark.parametrize("path", APP_FILES, ids=lambda p: p.name)
def test_no_sql_in_app_or_pages(path):
    """Pages only render: no SQL, and no raw catalog (no Catalog of their own, no query on one)."""
    offenders = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                 if SQL.search(line) or RAW_CATALOG.search(line)]
    assert not offenders, "SQL or a raw catalog in the dashboard's pages:\n" + "\n".join(offenders)


RAW_CATALOG = re.compile(r"\bCatalog\(|\.query\(|\.conn\b|\bsqlite_utils\b")
ALLOWED = ("mergepipe.api", "mergepipe.dashboard", "mergepipe.errors", "mergepipe.units")


def _mergepipe_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mergepipe":
            if node.module == "mergepipe":
                names += [f"mergepipe.{a.name}" for a in node.names]
            else:
                names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "mergepipe"]
    return names


@pytest.mark.parametrize("path", APP_FILES, ids=lambda p: p.name)
def test_app_and_pages_use_only_the_public_doors(path):
    """app.py and pages/ import mergepipe.api, mergepipe.dashboard, mergepipe.errors and mergepipe.units
    (besides the standard library, streamlit and other third-party packages, pages._ui and pages._nav)."""
    bad = [m for m in _mergepipe_imports(path) if not any(m == a or m.startswith(a + ".") for a in ALLOWED)]
    assert not bad, f"{path.name} imports {bad}"
    local = [m for m in _local_imports(path) if m not in ("pages", "pages._ui", "pages._nav")]
    assert not local, f"{path.name} imports {local}"


def _local_imports(path: Path) -> list[str]:
    """Imports of this repository's top-level modules other than mergepipe (app, pages, tests, scripts, ...)."""
    own = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                                                 or p.name in ("pages", "tests", "scripts", "benchmarks")}
    own.discard("mergepipe")
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in own:
                names += [node.module] if node.module != "pages" else [f"pages.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] in own]
    return names


DASHBOARD_ALLOWED = ("mergepipe.api", "mergepipe.dashboard", "mergepipe.errors", "mergepipe.units")


@pytest.mark.parametrize("path", sorted((PACKAGE / "dashboard").glob("*.py")), ids=lambda p: p.name)
def test_dashboard_goes_through_the_api(path):
    """One door: the dashboard's modules import mergepipe.api, mergepipe.units and mergepipe.errors (and each
    other), never the planner, config, engine, ops, catalog, storage or manifest directly (import-linter
    checks the same as a contract)."""
    bad = [m for m in _mergepipe_imports(path)
           if not any(m == a or m.startswith(a + ".") for a in DASHBOARD_ALLOWED)]
    assert not bad, f"dashboard/{path.name} imports {bad}"


def test_dashboard_contract_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'source_modules = ["mergepipe.dashboard"]' in text
    block = text.split('source_modules = ["mergepipe.dashboard"]')[1].split("[[")[0]
    for m in ("cli", "research", "config", "engine", "planner", "analyze", "manifest", "ops", "catalog", "storage"):
        assert f'"mergepipe.{m}"' in block, m


CLI_ALLOWED = ("mergepipe.api", "mergepipe.errors", "mergepipe.cli", "mergepipe.dashboard.server",
               "mergepipe.research", "mergepipe.version")


@pytest.mark.parametrize("path", sorted((PACKAGE / "cli").glob("*.py")), ids=lambda p: p.name)
def test_cli_goes_through_the_api(path):
    """Like sqlite-utils' CLI: each command shapes its arguments and makes one API call; the cli imports
    no planner, engine, analyze, catalog, manifest, ops, storage or config module (import-linter checks
    the same as a contract)."""
    bad = [m for m in _mergepipe_imports(path) if not any(m == a or m.startswith(a + ".") for a in CLI_ALLOWED)]
    assert not bad, f"cli/{path.name} imports {bad}"


def test_cli_contract_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'source_modules = ["mergepipe.cli"]' in text
    block = text.split('source_modules = ["mergepipe.cli"]')[1].split("[[")[0]
    for m in ("config", "engine", "planner", "analyze", "manifest", "ops", "catalog", "storage"):
        assert f'"mergepipe.{m}"' in block, m
