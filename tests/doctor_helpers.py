"""Helpers for the doctor tests: a small family, catalogs of it, a corrupted page."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family


def doctor_family(tmp_path_factory):
    """A tiny fp32 family (base + 2 experts) of this test module's own."""
    root = tmp_path_factory.mktemp("doctor-fam")
    paths = make_family(root / "fam", experts=2, size="tiny", dtype="fp32", shard_bytes=64 << 10, seed=3)
    return Path(paths["base"]), [Path(p) for p in paths["experts"]]


def make_catalog(family, tmp_path: Path, copy_models: bool = False) -> Path:
    """A catalog of the family (base + 2 experts); ``copy_models``: of private copies of their files."""
    base, experts = family
    if copy_models:
        base = Path(shutil.copytree(base, tmp_path / "models" / "base"))
        experts = [Path(shutil.copytree(e, tmp_path / "models" / e.name)) for e in experts]
    db = tmp_path / "c.sqlite"
    cat = Catalog(db)
    try:
        register(cat, "base", str(base))
        for i, e in enumerate(experts, start=1):
            register(cat, f"e{i}", str(e), base_id="base")
        cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        cat.close()
    return db


def corrupt_page(db: Path, table: str = "tensors") -> int:
    """Overwrite the b-tree page header of ``table``'s root page; returns the page number."""
    conn = sqlite3.connect(str(db))
    try:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", [table]).fetchone()[0]
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    with open(db, "r+b") as fh:
        fh.seek((root - 1) * page_size)
        fh.write(b"\xff" * 16)
    return root
