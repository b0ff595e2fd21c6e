"""Saved plans: one row per plan with its JSON."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog, now


def upsert_plan(catalog: Catalog, row: dict) -> None:
    """Insert or replace a plan row (``id``, ``base_id``, ``operator``, byte counts, bound, ``json``)."""
    with catalog.transaction():
        catalog.db["plans"].upsert({"id": row["id"], "created_at": now(), **{k: v for k, v in row.items() if k != "id"}},
                                   pk="id")


def plan_json(catalog: Catalog, ref: str) -> str | None:
    """The JSON of the plan ``ref`` (an id, or an id without its ``plan-`` prefix); None if unknown."""
    rows = catalog.query("SELECT json FROM plans WHERE id = ? OR id = ?", [ref, "plan-" + ref])
    return rows[0]["json"] if rows else None


def find_plan_id(catalog: Catalog, ref: str) -> str | None:
    """The id of the plan ``ref`` names (with or without its ``plan-`` prefix); None if unknown."""
    rows = catalog.query("SELECT id FROM plans WHERE id = ? OR id = ?", [ref, "plan-" + ref])
    return rows[0]["id"] if rows else None


def has_plan(catalog: Catalog, plan_id: str) -> bool:
    """True when a plan with exactly this id is saved."""
    return bool(catalog.query("SELECT 1 FROM plans WHERE id = ?", [plan_id]))


def plan_rows(catalog: Catalog) -> list[dict]:
    """Every saved plan, newest first."""
    return catalog.query("SELECT id, created_at, base_id, operator, budget_bytes, full_expert_bytes, expert_read_bytes, "
                         "error_bound, json FROM plans ORDER BY created_at DESC, id")


def plan_bounds(catalog: Catalog) -> dict[str, float | None]:
    """plan id -> its absolute error bound (None for operators without one)."""
    return {r["id"]: r["error_bound"] for r in catalog.query("SELECT id, error_bound FROM plans")}
