"""The catalog's full checks for ``mergepipe doctor``: SQLite's integrity and foreign key checks and
the schema version, read through a read-only connection."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mergepipe.catalog.connection import connect
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.errors import CatalogError


def integrity_findings(path: str | Path, max_errors: int = 20) -> list[str]:
    """The full checks of the catalog file at ``path``, read through a read-only connection (nothing is
    written): ``PRAGMA integrity_check``, ``PRAGMA foreign_key_check`` and the schema version. One line
    per finding; none when the file is healthy."""
    path = Path(path)
    try:
        conn = connect(path, read_only=True)
    except CatalogError as exc:
        return [str(exc)]
    try:
        try:
            rows = [r[0] for r in conn.execute(f"PRAGMA integrity_check({int(max_errors)})").fetchall()]
        except CatalogError as exc:
            cause = exc.__cause__ or exc
            return [f"catalog {path} is corrupted or unreadable (integrity_check: {cause}): restore it from a backup"]
        if rows != ["ok"]:
            lines = [" ".join(r.replace("*** in database main ***", "").split()) for r in rows]
            return [f"catalog {path} is corrupted (integrity_check): {line}" for line in lines if line]
        findings = [f"catalog {path}: foreign key violation: {table} row {rowid} refers to a missing {parent} row"
                    for table, rowid, parent, _ in conn.execute("PRAGMA foreign_key_check").fetchall()]
        try:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.OperationalError:
            row = None
        version = int(row[0]) if row else None
        if version is None:
            findings.append(f"catalog {path}: no schema version (not a MergePipe catalog, or never initialized)")
        elif version > SCHEMA_VERSION:
            findings.append(f"catalog {path}: schema v{version} is newer than this MergePipe (v{SCHEMA_VERSION})")
        elif version < SCHEMA_VERSION:
            findings.append(f"catalog {path}: schema v{version} is older than v{SCHEMA_VERSION} "
                            "(any writing command, e.g. `mergepipe init-db`, migrates it)")
        return findings
    finally:
        conn.close()
