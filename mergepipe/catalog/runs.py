"""Runs (merge and analyze processes with their progress) and publish transactions (txns)."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog, now


# --- runs --------------------------------------------------------------------------------------------
def active_runs_at(catalog: Catalog, out: str) -> list[dict]:
    return catalog.query("SELECT * FROM runs WHERE out = ? AND status IN ('queued', 'running')", [out])


def insert_merge_run(catalog: Catalog, plan_id: str, out: str, model_id: str, log_path: str | None,
                     planned: int) -> int:
    cur = catalog.conn.execute(
        "INSERT INTO runs (plan_id, out, model_id, status, log_path, started_at, updated_at, expert_bytes_planned)"
        " VALUES (?, ?, ?, 'queued', ?, ?, ?, ?)", [plan_id, out, model_id, log_path, now(), now(), planned])
    return int(cur.lastrowid)


def active_analyze_runs(catalog: Catalog) -> list[dict]:
    return catalog.query("SELECT id, pid FROM runs WHERE kind = 'analyze' AND status IN ('queued', 'running')")


def insert_analyze_run(catalog: Catalog, model_ids: list[str]) -> int:
    cur = catalog.conn.execute(
        "INSERT INTO runs (kind, model_id, status, started_at, updated_at) VALUES ('analyze', ?, 'queued', ?, ?)",
        [",".join(model_ids), now(), now()])
    return int(cur.lastrowid)


def set_run_process(catalog: Catalog, run_id: int, pid: int, log_path: str) -> None:
    catalog.conn.execute("UPDATE runs SET pid = ?, log_path = ? WHERE id = ?", [pid, log_path, run_id])


def mark_run_running(catalog: Catalog, run_id: int, pid: int) -> None:
    catalog.conn.execute("UPDATE runs SET status='running', pid=?, updated_at=? WHERE id=?", [pid, now(), run_id])


def update_run_progress(catalog: Catalog, run_id: int, done: int, total: int, expert_bytes: int) -> None:
    catalog.conn.execute(
        "UPDATE runs SET blocks_done=?, blocks_total=?, expert_bytes_done=?, updated_at=? WHERE id=?",
        [done, total, expert_bytes, now(), run_id])


def mark_run_succeeded(catalog: Catalog, run_id: int) -> None:
    catalog.conn.execute("UPDATE runs SET status='succeeded', finished_at=?, updated_at=? WHERE id=?",
                         [now(), now(), run_id])


def mark_run_published(catalog: Catalog, run_id: int, snapshot_id: str) -> None:
    catalog.conn.execute(
        "UPDATE runs SET status='succeeded', snapshot_id=?, finished_at=?, updated_at=? WHERE id=?",
        [snapshot_id, now(), now(), run_id])


def mark_run_ended(catalog: Catalog, run_id: int, status: str, message: str) -> None:
    catalog.conn.execute("UPDATE runs SET status=?, error=?, finished_at=?, updated_at=? WHERE id=?",
                         [status, message, now(), now(), run_id])


def mark_run_died(catalog: Catalog, run_id: int) -> None:
    catalog.conn.execute(
        "UPDATE runs SET status='failed', error='process died (recovered)', finished_at=? WHERE id=?",
        [now(), run_id])


def run_rows(catalog: Catalog, run_id: int) -> list[dict]:
    return catalog.query("SELECT * FROM runs WHERE id = ?", [run_id])


def unfinished_runs(catalog: Catalog) -> list[dict]:
    return catalog.query("SELECT id, pid FROM runs WHERE status IN ('queued', 'running')")


def list_runs(catalog: Catalog, kind: str | None = None, limit: int = 50) -> list[dict]:
    """The newest runs first, optionally of one kind ('merge' or 'analyze')."""
    sql = "SELECT * FROM runs"
    params: list = []
    if kind:
        sql += " WHERE kind = ?"
        params.append(kind)
    sql += " ORDER BY id DESC LIMIT ?"
    params.append(int(limit))
    return catalog.query(sql, params)


# --- publish transactions ----------------------------------------------------------------------------
def insert_txn(catalog: Catalog, txn_id: str, staging: str, out: str, pid: int) -> None:
    catalog.db["txns"].insert({"id": txn_id, "staging": staging, "out": out, "status": "staging", "pid": pid,
                               "started_at": now()})


def set_txn_status(catalog: Catalog, txn_id: str, status: str, finished: bool = True) -> None:
    """Record a txn's new status (with its finish time unless ``finished`` is False)."""
    if finished:
        catalog.conn.execute("UPDATE txns SET status=?, finished_at=? WHERE id=?", [status, now(), txn_id])
    else:
        catalog.conn.execute("UPDATE txns SET status=? WHERE id=?", [status, txn_id])


def unfinished_txns(catalog: Catalog) -> list[dict]:
    return catalog.query("SELECT * FROM txns WHERE status IN ('staging', 'renamed')")


def txn_rows(catalog: Catalog) -> list[dict]:
    return catalog.query("SELECT * FROM txns ORDER BY started_at, id")
