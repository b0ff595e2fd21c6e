"""The documentation builds: `mkdocs build --strict` (Material theme, the API reference generated from the
docstrings by mkdocstrings) exits 0, so no page links to a missing page, anchor or image; and every relative
link in README.md points at a file of the repository (the README is read on GitHub and on PyPI, not built)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and ![alt](target), outside code: the target up to a space or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def _readme_links() -> list[str]:
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)  # fenced code
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return LINK.findall(text)


def test_readme_relative_links_resolve():
    links = _readme_links()
    assert any(t.startswith("docs/") for t in links)  # the README links into the docs
    missing = []
    for target in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s)://, mailto:, in-page anchors
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    site = tmp_path / "site"
    run = subprocess.run([*cmd, "build", "--strict", "-d", str(site)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (site / "index.html").exists() and (site / "reliability" / "index.html").exists()
    api = (site / "api" / "index.html").read_text()
    assert 'id="mergepipe.api.plan"' in api  # the Python API page is generated from the docstrings
