"""mkdocs hook: serve what the pages use from outside docs/ with the site.

* The screenshots and the favicon live in assets/ at the top of the repository (copied there from the e2e
  flow's screenshots; the README and the dashboard use them from there), so the pages link them as
  ``../assets/NAME.png``, which works on GitHub. Each file of assets/ is added to the site under
  ``assets/`` and those links are rewritten to point inside the site.
* CONTRIBUTING.md stays at the top of the repository (where GitHub looks for it) and becomes the site's
  ``contributing.md``: its links into docs/ are made relative to the site, and the pages' links to
  ``../CONTRIBUTING.md`` point at it.

* A pipe inside a code span of a table row is written ``\\|`` for GitHub; Python-Markdown's tables already
  keep code spans whole, so the site drops the backslash (``full|delta``, not ``full\\|delta``).

So ``mkdocs build --strict`` sees no link leaving the docs folder, and the markdown reads the same on GitHub.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"
CONTRIBUTING = "contributing.md"
CODE = re.compile(r"`[^`\n]*`")
UP = re.compile(r"\]\((?P<up>(?:\.\./)+)(?P<what>assets/|CONTRIBUTING\.md)")


def on_files(files, config):
    for path in sorted(ASSETS.iterdir()):
        if path.is_file() and files.get_file_from_path(f"assets/{path.name}") is None:
            files.append(File.generated(config, f"assets/{path.name}", abs_src_path=str(path)))
    files.append(File.generated(config, CONTRIBUTING, abs_src_path=str(ROOT / "CONTRIBUTING.md")))
    return files


def _table_code_pipes(markdown: str) -> str:
    def row(line: str) -> str:
        if not line.lstrip().startswith("|"):
            return line
        return CODE.sub(lambda m: m.group(0).replace("\\|", "|"), line)
    return "\n".join(row(line) for line in markdown.split("\n"))


def on_page_markdown(markdown, page, config, files):
    markdown = _table_code_pipes(markdown)
    if page.file.src_uri == CONTRIBUTING:  # written from the repository's top: docs/x.md -> x.md
        return re.sub(r"\]\((?:\./)?docs/", "](", markdown)
    folder = posixpath.dirname(page.file.src_uri)
    depth = folder.count("/") + 1 if folder else 0

    def inside(m):
        # one "../" more than the page's depth leaves the docs folder for the repository's top
        if len(m.group("up")) // 3 != depth + 1:
            return m.group(0)
        return "](" + "../" * depth + (CONTRIBUTING if m.group("what") == "CONTRIBUTING.md" else "assets/")

    return UP.sub(inside, markdown)
