"""The package layout keeps its shape: import-linter's contracts (pyproject.toml) hold, every SQL
statement lives in mergepipe/catalog/ (none in pages/ or app.py), app.py and the pages import only the
dashboard's public doors, the dashboard reaches the library through mergepipe.api only, no module imports
itself back through others, and modules and functions stay within 400 and 60 lines."""

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


# Import cycles that are known and owned elsewhere; each entry is one strongly connected component (its
# modules), and a cycle found must lie inside one of them. Empty it as they are broken.
ALLOWED_IMPORT_CYCLES: list[frozenset[str]] = []


def _module_import_graph() -> dict[str, set[str]]:
    """mergepipe module -> the mergepipe modules it imports: every ``import`` and ``from ... import``
    anywhere in the file (function-local and ``if TYPE_CHECKING:`` ones included), relative names
    resolved, ``from pkg import sub`` counted as an import of ``pkg.sub`` when that is a module."""
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        graph[name] = {m for t in targets if t.split(".")[0] == "mergepipe"
                       for m in [module_of(t)] if m is not None and m != name}
    return graph


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete cycle through the component's first module, for the failure message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return " -> ".join(paths[node] + [start])
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    return " <-> ".join(component)


def test_import_graph_has_no_cycles():
    """No two mergepipe modules import each other, directly or through others, even lazily: a shared
    piece moves down into a module both import (storage.dtypes/base under storage.safetensors,
    catalog.vocab_names under catalog.mismatch and catalog.models, planner.explain_sections under
    planner.plan and planner.explain)."""
    graph = _module_import_graph()
    assert "mergepipe.storage.safetensors" in graph and graph["mergepipe.catalog.mismatch"]
    cycles = [c for c in _import_cycles(graph) if not any(set(c) <= allowed for allowed in ALLOWED_IMPORT_CYCLES)]
    assert not cycles, "import cycles: " + "; ".join(_cycle_path(graph, c) for c in cycles)


def test_import_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _import_cycles(graph) == [["a", "b", "c"]]
    assert _cycle_path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


# --- size limits: a module reads in one sitting, a function on one screen --------------------------------
MODULE_LINE_LIMIT = 400
FUNCTION_LINE_LIMIT = 60
# A generated data table says so on its first line and is not counted against the module limit.
DATA_TABLE_MARK = "exempt from the 400-line module limit"
# Modules and functions still over the limits, each with the reason; empty them as they are split (an entry
# that is no longer over fails the tests, so the lists only shrink). Keys: a path from the repository root;
# a function's key is "path::qualified name".
LONG_MODULES_ALLOWED: dict[str, str] = {}
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _sized_files() -> list[Path]:
    """The files the limits apply to: the library, the dashboard's pages and app.py."""
    return [*sorted(PACKAGE.rglob("*.py")), *sorted((ROOT / "pages").glob("*.py")), ROOT / "app.py"]


def _function_lengths(path: Path) -> dict[str, int]:
    """Qualified name (``Class.method``, ``outer.inner``) -> lines, from ``def`` to the last line of its body."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return lengths


def _over_limits(found: dict[str, int], allowed: dict[str, str], limit: int) -> tuple[list[str], list[str]]:
    """(entries over the limit and not allowed, allowed entries no longer over it)."""
    over = [f"{key}: {n} lines" for key, n in sorted(found.items()) if n > limit and key not in allowed]
    stale = [key for key in sorted(allowed) if found.get(key, 0) <= limit]
    return over, stale


def test_no_module_over_400_lines():
    found = {}
    for path in _sized_files():
        text = path.read_text()
        if DATA_TABLE_MARK not in text.partition("\n")[0]:
            found[str(path.relative_to(ROOT))] = len(text.splitlines())
    over, stale = _over_limits(found, LONG_MODULES_ALLOWED, MODULE_LINE_LIMIT)
    assert not over, f"modules over {MODULE_LINE_LIMIT} lines (split them by responsibility):\n" + "\n".join(over)
    assert not stale, f"no longer over {MODULE_LINE_LIMIT} lines, remove from LONG_MODULES_ALLOWED: {stale}"


def test_no_function_over_60_lines():
    found = {f"{path.relative_to(ROOT)}::{name}": n for path in _sized_files()
             for name, n in _function_lengths(path).items()}
    over, stale = _over_limits(found, LONG_FUNCTIONS_ALLOWED, FUNCTION_LINE_LIMIT)
    assert not over, f"functions over {FUNCTION_LINE_LIMIT} lines (split them into helpers):\n" + "\n".join(over)
    assert not stale, f"no longer over {FUNCTION_LINE_LIMIT} lines, remove from LONG_FUNCTIONS_ALLOWED: {stale}"


def test_size_limits_count_what_they_say(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n\n\n"
                      "async def h():\n    pass\n")
    assert _function_lengths(source) == {"A.f": 4, "A.f.g": 2, "h": 2}
    assert _over_limits({"a": 5, "b": 2, "c": 9}, {"c": "being split", "d": "being split"}, 4) == (
        ["a: 5 lines"], ["d"])
