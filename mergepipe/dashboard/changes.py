""""What changed since snapshot X": every later snapshot on the same base, diffed against X (experts added,
removed, reweighted, re-trained; bytes read; error bound; quality scores where evaluated)."""

from __future__ import annotations

import pandas as pd

from mergepipe import api
from mergepipe.api import Catalog

CHANGE_COLUMNS = ["snapshot", "model", "created", "extends X", "added", "removed", "reweighted", "re-trained",
                  "settings", "read", "bound", "scores"]


def _fmt_bound(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def changes_since(cat: Catalog, ref: str) -> pd.DataFrame:
    """One row per snapshot published after ``ref`` on the same base, with its diff from ``ref``."""
    start = api.load_manifest(cat, ref)
    base = start.core["inputs"]["base"]["id"]
    rows = []
    order = api.snapshot_ids_in_order(cat)
    rows_by_id = {s["id"]: s for s in api.snapshots(cat)}
    for sid in order[order.index(start.snapshot_id) + 1:]:
        s = rows_by_id[sid]
        d = api.diff_snapshots(cat, start.snapshot_id, s["id"])
        if d["b"]["base"] != base:
            continue
        scores = ", ".join(f"{k} {_fmt_bound(v['from'])} -> {_fmt_bound(v['to'])}" for k, v in d["scores"].items())
        rows.append({
            "snapshot": s["id"], "model": s["model_id"], "created": s["created_at"],
            "extends X": d["b"]["extends"] == start.snapshot_id,
            "added": ", ".join(f"{e['id']} ({e['weight']})" for e in d["added"]),
            "removed": ", ".join(e["id"] for e in d["removed"]),
            "reweighted": ", ".join(f"{e['id']} {e['from']} -> {e['to']}" for e in d["reweighted"]),
            "re-trained": ", ".join(e["id"] for e in d["retrained"]),
            "settings": "; ".join(f"{k} {v['from']} -> {v['to']}" for k, v in d["settings"].items()),
            "read": api.human_bytes(d["b"]["read_bytes"]),
            "bound": f"{_fmt_bound(d['a']['bound'])} -> {_fmt_bound(d['b']['bound'])}",
            "scores": scores,
        })
    return pd.DataFrame(rows, columns=CHANGE_COLUMNS)
