"""The Run page: merge and analyze runs with their progress."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.dashboard.formatting import fmt_bytes, fmt_seconds
from mergepipe.dashboard.paths import default_out


ACTIVE = ("queued", "running")
# --- runs ------------------------------------------------------------------------------------------
def _parse_ts(ts: str | None) -> float | None:
    if not ts:
        return None
    try:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def effective_status(run: dict) -> str:
    """The run's status, with a queued/running run whose process is gone reported as failed."""
    if run["status"] in ACTIVE and run["pid"] and not api.run_alive(run):
        return "failed"
    return run["status"]


def run_progress(run: dict, now_ts: float | None = None) -> dict:
    """Progress of a run row for display: fraction, text, elapsed, running."""
    status = effective_status(run)
    done, total = int(run["blocks_done"] or 0), int(run["blocks_total"] or 0)
    if status == "succeeded":
        frac = 1.0
    else:
        frac = min(1.0, done / total) if total else 0.0
    start = _parse_ts(run["started_at"])
    end = _parse_ts(run["finished_at"]) if status not in ACTIVE else None
    if end is None:
        end = now_ts if now_ts is not None else time.time()
    elapsed = max(0.0, end - start) if start is not None else None
    if run.get("kind") == "evaluate":
        n = len([m for m in (run["model_id"] or "").split(",") if m])
        text = f"evaluate {run['model_id']}: {frac:.0%} ({n} model{'s' if n != 1 else ''})"
        detail = "perplexity on a held-out text and/or accuracy on a task suite"
    elif run.get("kind") == "analyze":
        n = len([m for m in (run["model_id"] or "").split(",") if m])
        text = f"analyze {run['model_id']}: {frac:.0%} ({n} model{'s' if n != 1 else ''})"
        detail = f"{fmt_bytes(run['expert_bytes_done'])} of the current model read"
    else:
        text = f"{done}/{total} blocks" if total else ("starting..." if status in ACTIVE else "-")
        detail = (f"expert read {fmt_bytes(run['expert_bytes_done'])} of {fmt_bytes(run['expert_bytes_planned'])} "
                  f"planned")
    return {"id": run["id"], "kind": run.get("kind") or "merge", "status": status, "fraction": frac,
            "text": text, "detail": detail, "elapsed": elapsed, "elapsed_text": fmt_seconds(elapsed),
            "running": status in ACTIVE, "snapshot_id": run.get("snapshot_id"), "error": run.get("error"),
            "blocks_done": done, "blocks_total": total,
            "bytes_done": int(run["expert_bytes_done"] or 0), "bytes_planned": int(run["expert_bytes_planned"] or 0)}


def runs(cat: Catalog, kind: str | None = None, limit: int = 50) -> list[dict]:
    return api.runs(cat, kind, limit)


def runs_df(cat: Catalog, kind: str | None = None, limit: int = 50) -> pd.DataFrame:
    rows = []
    for r in runs(cat, kind, limit):
        p = run_progress(r)
        rows.append({"run": r["id"], "kind": p["kind"], "status": p["status"], "progress": round(100 * p["fraction"], 1),
                     "model": r["model_id"], "plan": r["plan_id"] or "", "out": r["out"] or "",
                     "snapshot": r["snapshot_id"] or "", "started": r["started_at"], "elapsed": p["elapsed_text"],
                     "error": r["error"] or ""})
    cols = ["run", "kind", "status", "progress", "model", "plan", "out", "snapshot", "started", "elapsed", "error"]
    return pd.DataFrame(rows, columns=cols)


def latest_run(cat: Catalog, kind: str) -> dict | None:
    rows = runs(cat, kind, 1)
    return rows[0] if rows else None


def next_out(cat: Catalog, db, plan_id: str) -> Path:
    """The Run page's default output directory for a plan: merged/merge-<plan>-<n> beside the catalog, ``n``
    the runs and snapshots so far plus one, counted on past any folder that exists already."""
    n = api.output_number(cat)
    out = default_out(db, plan_id, n)
    while out.exists():
        n += 1
        out = default_out(db, plan_id, n)
    return out
