"""The Plan page's budget-bound frontier: the greedy order's curve (budget read vs the bound of what is left
out, or the three-way curve with a compact tier) and the point of the plan shown."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Plan, PlanContext
from mergepipe.dashboard.plan_masks import _mask_array, candidate_tiers


def omitted_term(ctx: PlanContext, plan: Plan | dict) -> float:
    """Sum over the candidates the plan leaves out of |c_i| * ||delta|| (the bound for additive operators)."""
    experts = [e["id"] for e in ctx.experts]
    sel = _mask_array(ctx.layout, experts, api.as_plan(plan).access)
    pos = dict(zip(ctx.layout["tensor"], ctx.layout["first"]))
    first = np.array([pos[t["name"]] for t in ctx.tensors], dtype=np.int64)
    c = ctx.candidates
    if not len(c.expert):
        return 0.0
    chosen = sel[c.expert, first[c.tensor] + c.block] > 0
    return float(c.bound_term[~chosen].sum())


def frontier_df(ctx: PlanContext, points: int = 101) -> pd.DataFrame:
    """The budget-bound curve of the greedy order: budget (bytes, %) vs omitted bound (absolute, relative).
    With a compact tier (ctx.tiers), the three-way greedy's curve: budget = exact + compact bytes, bound = the
    additive bound with the compact blocks' stored error terms."""
    full = ctx.candidates.full_bytes
    norm = ctx.full_norm_estimate() if ctx.op.additive else None
    rows = []
    tiers = getattr(ctx, "tiers", None)
    for b, bound in (tiers.frontier(points) if tiers is not None else ctx.candidates.frontier(points)):
        rows.append({"budget_bytes": b, "budget_pct": 100.0 * b / full if full else 0.0, "bound_abs": bound,
                     "bound_rel": bound / norm if norm else None})
    return pd.DataFrame(rows, columns=["budget_bytes", "budget_pct", "bound_abs", "bound_rel"])


def frontier_figure(frontier: pd.DataFrame, current_pct: float, current_bound: float, relative: bool,
                    operator: str, additive_label: bool = False) -> go.Figure:
    """The budget-bound curve with this plan's point. ``additive_label``: name the curve's bound the additive
    one (when the plan's headline bound is a tighter one, so that the two are not confused)."""
    y = "bound_rel" if relative and frontier["bound_rel"].notna().all() else "bound_abs"
    additive = api.operator_spec(operator).additive
    yt = ("relative error bound" if y == "bound_rel" else
          ("error bound ||M_full - M_A||" if additive else
           f"omitted |c|*||delta|| (not a bound for {operator})"))
    if additive_label and additive:
        yt = ("relative additive bound" if y == "bound_rel" else "additive bound ||M_full - M_A||") + \
            " (sum of the left-out terms)"
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=frontier["budget_pct"], y=frontier[y], mode="lines", name="frontier",
                             hovertemplate="budget %{x:.1f}%<br>%{y:.4g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[current_pct], y=[current_bound], mode="markers", name="this plan",
                             marker={"size": 12, "color": "crimson", "symbol": "x"}))
    # the title sits above the plot area (pad, top margin) so the y-axis label never reaches it
    fig.update_layout(title={"text": "budget vs bound", "y": 0.98, "yanchor": "top", "pad": {"b": 10}},
                      xaxis_title="expert-read budget (% of the changed expert bytes)",
                      yaxis={"title": {"text": yt, "font": {"size": 11}, "standoff": 6}},
                      margin={"l": 10, "r": 10, "t": 60, "b": 10}, height=380, showlegend=False)
    return fig


def plan_residual(ctx: PlanContext, plan: Plan | dict) -> float:
    """The additive bound's sum of a plan: each candidate's |c_i| * ||delta|| omitted, |c_i| times its compact's
    stored error norm when read from the compact tier, 0 read exactly (omitted_term without a compact tier)."""
    if getattr(ctx, "tiers", None) is None:
        return omitted_term(ctx, plan)
    return float(ctx.tiers.residual(candidate_tiers(ctx, plan)).sum())


def current_point(ctx: PlanContext, plan: Plan | dict, relative: bool) -> tuple[float, float]:
    """(expert-derived bytes read, exact + compact, in % of full; bound) of a plan, for the frontier chart."""
    plan = api.as_plan(plan)
    full = ctx.candidates.full_bytes
    read = plan.estimated["expert_read"] + (plan.estimated.get("compact_read") or 0)
    x = 100.0 * read / full if full else 0.0
    omitted = plan_residual(ctx, plan)
    if relative and ctx.op.additive:
        norm = ctx.full_norm_estimate()
        return x, (omitted / norm if norm else 0.0)
    return x, omitted
