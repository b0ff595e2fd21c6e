"""mkdocs hook: serve the repository's assets/ folder (dashboard screenshots, the favicon) with the site.

The screenshots live in assets/ at the top of the repository (the e2e flow refreshes them there, and the
README and the dashboard use them from there), so the pages link them as ``../assets/NAME.png``, which
works on GitHub. This hook adds each file of assets/ to the site under ``assets/`` and rewrites those
links to point inside the site, so ``mkdocs build --strict`` sees no link leaving the docs folder.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ASSETS = Path(__file__).resolve().parents[2] / "assets"
LINK = re.compile(r"\]\((?P<up>(?:\.\./)+)assets/")


def on_files(files, config):
    for path in sorted(ASSETS.iterdir()):
        if path.is_file() and files.get_file_from_path(f"assets/{path.name}") is None:
            files.append(File.generated(config, f"assets/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = posixpath.dirname(page.file.src_uri).count("/") + (1 if posixpath.dirname(page.file.src_uri) else 0)

    def inside(m):
        # one "../" more than the page's depth leaves the docs folder for the repository's assets/
        return "](" + "../" * depth + "assets/" if len(m.group("up")) // 3 == depth + 1 else m.group(0)

    return LINK.sub(inside, markdown)
