"""The Sweeps page: the recorded merge sweeps, one point per merge, and their frontier (quality vs
expert bytes read vs time). Points without a quality score are placed by their error bound."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.dashboard.formatting import fmt_bytes

SWEEP_COLUMNS = ["id", "name", "executor", "status", "points", "started_at", "finished_at"]


def sweeps_df(catalog: Catalog) -> pd.DataFrame:
    """Every sweep, newest first."""
    return pd.DataFrame(api.sweep_rows(catalog), columns=SWEEP_COLUMNS)


def _settings_text(settings: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def points_df(catalog: Catalog, sweep_id: str) -> pd.DataFrame:
    """A sweep's points: settings, status, snapshot, realized expert bytes, seconds, quality, and whether
    the point is on the frontier (no other published point reads at most as many bytes with a better
    score; lower is better for perplexity and the error bound)."""
    rows = api.sweep_points(catalog, sweep_id)
    df = pd.DataFrame([{
        "point": r["point"], "settings": _settings_text(r["settings"]), "operator": r["settings"].get("operator", "linear"),
        "status": r["status"], "snapshot": r["snapshot_id"], "expert_read": r["expert_read"],
        "expert read": fmt_bytes(r["expert_read"]) if r["expert_read"] is not None else "",
        "seconds": r["seconds"], "metric": r["metric"] or ("error bound" if r["error_bound"] is not None else None),
        "quality": r["quality"] if r["quality"] is not None else r["error_bound"], "error": r["error"] or "",
    } for r in rows], columns=["point", "settings", "operator", "status", "snapshot", "expert_read", "expert read",
                               "seconds", "metric", "quality", "error"])
    df["frontier"] = _frontier(df)
    return df


def _frontier(df: pd.DataFrame) -> list[bool]:
    ok = df[(df["status"] != "failed") & df["quality"].notna() & df["expert_read"].notna()]
    keep = set()
    for i, r in ok.iterrows():
        dominated = ((ok["expert_read"] <= r["expert_read"]) & (ok["quality"] <= r["quality"])
                     & ((ok["expert_read"] < r["expert_read"]) | (ok["quality"] < r["quality"]))).any()
        if not dominated:
            keep.add(i)
    return [i in keep for i in df.index]


def frontier_figure(df: pd.DataFrame) -> go.Figure:
    """Quality (y, lower is better) against expert bytes read (x), marker size by seconds, one trace per
    operator; the frontier points joined by a line."""
    fig = go.Figure()
    scored = df[df["quality"].notna() & df["expert_read"].notna()]
    biggest = max(float(scored["seconds"].max() or 0.0), 1e-9) if len(scored) else 1.0
    for op, part in scored.groupby("operator", sort=True):
        fig.add_trace(go.Scatter(
            x=part["expert_read"], y=part["quality"], mode="markers", name=op,
            marker={"size": [8 + 22 * float(s or 0.0) / biggest for s in part["seconds"]]},
            text=[f"point {p}: {s}<br>{t:.2f} s" for p, s, t in zip(part["point"], part["settings"], part["seconds"])],
            hovertemplate="%{text}<br>expert read %{x} B<br>quality %{y:.4g}<extra></extra>"))
    front = scored[scored["frontier"]].sort_values("expert_read")
    if len(front):
        fig.add_trace(go.Scatter(x=front["expert_read"], y=front["quality"], mode="lines", name="frontier",
                                 line={"dash": "dot", "color": "gray"}, hoverinfo="skip"))
    metric = next((m for m in scored["metric"] if m), "quality")
    fig.update_layout(xaxis_title="expert bytes read", yaxis_title=f"{metric} (lower is better)",
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=420, legend_title="operator")
    return fig
