"""Merge sweeps (schema v9): one ``sweeps`` row per sweep (its config, executor and state) and one
``sweep_points`` row per point (its settings, plan, snapshot, realized expert bytes, time and quality)."""

from __future__ import annotations

import json
import os

from mergepipe.catalog.db import Catalog, now

POINT_COLUMNS = ("plan_id", "snapshot_id", "model_id", "expert_read", "budget_bytes", "full_expert_bytes",
                 "error_bound", "seconds", "metric", "quality", "error")


def start_sweep(catalog: Catalog, name: str, config: dict, executor: str, points: list[dict]) -> str:
    """Record a sweep and its points (all ``planned``); returns the sweep id."""
    sweep_id = "sweep-" + os.urandom(5).hex()
    with catalog.transaction():
        catalog.conn.execute(
            "INSERT INTO sweeps (id, name, config, executor, status, points, started_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [sweep_id, name, json.dumps(config, sort_keys=True), executor, "running", len(points), now()])
        for i, settings in enumerate(points):
            catalog.conn.execute("INSERT INTO sweep_points (sweep_id, point, settings, status) VALUES (?, ?, ?, ?)",
                                 [sweep_id, i, json.dumps(settings, sort_keys=True), "planned"])
    return sweep_id


def record_point(catalog: Catalog, sweep_id: str, point: int, status: str, **values) -> None:
    unknown = set(values) - set(POINT_COLUMNS)
    if unknown:
        raise ValueError(f"unknown sweep point columns: {sorted(unknown)}")
    cols = ["status", *values]
    with catalog.transaction():
        catalog.conn.execute(f"UPDATE sweep_points SET {', '.join(c + ' = ?' for c in cols)} "
                             "WHERE sweep_id = ? AND point = ?", [status, *values.values(), sweep_id, point])


def finish_sweep(catalog: Catalog, sweep_id: str, status: str) -> None:
    with catalog.transaction():
        catalog.conn.execute("UPDATE sweeps SET status = ?, finished_at = ? WHERE id = ?", [status, now(), sweep_id])


def sweeps(catalog: Catalog) -> list[dict]:
    """Every sweep, newest first."""
    return catalog.query("SELECT * FROM sweeps ORDER BY started_at DESC, id")


def sweep_points(catalog: Catalog, sweep_id: str) -> list[dict]:
    """A sweep's points in order, settings decoded."""
    rows = catalog.query("SELECT * FROM sweep_points WHERE sweep_id = ? ORDER BY point", [sweep_id])
    return [{**r, "settings": json.loads(r["settings"])} for r in rows]
