"""Connections to the catalog file: opening it (read-only where it cannot be written), and every
statement run through a cursor that turns faults of the file or its disk (full, read-only, corrupted,
I/O) into CatalogErrors that say what to do."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from mergepipe.errors import CatalogError


# SQLite primary result codes that are faults of the catalog file or its disk, not of the request.
_SQLITE_FAULTS = {
    13: ("SQLITE_FULL", "database or disk is full",
         "free space on its filesystem and retry (the change was rolled back)"),
    8: ("SQLITE_READONLY", "attempt to write a readonly database",
        "make the file and its directory writable, or work on a writable copy (--db)"),
    14: ("SQLITE_CANTOPEN", "unable to open database file",
         "check that the file and its directory exist and are readable and writable"),
    11: ("SQLITE_CORRUPT", "database disk image is malformed",
         "it is corrupted: run `mergepipe doctor --db {path}` and restore it from a backup"),
    26: ("SQLITE_NOTADB", "file is not a database",
         "it is not a MergePipe catalog, or is corrupted: check --db, or restore it from a backup"),
    10: ("SQLITE_IOERR", "disk I/O error", "check the disk and its free space, then retry"),
}


def catalog_fault(path, exc: BaseException) -> CatalogError | None:
    """The CatalogError for an SQLite error caused by the catalog file or its disk, else None."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    text = str(exc)
    if code is not None:
        fault = _SQLITE_FAULTS.get(code & 0xFF)
    else:  # Python < 3.11: match SQLite's message
        fault = next((f for f in _SQLITE_FAULTS.values() if text.startswith(f[1])), None)
    if fault is None:
        return None
    name, _, todo = fault
    return CatalogError(f"catalog {path}: {text} ({name}): {todo.format(path=path)}")


class _Cursor(sqlite3.Cursor):
    """Every statement of the catalog runs through here: file and disk faults become CatalogErrors."""

    def _fault(self, exc):
        err = catalog_fault(self.connection.path, exc)
        if err is None:
            raise exc
        raise err from exc

    def execute(self, *args):
        try:
            return super().execute(*args)
        except sqlite3.Error as exc:
            self._fault(exc)

    def executemany(self, *args):
        try:
            return super().executemany(*args)
        except sqlite3.Error as exc:
            self._fault(exc)

    def executescript(self, *args):
        try:
            return super().executescript(*args)
        except sqlite3.Error as exc:
            self._fault(exc)

    def __next__(self):
        try:
            return super().__next__()
        except sqlite3.Error as exc:
            self._fault(exc)

    def fetchone(self):
        try:
            return super().fetchone()
        except sqlite3.Error as exc:
            self._fault(exc)

    def fetchmany(self, *args):
        try:
            return super().fetchmany(*args)
        except sqlite3.Error as exc:
            self._fault(exc)

    def fetchall(self):
        try:
            return super().fetchall()
        except sqlite3.Error as exc:
            self._fault(exc)


class _Connection(sqlite3.Connection):
    """The catalog's connection: statements run on :class:`_Cursor` (sqlite_utils uses these methods)."""

    path = "?"

    def cursor(self, factory=_Cursor):
        return super().cursor(factory)

    def execute(self, sql, parameters=()):
        return self.cursor().execute(sql, parameters)

    def executemany(self, sql, parameters):
        return self.cursor().executemany(sql, parameters)

    def executescript(self, script):
        return self.cursor().executescript(script)


def read_only_reason(path: Path) -> str | None:
    """Why the catalog at ``path`` cannot be written (a read-only file, directory or filesystem), or None.
    (os.access reports a read-only filesystem even to root; root ignores permission bits.)"""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        if directory.exists() and os.statvfs(directory).f_flag & os.ST_RDONLY:
            return f"{directory} is on a read-only filesystem"
    except OSError:
        pass
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    if directory.exists() and not os.access(directory, os.W_OK):
        return f"its directory {directory} is read-only"
    return None


def connect(path: Path, read_only: bool = False) -> _Connection:
    """A connection to the catalog file (read-only: opened ``mode=ro``, ``immutable`` when SQLite could
    not create the WAL's -shm file next to it); open failures are CatalogErrors."""
    try:
        if read_only:
            uri = f"file:{quote(str(path.absolute()))}?mode=ro"
            wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
            if not os.access(path.parent if str(path.parent) else ".", os.W_OK) and not shm.exists():
                if not wal.exists() or wal.stat().st_size == 0:
                    uri += "&immutable=1"  # nothing can write it, and no WAL holds more than the file
            conn = sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False, isolation_level=None,
                                   factory=_Connection)
        else:
            conn = sqlite3.connect(str(path), timeout=30, check_same_thread=False, isolation_level=None,
                                   factory=_Connection)
    except sqlite3.Error as exc:
        raise (catalog_fault(path, exc) or CatalogError(f"catalog {path}: {exc}")) from exc
    conn.path = str(path)
    return conn
