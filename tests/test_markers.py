"""The test markers (tests/conftest.py MARKER_RULES): every test under tests/parity is `parity`, every test file
that drives a browser is `e2e`, each rule still names a file that exists, and `-m quick` is the quick loop's
long expression. Collected in a subprocess (`pytest --collect-only -q`), as a contributor would."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
QUICK_EXPR = "not slow and not e2e and not parity and not remote and not ray"
BROWSER_FILES = sorted(p.relative_to(REPO).as_posix() for p in TESTS.rglob("test_*.py")
                       if re.search(r"^(import|from) playwright", p.read_text(), re.M))
QUICK_ARGS = ("tests/storage/test_remote_s3.py", "tests/storage/test_uris.py", "tests/engine/test_ray_security.py")
# name -> pytest arguments; collected once, in parallel subprocesses
COLLECTIONS = {
    "parity": ("-m", "parity", "tests/parity", *BROWSER_FILES),
    "e2e": ("-m", "e2e", "tests/parity", *BROWSER_FILES, "tests/dashboard/test_pages_polish.py"),
    "neither": ("-m", "not parity and not e2e", "tests/parity", *BROWSER_FILES),
    "quick": ("-m", "quick", *QUICK_ARGS),
    "quick expression": ("-m", QUICK_EXPR, *QUICK_ARGS),
}


def collect(args: tuple[str, ...]) -> list[str]:
    """Node ids that `pytest --collect-only -q ARGS` collects, from the repository root."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: nothing selected
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def collected() -> dict[str, list[str]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(collect, args) for name, args in COLLECTIONS.items()}
        return {name: f.result() for name, f in futures.items()}


def marker_rules(config) -> dict[str, tuple[str, ...]]:
    """The table of tests/conftest.py, as pytest loaded it."""
    conftest = TESTS / "conftest.py"
    (plugin,) = [p for p in config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == str(conftest)]
    return plugin.MARKER_RULES


def files_of(nodeids: list[str]) -> set[str]:
    return {n.split("::", 1)[0] for n in nodeids}


def test_every_parity_test_has_the_parity_marker(collected):
    parity_files = {p.relative_to(REPO).as_posix() for p in TESTS.glob("parity/test_*.py")}
    assert files_of(collected["parity"]) == parity_files  # every parity file, and no browser file
    assert collected["neither"] == []  # every test in them (and in the browser files) is marked


def test_browser_tests_are_e2e_and_nothing_else_is(collected):
    assert "tests/dashboard/test_e2e.py" in BROWSER_FILES
    assert files_of(collected["e2e"]) == set(BROWSER_FILES)  # not the AppTest pages, not parity


def test_quick_is_the_long_expression(collected):
    assert sorted(collected["quick"]) == sorted(collected["quick expression"])
    assert files_of(collected["quick"]) == {"tests/storage/test_uris.py"}  # no remote, no ray


@pytest.mark.parametrize("marker", ["parity", "e2e", "remote", "ray", "slow"])
def test_each_rule_names_existing_tests(marker, request):
    """A renamed or deleted file would silently drop its marker: each pattern's file part matches a file."""
    files = {p.relative_to(REPO).as_posix(): p.read_text() for p in TESTS.rglob("test_*.py")}
    tests = [f"{f}::{name}" for f, text in files.items() for name in re.findall(r"^\s*def (test_\w+)", text, re.M)]
    for pattern in marker_rules(request.config)[marker]:
        file_part = pattern.split("::", 1)[0]
        assert fnmatch.filter(files, file_part), f"{marker}: {pattern} matches no test file"
        if "::" in pattern:
            assert fnmatch.filter(tests, pattern), f"{marker}: {pattern} matches no test function"
