"""Merge recipes (named, versioned JSON), the snapshots their runs published, and the watcher's state."""

from __future__ import annotations

import json

from mergepipe.catalog.db import Catalog, now


def save_recipe(catalog: Catalog, name: str, body: dict) -> int:
    """Store ``body`` as the next version of recipe ``name`` (the same body again keeps its version)."""
    text = json.dumps(body, sort_keys=True)
    latest = recipe_row(catalog, name)
    if latest and latest["json"] == text:
        return latest["version"]
    version = (latest["version"] if latest else 0) + 1
    with catalog.transaction():
        catalog.conn.execute("INSERT INTO recipes (name, version, json, created_at) VALUES (?, ?, ?, ?)",
                             [name, version, text, now()])
    return version


def recipe_row(catalog: Catalog, name: str, version: int | None = None) -> dict | None:
    if version is None:
        rows = catalog.query("SELECT * FROM recipes WHERE name = ? ORDER BY version DESC LIMIT 1", [name])
    else:
        rows = catalog.query("SELECT * FROM recipes WHERE name = ? AND version = ?", [name, version])
    return rows[0] if rows else None


def recipe_rows(catalog: Catalog) -> list[dict]:
    """The latest version of every recipe, with its run count and last snapshot."""
    return catalog.query(
        """SELECT r.name, r.version, r.json, r.created_at,
                  (SELECT COUNT(*) FROM recipe_snapshots s WHERE s.name = r.name) AS runs,
                  (SELECT s.snapshot_id FROM recipe_snapshots s WHERE s.name = r.name ORDER BY s.rowid DESC LIMIT 1)
                  AS last_snapshot
           FROM recipes r WHERE r.version = (SELECT MAX(version) FROM recipes q WHERE q.name = r.name)
           ORDER BY r.name""")


def record_recipe_snapshot(catalog: Catalog, name: str, version: int, snapshot_id: str, mode: str) -> None:
    with catalog.transaction():
        catalog.conn.execute("INSERT INTO recipe_snapshots (name, version, snapshot_id, mode, created_at) "
                             "VALUES (?, ?, ?, ?, ?)", [name, version, snapshot_id, mode, now()])


def last_recipe_snapshot(catalog: Catalog, name: str) -> dict | None:
    """The newest snapshot a run of recipe ``name`` published that is still in the catalog."""
    rows = catalog.query("""SELECT r.* FROM recipe_snapshots r JOIN snapshots s ON s.id = r.snapshot_id
                            WHERE r.name = ? ORDER BY r.rowid DESC LIMIT 1""", [name])
    return rows[0] if rows else None


def recipe_run_count(catalog: Catalog, name: str) -> int:
    return catalog.query("SELECT COUNT(*) AS n FROM recipe_snapshots WHERE name = ?", [name])[0]["n"]


# --- the watcher's state ------------------------------------------------------------------------------------
def watch_seen(catalog: Catalog) -> dict[str, dict]:
    return {r["path"]: r for r in catalog.query("SELECT * FROM watch_seen")}


def set_watch_seen(catalog: Catalog, path: str, model_id: str, fingerprint: str, status: str) -> None:
    with catalog.transaction():
        catalog.conn.execute("INSERT OR REPLACE INTO watch_seen (path, model_id, fingerprint, status, updated_at) "
                             "VALUES (?, ?, ?, ?, ?)", [path, model_id, fingerprint, status, now()])
