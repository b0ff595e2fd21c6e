"""The home page: catalog totals (its recent runs and snapshots come from runs.py and snapshots.py)."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog
from mergepipe.dashboard.formatting import fmt_bytes


def totals(cat: Catalog) -> dict:
    """Catalog totals with human-readable sizes (for the home page metrics)."""
    t = cat.totals()
    t["model_size"] = fmt_bytes(t["model_bytes"])
    return t


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
