"""The catalog: one SQLite file (WAL) holding models, tensors, the block grid with per-block delta
statistics, analyses, plans, snapshots, manifests, lineage and runs.

Writes go through short transactions so that a reader (the dashboard) never sees half an operation.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# catalog_fault and integrity_findings are re-exported (their importers know them from here)
from mergepipe.catalog.connection import catalog_fault, connect, read_only_reason  # noqa: F401
from mergepipe.catalog.integrity import integrity_findings  # noqa: F401
from mergepipe.catalog.packed import unpack
from mergepipe.catalog.schema import MIGRATIONS, SCHEMA, SCHEMA_VERSION
from mergepipe.errors import CatalogError


def _import_sqlite_utils():
    """Import sqlite_utils without letting it import pandas and numpy (~0.45 s of a 0.55 s import).

    sqlite_utils.db imports both, when installed, only to map their scalar types to column types for
    tables it creates from rows; every catalog table is created by explicit SQL (SCHEMA), so the
    mapping is never used here. A ``None`` in sys.modules makes their import fail for the moment of
    this import; the entries are removed right after, so later ``import numpy`` works as usual.
    Modules some caller already imported are left alone (sqlite_utils then uses them)."""
    if "sqlite_utils" in sys.modules:
        return sys.modules["sqlite_utils"]
    blocked = [name for name in ("pandas", "numpy") if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import sqlite_utils
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    # A Database loads sqlite_utils' plugins first (importlib.metadata and the entry points of every
    # installed distribution: ~0.03-0.05 s per command); the catalog's connection wants none of them.
    sqlite_utils.plugins._plugins_loaded = True
    return sqlite_utils


sqlite_utils = _import_sqlite_utils()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# Opening a catalog runs ``PRAGMA quick_check`` when the file is at most this big. Measured on this
# project's benchmark catalogs (2 shared cores): 4 MiB 9 ms, 24 MiB 15 ms, 97 MiB 56 ms with the file in
# the page cache; 0.1 s, 0.4 s and 2.0 s cold (the check reads every page). 32 MiB bounds the cost at
# ~20 ms warm (~0.6 s cold); a catalog of registered models is ~1 MiB, an analyzed K=4 family ~5-25 MiB.
# Bigger catalogs are checked in full by `mergepipe doctor` (PRAGMA integrity_check).
QUICK_CHECK_MAX_BYTES = 32 << 20
_CHECKED: set[tuple] = set()  # (path, device, inode, size, mtime) of the files that passed, in this process


class Catalog:
    """A MergePipe catalog at ``path``. Opening creates or migrates the schema.

    A catalog that cannot be written (read-only file, directory or filesystem) opens read-only when its
    schema is current: reading works, and the first write (``transaction()``, ``require_writable()``) is
    a CatalogError saying so (``read_only=True`` opens any catalog so). A catalog file up to QUICK_CHECK_MAX_BYTES is checked with
    ``PRAGMA quick_check`` on open (``check=False`` skips it); a corrupted one is a CatalogError."""

    def __init__(self, path: str | Path = "mergepipe.sqlite", create: bool = True, check: bool = True,
                 read_only: bool = False):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise CatalogError(f"{self.path}: no catalog here (run `mergepipe init-db --db {self.path}`)")
        if self.path.parent and not self.path.parent.exists():
            raise CatalogError(f"{self.path.parent}: directory does not exist")
        self.read_only = read_only_reason(self.path) or ("opened read-only" if read_only else None)
        if self.read_only and not self.path.exists():
            raise CatalogError(f"catalog {self.path}: cannot create it: {self.read_only}")
        conn = connect(self.path, read_only=bool(self.read_only))
        try:
            if not self.read_only:
                conn.execute("PRAGMA journal_mode=WAL")
            if check:
                self._quick_check(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        except CatalogError:
            conn.close()
            raise
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise CatalogError(f"{self.path}: not a MergePipe catalog ({exc})") from None
        self.db = sqlite_utils.Database(conn)
        try:
            if self.read_only:
                self._check_version()
            else:
                self._migrate()
        except BaseException:
            conn.close()
            raise

    def _quick_check(self, conn) -> None:
        """PRAGMA quick_check, when the file is at most QUICK_CHECK_MAX_BYTES and this process has not
        checked it as it is now (the dashboard opens a catalog per page render)."""
        st = self.path.stat()
        key = (str(self.path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size > QUICK_CHECK_MAX_BYTES or key in _CHECKED:
            return
        try:
            rows = [r[0] for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
        except CatalogError as exc:
            if not isinstance(exc.__cause__, sqlite3.DatabaseError) or "malformed" not in str(exc.__cause__):
                raise
            rows = [str(exc.__cause__)]
        if rows != ["ok"]:
            first = " ".join(rows[0].replace("*** in database main ***", "").split())
            raise CatalogError(f"catalog {self.path} is corrupted (quick_check: {first}): run "
                               f"`mergepipe doctor --db {self.path}` and restore it from a backup")
        _CHECKED.add(key)

    def _check_version(self) -> None:
        """Read-only: the schema must be current (it cannot be migrated)."""
        try:
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.OperationalError:
            row = None
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise CatalogError(
                f"{self.path}: catalog schema v{version} is newer than this MergePipe (v{SCHEMA_VERSION})")
        if version < SCHEMA_VERSION:
            raise CatalogError(f"catalog {self.path} is read-only ({self.read_only}) and needs its schema "
                               f"created or migrated to v{SCHEMA_VERSION}: make it writable")

    def require_writable(self) -> None:
        """A CatalogError now when the catalog cannot be written (commands that write call it first)."""
        if self.read_only:
            raise CatalogError(f"catalog {self.path} is read-only ({self.read_only}): nothing can be written "
                               "to it; make the file and its directory writable, or work on a writable copy (--db)")

    @property
    def conn(self) -> sqlite3.Connection:
        return self.db.conn

    def _current(self) -> bool:
        """The catalog is initialized at this schema version (opening it needs no write)."""
        try:
            keys = dict(self.conn.execute(
                "SELECT key, value FROM meta WHERE key IN ('schema_version', 'change_counter')").fetchall())
        except sqlite3.OperationalError:  # no meta table yet
            return False
        return keys.get("schema_version") == str(SCHEMA_VERSION) and "change_counter" in keys

    def _migrate(self) -> None:
        # A current catalog opens without writing (a full disk or a busy writer does not stop reading).
        if self._current():
            return
        # Opening a catalog is not a change: no change-counter bump (the dashboard polls the counter).
        with self.transaction(bump=False):
            for stmt in SCHEMA:
                self.conn.execute(stmt)
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = int(row[0]) if row else SCHEMA_VERSION
            if version > SCHEMA_VERSION:
                raise CatalogError(
                    f"{self.path}: catalog schema v{version} is newer than this MergePipe (v{SCHEMA_VERSION})"
                )
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for stmt in MIGRATIONS.get(v, []):
                    stmt(self.conn) if callable(stmt) else self.conn.execute(stmt)
            self.conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
            self.conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('change_counter', '0')")

    @contextmanager
    def transaction(self, bump: bool = True):
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception; bumps the change counter."""
        if self.conn.in_transaction:
            yield
            return
        self.require_writable()
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            if bump:
                self.conn.execute(
                    "UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'change_counter'"
                )
            self.conn.execute("COMMIT")
        except BaseException:
            # SQLite may already have rolled back (a full disk, an I/O error): keep the first error.
            if self.conn.in_transaction:
                try:
                    self.conn.execute("ROLLBACK")
                except (sqlite3.Error, CatalogError):
                    pass
            raise

    def change_counter(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key='change_counter'").fetchone()[0])

    def close(self) -> None:
        self.conn.close()

    # --- models -------------------------------------------------------------------------------
    def query(self, sql: str, params=()) -> list[dict]:
        return list(self.db.query(sql, params))

    def model(self, model_id: str) -> dict:
        rows = self.query("SELECT * FROM models WHERE id = ?", [model_id])
        if not rows:
            known = ", ".join(r["id"] for r in self.query("SELECT id FROM models ORDER BY id")) or "none"
            raise CatalogError(f"unknown model id {model_id!r} (registered: {known})")
        return rows[0]

    def models_by_id(self, model_ids: list[str]) -> dict[str, dict]:
        """The rows of these models that are registered, in one query (``model`` refuses an unknown id)."""
        ids = list(dict.fromkeys(model_ids))
        if not ids:
            return {}
        return {r["id"]: r for r in self.query(f"SELECT * FROM models WHERE id IN ({','.join('?' * len(ids))})", ids)}

    def has_model(self, model_id: str) -> bool:
        return bool(self.query("SELECT 1 FROM models WHERE id = ?", [model_id]))

    def models(self) -> list[dict]:
        return self.query(
            """SELECT m.*, a.analyzed_at, a.base_fingerprint AS analyzed_base_fingerprint,
                      a.block_bytes AS analyzed_block_bytes
               FROM models m LEFT JOIN analyses a ON a.model_id = m.id ORDER BY m.registered_at, m.id"""
        )

    def tensors(self, model_id: str) -> list[dict]:
        rows = self.query("SELECT * FROM tensors WHERE model_id = ? ORDER BY idx", [model_id])
        for r in rows:
            r["shape"] = tuple(json.loads(r["shape"]))
        return rows

    def grid_block_bytes(self, base_id: str) -> int | None:
        row = self.query("SELECT block_bytes FROM grids WHERE base_id = ?", [base_id])
        return row[0]["block_bytes"] if row else None

    def analysis(self, model_id: str) -> dict | None:
        rows = self.query("SELECT * FROM analyses WHERE model_id = ?", [model_id])
        return rows[0] if rows else None

    def is_analyzed(self, expert_id: str) -> bool:
        """True when the expert's statistics match its current content, its base and the base's grid."""
        m = self.model(expert_id)
        a = self.analysis(expert_id)
        if not a or not m["base_id"]:
            return False
        base = self.model(m["base_id"])
        return (
            a["fingerprint"] == m["fingerprint"]
            and a["base_fingerprint"] == base["fingerprint"]
            and a["block_bytes"] == self.grid_block_bytes(base["id"])
        )

    def blocks(self, model_id: str, tensor: str | None = None, with_sketch: bool = False) -> list[dict]:
        cols = "*" if with_sketch else (
            "model_id, tensor, block, row_start, row_end, offset, nbytes, delta_l2, delta_l1, "
            "delta_max_abs, delta_nnz"
        )
        sql = f"SELECT {cols} FROM blocks WHERE model_id = ?"
        params: list = [model_id]
        if tensor is not None:
            sql += " AND tensor = ?"
            params.append(tensor)
        order = {r["name"]: r["idx"] for r in self.query("SELECT name, idx FROM tensors WHERE model_id=?", [model_id])}
        rows = self.query(sql, params)
        rows.sort(key=lambda r: (order.get(r["tensor"], 0), r["block"]))
        return rows

    def tensor_stats(self, model_id: str) -> dict[str, dict]:
        rows = self.query("SELECT * FROM tensor_stats WHERE model_id = ?", [model_id])
        out = {}
        for r in rows:
            r["topk"] = unpack(r.get("topk"))
            r["thresholds"] = {float(k): v for k, v in json.loads(unpack(r["thresholds"]) or "{}").items()}
            out[r["tensor"]] = r
        return out

    def experts_of(self, base_id: str) -> list[str]:
        return [r["id"] for r in self.query("SELECT id FROM models WHERE base_id = ? ORDER BY id", [base_id])]

    def totals(self) -> dict:
        q = lambda sql: self.conn.execute(sql).fetchone()[0]  # noqa: E731
        return {
            "models": q("SELECT COUNT(*) FROM models"),
            "experts_analyzed": q("SELECT COUNT(*) FROM analyses"),
            "blocks": q("SELECT COUNT(*) FROM blocks"),
            "model_bytes": q("SELECT COALESCE(SUM(bytes), 0) FROM models"),
            "plans": q("SELECT COUNT(*) FROM plans"),
            "snapshots": q("SELECT COUNT(*) FROM snapshots"),
            "runs": q("SELECT COUNT(*) FROM runs"),
        }
