"""The Snapshots page: manifests, bytes read by expert and tensor, touched blocks, verification."""

from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.dashboard.figures import (
    MAX_CELLS, aggregate, block_layout, heatmap_figure, tensor_sort_key,
)
from mergepipe.dashboard.formatting import fmt_bound, fmt_bytes, fmt_pct, short_fp
from mergepipe.dashboard.plan import _mask_array, block_labels
from mergepipe.errors import MergePipeError
from mergepipe.manifest.build import Manifest
from mergepipe.planner.plan import load_plan, Plan


# --- snapshots -----------------------------------------------------------------------------------------
def snapshots_df(cat: Catalog) -> pd.DataFrame:
    rows = []
    for s in reversed(api.snapshots(cat)):
        rows.append({"snapshot": s["id"], "model": s["model_id"], "operator": s["operator"], "plan": s["plan_id"],
                     "expert_read": fmt_bytes(s["expert_read_bytes"]),
                     "of_full": fmt_pct(s["expert_read_bytes"] / s["full_expert_bytes"])
                     if s["full_expert_bytes"] else "-",
                     "created": s["created_at"], "out": s["out"], "manifest": short_fp(s["manifest_hash"])})
    cols = ["snapshot", "model", "operator", "plan", "expert_read", "of_full", "created", "out", "manifest"]
    return pd.DataFrame(rows, columns=cols)


def load_manifest(cat: Catalog, ref: str) -> Manifest:
    return api.load_manifest(cat, ref)


def manifest_summary(manifest: Manifest) -> pd.DataFrame:
    c, r = manifest.core, manifest.run
    est, real = c["estimated"], c["realized"]
    rows = [
        ("snapshot", r["snapshot_id"]), ("model", r["model_id"]), ("output", r["out"]),
        ("created", r.get("created_at", "-")), ("manifest hash", manifest.manifest_hash),
        ("plan", c["plan_id"]), ("operator", c["operator"]), ("params", json.dumps(c["params"], sort_keys=True)),
        ("seed", str(c["seed"])), ("base", c["inputs"]["base"]["id"]),
        ("experts", ", ".join(f"{e['id']} (w={e['weight']:g})" for e in c["inputs"]["experts"])),
        ("grid", fmt_bytes(c["grid"]["block_bytes"]) + " blocks"),
        ("budget", f"{fmt_bytes(c['budget']['bytes'])} ({c['budget']['spec']})"),
        ("expert read", f"{fmt_bytes(real['expert_read'])} realized / {fmt_bytes(est['expert_read'])} estimated "
                        f"/ {fmt_bytes(c['full_expert_bytes'])} full"),
        ("base read", f"{fmt_bytes(real['base_read'])} realized / {fmt_bytes(est['base_read'])} estimated"),
        ("write", f"{fmt_bytes(real['output_write'])} realized / {fmt_bytes(est['output_write'])} estimated"),
        ("error bound", fmt_bound(c["error_bound"])),
        ("output files", str(len(c["outputs"]))),
        ("seconds", f"{r.get('seconds', 0):.2f}"),
    ]
    return pd.DataFrame(rows, columns=["field", "value"])


def bytes_by_expert_df(manifest: Manifest) -> pd.DataFrame:
    c = manifest.core
    experts = [e["id"] for e in c["inputs"]["experts"]]
    rows = [{"expert": e, "estimated": int(c["estimated_by_expert"].get(e, 0)),
             "realized": int(c["realized_by_expert"].get(e, 0))} for e in experts]
    return pd.DataFrame(rows, columns=["expert", "estimated", "realized"])


def bytes_by_tensor_df(manifest: Manifest, plan: Plan | dict | None = None) -> pd.DataFrame:
    """Realized expert bytes per tensor, with the plan's estimate when the plan is known."""
    c = manifest.core
    est = {}
    if plan is not None:
        est = (plan.data if isinstance(plan, Plan) else plan).get("expert_read_by_tensor", {})
    names = sorted(set(c["realized_by_tensor"]) | set(est), key=tensor_sort_key)
    rows = [{"tensor": t, "estimated": int(est.get(t, 0)) if plan is not None else None,
             "realized": int(c["realized_by_tensor"].get(t, 0))} for t in names]
    return pd.DataFrame(rows, columns=["tensor", "estimated", "realized"])


def manifest_plan(cat: Catalog, manifest: Manifest) -> Plan | None:
    try:
        return load_plan(cat, manifest.core["plan_id"])
    except MergePipeError:
        return None


def bytes_figure(df: pd.DataFrame, by: str) -> go.Figure:
    fig = go.Figure()
    if "estimated" in df and df["estimated"].notna().any():
        fig.add_trace(go.Bar(x=df[by], y=df["estimated"], name="estimated"))
    fig.add_trace(go.Bar(x=df[by], y=df["realized"], name="realized"))
    fig.update_layout(barmode="group", title=f"expert bytes per {by}: estimated vs realized", yaxis_title="bytes",
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=340)
    if by == "tensor":
        fig.update_xaxes(showticklabels=len(df) <= 40)
    return fig


def touched_matrix(cat: Catalog, manifest: Manifest, max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """Experts x blocks of the base grid: 1 where the merge read the expert's block."""
    c = manifest.core
    layout = block_layout(cat, c["inputs"]["base"]["id"], c["grid"]["block_bytes"])
    experts = [e["id"] for e in c["inputs"]["experts"]]
    m = _mask_array(layout, experts, c["touched"])
    df = pd.DataFrame(m, index=experts, columns=block_labels(layout))
    return aggregate(df, max_cells, axis=1, how="mean")


def touched_heatmap(matrix: pd.DataFrame) -> go.Figure:
    return heatmap_figure(matrix, "touched blocks per expert (1 = read)", "read",
                          colorscale=[[0, "#f0f0f0"], [1, "#238b45"]], zmin=0, zmax=1,
                          height=max(200, 80 + 28 * len(matrix.index)))


def verify_text(result: dict) -> str:
    head = f"{'OK' if result['ok'] else 'MISMATCH'}: {result['snapshot_id']}, {result['files_checked']} files checked"
    return head + "".join(f"\n- {p}" for p in result["problems"])
