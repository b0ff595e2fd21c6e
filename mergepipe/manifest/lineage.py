"""Lineage: the DAG of models (bases, experts, merged snapshots) recorded with each published snapshot."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.snapshots import lineage_edges


def lineage(catalog: Catalog, model_id: str | None = None) -> dict:
    """Nodes and edges of the lineage DAG (all of it, or the ancestors and descendants of one model)."""
    edges = lineage_edges(catalog)
    if model_id is not None:
        catalog.model(model_id)
        keep = {model_id}
        for direction in ("up", "down"):
            frontier = {model_id}
            while frontier:
                if direction == "up":
                    nxt = {e["parent_id"] for e in edges if e["child_id"] in frontier}
                else:
                    nxt = {e["child_id"] for e in edges if e["parent_id"] in frontier}
                frontier = nxt - keep
                keep |= nxt
        edges = [e for e in edges if e["child_id"] in keep and e["parent_id"] in keep]
        node_ids = keep
    else:
        node_ids = {m["id"] for m in catalog.models()}
    nodes = [{"id": m["id"], "kind": "snapshot" if m["snapshot_id"] else ("expert" if m["base_id"] else "base"),
              "snapshot_id": m["snapshot_id"], "base_id": m["base_id"]}
             for m in catalog.models() if m["id"] in node_ids]
    return {"nodes": nodes, "edges": edges}


def lineage_dot(graph: dict) -> str:
    """Graphviz DOT source of a lineage graph (rendered by st.graphviz_chart, no binary needed)."""
    shapes = {"base": "box", "expert": "ellipse", "snapshot": "doubleoctagon"}
    lines = ["digraph lineage {", "  rankdir=LR;", '  node [fontname="Helvetica", fontsize=10];']
    for n in graph["nodes"]:
        label = n["id"] + (f"\\n{n['snapshot_id']}" if n["snapshot_id"] else "")
        lines.append(f'  "{_dot(n["id"])}" [label="{_dot(label)}", shape={shapes[n["kind"]]}];')
    for e in graph["edges"]:
        lbl = e["role"] + (f" w={e['weight']:g}" if e["weight"] is not None else "")
        lines.append(f'  "{_dot(e["parent_id"])}" -> "{_dot(e["child_id"])}" [label="{_dot(lbl)}"];')
    lines.append("}")
    return "\n".join(lines)


def _dot(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"') if "\\n" not in s else s.replace('"', '\\"')
