"""Recipe searches (schema v11): one ``searches`` row per search (the file as written, its settings, state and
final report), one ``search_trials`` row per trial (its parameters by name, state, score at its last
fidelity, bytes, seconds, held-out score) and one ``search_steps`` row per merge a trial ran (budget, plan,
score, bound, bytes, seconds). A search killed mid-trial resumes from these rows alone."""

from __future__ import annotations

import json
import os

from mergepipe.catalog.db import Catalog, now

TRIAL_COLUMNS = ("status", "fidelity", "score", "expert_read", "seconds", "error", "holdout", "snapshot_id",
                 "finished_at")
FINISHED = ("complete", "pruned", "failed")


def start_search(catalog: Catalog, name: str, source: dict, settings: dict) -> str:
    search_id = "search-" + os.urandom(5).hex()
    with catalog.transaction():
        catalog.conn.execute(
            "INSERT INTO searches (id, name, source, settings, status, pid, started_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [search_id, name, json.dumps(source, sort_keys=True), json.dumps(settings, sort_keys=True), "running",
             os.getpid(), now()])
    return search_id


def set_search_status(catalog: Catalog, search_id: str, status: str, report: dict | None = None) -> None:
    finished = now() if status != "running" else None
    with catalog.transaction():
        catalog.conn.execute("UPDATE searches SET status = ?, finished_at = ?, pid = ?, report = COALESCE(?, report) "
                             "WHERE id = ?", [status, finished, os.getpid(),
                                              None if report is None else json.dumps(report, sort_keys=True),
                                              search_id])


def start_trial(catalog: Catalog, search_id: str, number: int, params: dict) -> None:
    """Record a trial as running (a trial that was running when its search was killed starts again)."""
    with catalog.transaction():
        catalog.conn.execute("DELETE FROM search_steps WHERE search_id = ? AND number = ?", [search_id, number])
        catalog.conn.execute(
            "INSERT OR REPLACE INTO search_trials (search_id, number, params, status, started_at) VALUES (?, ?, ?, ?, ?)",
            [search_id, number, json.dumps(params, sort_keys=True), "running", now()])


def record_step(catalog: Catalog, search_id: str, number: int, step: int, **values) -> None:
    cols = ["search_id", "number", "step", *values]
    with catalog.transaction():
        catalog.conn.execute(f"INSERT OR REPLACE INTO search_steps ({', '.join(cols)}) "
                             f"VALUES ({', '.join('?' * len(cols))})", [search_id, number, step, *values.values()])


def update_trial(catalog: Catalog, search_id: str, number: int, **values) -> None:
    unknown = set(values) - set(TRIAL_COLUMNS)
    if unknown:
        raise ValueError(f"unknown search trial columns: {sorted(unknown)}")
    with catalog.transaction():
        catalog.conn.execute(f"UPDATE search_trials SET {', '.join(c + ' = ?' for c in values)} "
                             "WHERE search_id = ? AND number = ?", [*values.values(), search_id, number])


def add_lineage_edge(catalog: Catalog, model_id: str, search_id: str) -> None:
    """The lineage edge from a search to a snapshot it published (role ``search``)."""
    with catalog.transaction():
        catalog.db["lineage"].insert({"child_id": model_id, "parent_id": search_id, "role": "search",
                                      "weight": None})


def searches(catalog: Catalog) -> list[dict]:
    """Every search, newest first (settings and report decoded)."""
    return [_decoded(r) for r in catalog.query("SELECT * FROM searches ORDER BY started_at DESC, id")]


def search_row(catalog: Catalog, search_id: str) -> dict | None:
    rows = catalog.query("SELECT * FROM searches WHERE id = ?", [search_id])
    return _decoded(rows[0]) if rows else None


def trials(catalog: Catalog, search_id: str) -> list[dict]:
    """A search's trials in order, parameters decoded, each with its ``steps``."""
    steps: dict[int, list] = {}
    for s in catalog.query("SELECT * FROM search_steps WHERE search_id = ? ORDER BY number, step", [search_id]):
        steps.setdefault(s["number"], []).append(s)
    rows = catalog.query("SELECT * FROM search_trials WHERE search_id = ? ORDER BY number", [search_id])
    return [{**r, "params": json.loads(r["params"]), "steps": steps.get(r["number"], [])} for r in rows]


def _decoded(row: dict) -> dict:
    return {**row, "source": json.loads(row["source"]), "settings": json.loads(row["settings"]),
            "report": json.loads(row["report"]) if row.get("report") else None}
