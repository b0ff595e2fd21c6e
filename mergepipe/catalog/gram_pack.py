"""The packed Gram rows of catalog schema v13 (catalog/gram.py reads and writes them): one row per (base, tensor,
a) holding a's values against every b as float64, with the b ids; and the migration of a v12 table to them.
Imports nothing from the catalog, so the schema's migration can use it."""

from __future__ import annotations

import json
from functools import lru_cache
from itertools import groupby
from operator import itemgetter

import numpy as np


def pack(values: dict) -> tuple[str, bytes]:
    """One row's ``b`` and ``value`` columns from {b: value} (None or NaN: no value). The values as SQLite
    stored a REAL before v13: -0.0 as 0.0, every NaN as no value (one NaN)."""
    bs = sorted(values)  # SQLite's BINARY order (the UTF-8 bytes') is Python's order of str
    v = np.array([np.nan if values[b] is None else values[b] for b in bs], dtype=np.float64) + 0.0
    v[np.isnan(v)] = np.nan
    return json.dumps(bs), v.astype("<f8").tobytes()


@lru_cache(maxsize=4096)
def _ids(text: str) -> tuple[str, ...]:
    return tuple(json.loads(text))


def unpack(b: str, value: bytes) -> dict[str, float | None]:
    """{b: value} of one row (None: no value), in b order."""
    return dict(zip(_ids(b), (None if v != v else v for v in np.frombuffer(value, "<f8").tolist())))


def migrate_packed(conn, columns: str) -> None:
    """Schema v13 (schema.py MIGRATIONS): the v12 table (one row per (base, tensor, a, b)) rebuilt packed,
    in the caller's transaction (``columns``: the v13 table's). A table already packed is left as it is."""
    if "b" not in {r[1] for r in conn.execute("PRAGMA table_info(gram)").fetchall() if r[5]}:
        return
    conn.execute(f"CREATE TABLE gram_v13 ({columns}) WITHOUT ROWID")
    cur = conn.execute("SELECT base_id, tensor, a, b, value FROM gram ORDER BY base_id, tensor, a, b")
    batch = []
    for key, rows in groupby(cur, key=itemgetter(0, 1, 2)):
        batch.append((*key, *pack({r[3]: r[4] for r in rows})))
        if len(batch) >= 2000:
            conn.executemany("INSERT INTO gram_v13 (base_id, tensor, a, b, value) VALUES (?, ?, ?, ?, ?)", batch)
            batch = []
    conn.executemany("INSERT INTO gram_v13 (base_id, tensor, a, b, value) VALUES (?, ?, ?, ?, ?)", batch)
    conn.execute("DROP TABLE gram")
    conn.execute("ALTER TABLE gram_v13 RENAME TO gram")
