"""The Lineage page: the DAG of models and where each node leads."""

from __future__ import annotations

import pandas as pd

from mergepipe import api
from mergepipe.api import Catalog


# --- lineage -------------------------------------------------------------------------------------------
def lineage_dot(cat: Catalog, model_id: str | None = None) -> str:
    return api.lineage_dot(api.lineage(cat, model_id))


def lineage_nodes_df(cat: Catalog) -> pd.DataFrame:
    g = api.lineage(cat)
    parents: dict[str, list[str]] = {}
    for e in g["edges"]:
        w = f" w={e['weight']:g}" if e["weight"] is not None else ""
        parents.setdefault(e["child_id"], []).append(f"{e['parent_id']} ({e['role']}{w})")
    rows = [{"node": n["id"], "kind": n["kind"], "snapshot": n["snapshot_id"] or "", "base": n["base_id"] or "",
             "parents": ", ".join(parents.get(n["id"], []))} for n in g["nodes"]]
    return pd.DataFrame(rows, columns=["node", "kind", "snapshot", "base", "parents"])


def node_target(cat: Catalog, node_id: str) -> tuple[str, str]:
    """Where a lineage node opens: ('snapshot', snapshot id) or ('model', model id)."""
    m = cat.model(node_id)
    if m["snapshot_id"]:
        return "snapshot", m["snapshot_id"]
    return "model", m["id"]
