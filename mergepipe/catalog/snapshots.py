"""Published snapshots, their manifests and the lineage edges between models."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog
from mergepipe.errors import CatalogError


def record_snapshot(catalog: Catalog, snapshot_id: str, model_id: str, plan_id: str, out: str, manifest_hash: str,
                    created_at: str, manifest_json: str, parents: list[dict]) -> None:
    """Insert a snapshot, its manifest and one lineage edge per parent (``id``, ``role``, ``weight``);
    the caller holds the transaction."""
    catalog.db["snapshots"].insert({
        "id": snapshot_id, "model_id": model_id, "plan_id": plan_id, "out": out,
        "manifest_hash": manifest_hash, "created_at": created_at})
    catalog.db["manifests"].insert({"snapshot_id": snapshot_id, "manifest_hash": manifest_hash, "json": manifest_json})
    catalog.db["lineage"].insert_all(
        [{"child_id": model_id, "parent_id": p["id"], "role": p["role"], "weight": p["weight"]} for p in parents])


def manifest_json(catalog: Catalog, ref: str) -> str | None:
    """The stored manifest JSON of a snapshot, by snapshot id or merged model id; None if unknown."""
    rows = catalog.query(
        "SELECT m.json FROM manifests m JOIN snapshots s ON s.id = m.snapshot_id WHERE s.id = ? OR s.model_id = ?",
        [ref, ref])
    return rows[0]["json"] if rows else None


def snapshot_manifest_hash(catalog: Catalog, snapshot_id: str) -> str | None:
    """The manifest hash the catalog records for a snapshot; None if it has no such snapshot."""
    rows = catalog.query("SELECT manifest_hash FROM snapshots WHERE id = ?", [snapshot_id])
    return rows[0]["manifest_hash"] if rows else None


def snapshot_at(catalog: Catalog, out: str) -> bool:
    """True when a published snapshot lives at ``out``."""
    return bool(catalog.query("SELECT 1 FROM snapshots WHERE out = ?", [out]))


def snapshot_count(catalog: Catalog) -> int:
    return len(catalog.query("SELECT id FROM snapshots"))


def snapshot_rows(catalog: Catalog) -> list[dict]:
    """Every snapshot with its plan's operator and byte counts, oldest first."""
    return catalog.query(
        """SELECT s.*, p.operator, p.budget_bytes, p.expert_read_bytes, p.full_expert_bytes
           FROM snapshots s LEFT JOIN plans p ON p.id = s.plan_id ORDER BY s.created_at, s.id""")


def lineage_edges(catalog: Catalog) -> list[dict]:
    """Every lineage edge (child_id, parent_id, role, weight)."""
    return catalog.query("SELECT child_id, parent_id, role, weight FROM lineage ORDER BY child_id, role, parent_id")


def parents_of(catalog: Catalog, model_id: str) -> list[dict]:
    return catalog.query("SELECT parent_id, role, weight FROM lineage WHERE child_id = ? ORDER BY role, parent_id",
                         [model_id])


def children_of(catalog: Catalog, model_id: str) -> list[str]:
    return [r["child_id"] for r in catalog.query(
        "SELECT DISTINCT child_id FROM lineage WHERE parent_id = ? ORDER BY child_id", [model_id])]


# --- tags, notes and deletion (housekeeping) -------------------------------------------------------------
def snapshot_row(catalog: Catalog, ref: str) -> dict | None:
    """A snapshot by id or merged model id; None if unknown."""
    rows = catalog.query("SELECT * FROM snapshots WHERE id = ? OR model_id = ?", [ref, ref])
    return rows[0] if rows else None


def snapshot_labels(catalog: Catalog) -> dict[str, dict]:
    """snapshot id -> {'tags': [...], 'note': str} for the snapshots that have any."""
    import json
    return {r["snapshot_id"]: {"tags": json.loads(r["tags"] or "[]"), "note": r["note"] or ""}
            for r in catalog.query("SELECT snapshot_id, tags, note FROM snapshot_labels")}


def set_snapshot_labels(catalog: Catalog, snapshot_id: str, tags: list[str], note: str) -> None:
    import json
    from mergepipe.catalog.db import now
    if snapshot_row(catalog, snapshot_id) is None:
        raise CatalogError(f"unknown snapshot {snapshot_id!r}")
    with catalog.transaction():
        catalog.conn.execute(
            "INSERT OR REPLACE INTO snapshot_labels (snapshot_id, tags, note, updated_at) VALUES (?, ?, ?, ?)",
            [snapshot_id, json.dumps(list(tags)), note, now()])


def snapshot_dependents(catalog: Catalog, model_id: str) -> list[str]:
    """Models whose lineage needs ``model_id``: merges that took it as an input, models registered on it
    as their base."""
    rows = catalog.query("SELECT child_id AS id FROM lineage WHERE parent_id = ? UNION "
                         "SELECT id FROM models WHERE base_id = ? ORDER BY id", [model_id, model_id])
    return [r["id"] for r in rows]


def delete_snapshot_rows(catalog: Catalog, snapshot_id: str, model_id: str) -> None:
    """Remove a snapshot and its merged model from the catalog (the caller holds the transaction):
    the snapshot, manifest, labels, its lineage edges as a child, the model, its tensors and any statistics
    of it. Runs keep their history."""
    ex = catalog.conn.execute
    for sql, arg in (("DELETE FROM snapshots WHERE id = ?", snapshot_id),
                     ("DELETE FROM manifests WHERE snapshot_id = ?", snapshot_id),
                     ("DELETE FROM snapshot_labels WHERE snapshot_id = ?", snapshot_id),
                     ("DELETE FROM lineage WHERE child_id = ?", model_id),
                     ("DELETE FROM tensors WHERE model_id = ?", model_id),
                     ("DELETE FROM blocks WHERE model_id = ?", model_id),
                     ("DELETE FROM tensor_stats WHERE model_id = ?", model_id),
                     ("DELETE FROM analyses WHERE model_id = ?", model_id),
                     ("DELETE FROM compacts WHERE model_id = ?", model_id),
                     ("DELETE FROM compact_blocks WHERE model_id = ?", model_id),
                     ("DELETE FROM evaluations WHERE model_id = ?", model_id),
                     ("DELETE FROM models WHERE id = ?", model_id)):
        ex(sql, [arg])


def snapshot_ids_in_order(catalog: Catalog) -> list[str]:
    """Snapshot ids in the order they were published (created_at has one-second resolution)."""
    return [r["id"] for r in catalog.query("SELECT id FROM snapshots ORDER BY rowid")]
