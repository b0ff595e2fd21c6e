"""The home page: catalog totals and the last merges and runs (its snapshots come from snapshots.py).

A run (catalog/runs.py) is a process the dashboard started, with its progress. A merge made in the foreground
(`mergepipe merge`, the API, `mergepipe demo`) has no run: its record is the snapshot it published. Home counts
and lists both, so a catalog whose snapshots were made from the command line does not read "no runs"."""

from __future__ import annotations

import pandas as pd

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.dashboard.formatting import fmt_bytes
from mergepipe.dashboard.runs import runs_df

ALL = 1 << 62  # api.runs' limit when every run is wanted


def merges_without_run(cat: Catalog) -> list[dict]:
    """The snapshots no dashboard run published (newest first): merges made in the foreground."""
    by_runs = {r["snapshot_id"] for r in api.runs(cat, "merge", ALL) if r["snapshot_id"]}
    return [s for s in reversed(api.snapshots(cat)) if s["id"] not in by_runs]


def totals(cat: Catalog) -> dict:
    """Catalog totals with human-readable sizes (for the home page metrics); ``runs`` counts the dashboard's runs
    and the foreground merges (one per snapshot no run published)."""
    t = cat.totals()
    t["model_size"] = fmt_bytes(t["model_bytes"])
    t["runs"] += len(merges_without_run(cat))
    return t


def _merge_row(s: dict) -> dict:
    return {"run": None, "kind": "merge", "status": "succeeded", "progress": 100.0, "model": s["model_id"],
            "plan": s["plan_id"] or "", "out": s["out"] or "", "snapshot": s["id"], "started": s["created_at"],
            "elapsed": None, "error": ""}


def activity_df(cat: Catalog, limit: int = 10) -> pd.DataFrame:
    """The newest ``limit`` runs and foreground merges, newest first (a foreground merge has no run number)."""
    runs = runs_df(cat, limit=limit)
    rows = runs.to_dict("records") + [_merge_row(s) for s in merges_without_run(cat)[:limit]]
    df = pd.DataFrame(rows, columns=runs.columns)
    return df.sort_values("started", ascending=False, kind="stable").head(limit).reset_index(drop=True)


def getting_started(db_path, latest_snapshot: str | None = None, empty: bool = False) -> str:
    """The command lines for this catalog (shell), for the Home page's getting-started panel."""
    import shlex
    db = shlex.quote(str(db_path))
    lines = [f"export MERGEPIPE_DB={db}   # or add --db {db} to each command"]
    if empty:
        lines += ["mergepipe register path/to/base --model-id base",
                  "mergepipe register path/to/expert_a path/to/expert_b --base base",
                  "mergepipe analyze"]
    lines += ["mergepipe models", "mergepipe snapshots"]
    if latest_snapshot:
        lines += [f"mergepipe explain {latest_snapshot}", f"mergepipe explain {latest_snapshot} --as-mergekit",
                  f"mergepipe verify {latest_snapshot}"]
    lines.append(f"mergepipe dashboard --db {db}")
    return "\n".join(lines)
