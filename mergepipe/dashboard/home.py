"""The home page: catalog totals (its recent runs and snapshots come from runs.py and snapshots.py)."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog
from mergepipe.dashboard.formatting import fmt_bytes


def totals(cat: Catalog) -> dict:
    """Catalog totals with human-readable sizes (for the home page metrics)."""
    t = cat.totals()
    t["model_size"] = fmt_bytes(t["model_bytes"])
    return t
