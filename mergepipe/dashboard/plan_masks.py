"""The Plan page's access mask: experts x blocks, each cell read exactly, from the compact tier (by bits per
entry), left out by the budget, or with no delta; its legend's states and the tier of each candidate."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Plan, PlanContext
from mergepipe.dashboard.figures import MAX_CELLS, aggregate, state_figure


def _mask_array(layout: pd.DataFrame, experts: list[str], access: dict, value: float = 1.0,
                out: np.ndarray | None = None) -> np.ndarray:
    first = dict(zip(layout["tensor"], layout["first"]))
    total = int(layout["blocks"].sum()) if len(layout) else 0
    m = np.zeros((len(experts), total), dtype=np.float64) if out is None else out
    for ei, e in enumerate(experts):
        for t, ranges in (access.get(e) or {}).items():
            f = first.get(t)
            if f is None:
                continue
            for a, b in ranges:
                m[ei, f + a:f + b] = value
    return m


def _state_array(layout: pd.DataFrame, experts: list[str], plan: Plan) -> np.ndarray:
    """Experts x blocks: 1 = read exactly, COMPACT_VALUE[bits] = read from the compact tier, 0 = neither."""
    m = _mask_array(layout, experts, plan.access)
    for e, entry in ((plan.compact or {}).get("experts") or {}).items():
        if e not in experts:
            continue
        for bits, ranges in (entry.get("bits") or {}).items():
            value = COMPACT_VALUE.get(int(bits))
            if value is not None:
                _mask_array(layout, experts, {e: ranges}, value=value, out=m)
    return m


def block_labels(layout: pd.DataFrame) -> list[str]:
    return [f"{t}#{b}" for t, n in zip(layout["tensor"], layout["blocks"]) for b in range(int(n))]


def mask_matrix(ctx: PlanContext, plan: Plan | dict, max_cells: int = MAX_CELLS) -> pd.DataFrame:
    """Experts x blocks (all tensors, display order): 1 = read exactly, 0.6 / 0.7 / 0.8 = read from the compact
    tier at 1 / 2 / 4 bits per entry, 0.5 = candidate left out (omitted), 0 = no delta (or not useful to the
    operator). Aggregated to the mean over column bins above ``max_cells``."""
    layout = ctx.layout
    experts = [e["id"] for e in ctx.experts]
    sel = _state_array(layout, experts, api.as_plan(plan))
    first = np.zeros(len(ctx.tensors), dtype=np.int64)
    pos = dict(zip(layout["tensor"], layout["first"]))
    for i, t in enumerate(ctx.tensors):
        first[i] = pos[t["name"]]
    c = ctx.candidates
    cand = np.zeros_like(sel)
    if len(c.expert):
        cand[c.expert, first[c.tensor] + c.block] = 0.5
    m = np.maximum(sel, cand)
    df = pd.DataFrame(m, index=experts, columns=block_labels(layout))
    return aggregate(df, max_cells, axis=1, how="mean")


MASK_STATES = [(0.0, "no delta (nothing to read)", "#f0f0f0"), (0.5, "changed, left out by the budget", "#9ecae1"),
               (1.0, "read", "#08519c")]
# the compact tier's states (bits per entry -> value, legend label, colour): between "left out" and "read exactly",
# rising with the precision read; oranges, apart from the blues of the exact-or-omitted states
COMPACT_STATES = {1: (0.6, "compact tier, 1 bit per entry", "#fee391"),
                  2: (0.7, "compact tier, 2 bits per entry", "#fec44f"),
                  4: (0.8, "compact tier, 4 bits per entry", "#ec7014")}
COMPACT_VALUE = {bits: v for bits, (v, _, _) in COMPACT_STATES.items()}
TIERED_MASK_STATES = [(0.0, "no delta (nothing to read)", "#f0f0f0"),
                      (0.5, "omitted (changed, left out by the budget)", "#9ecae1"),
                      (1.0, "read exactly", "#08519c")]


def mask_states(levels=()) -> list[tuple[float, str, str]]:
    """The mask's states: MASK_STATES (exact or omitted) without compact levels; with them, the exact, compact
    (one state per level in ``levels``: 1, 2, 4 bits) and omitted states."""
    levels = sorted({int(lv) for lv in levels if int(lv) in COMPACT_STATES})
    if not levels:
        return list(MASK_STATES)
    return sorted(TIERED_MASK_STATES + [COMPACT_STATES[lv] for lv in levels])


def mask_levels(ctx: PlanContext, plan: Plan | dict | None = None) -> tuple[int, ...]:
    """The compact levels the mask's legend names: those the context's compact tier can read, and any the plan
    reads (empty for an exact-or-omitted context)."""
    levels = set(getattr(ctx.tiers, "levels", ()) or ()) if getattr(ctx, "tiers", None) is not None else set()
    if plan is not None:
        for entry in ((api.as_plan(plan).compact or {}).get("experts") or {}).values():
            levels |= {int(b) for b in entry.get("bits") or {}}
    return tuple(sorted(levels))


def mask_heatmap(mask: pd.DataFrame, levels=()) -> go.Figure:
    """The access mask with a legend naming its states (with ``levels``: the compact tier's too, in a legend
    below the plot: six entries do not fit above it)."""
    states = mask_states(levels)
    if states == MASK_STATES:
        return state_figure(mask, "access mask: which blocks each expert reads", states)
    return state_figure(mask, "access mask: read exactly, from the compact tier, or omitted", states,
                        legend_below=True)


def mask_state_counts(mask: pd.DataFrame) -> dict[str, int]:
    """Cells of an (unaggregated) mask in each state: exact, compact by bits ('1', '2', '4'), omitted, no delta."""
    v = mask.to_numpy()
    out = {"exact": int((v == 1.0).sum()), "omitted": int((v == 0.5).sum()), "no delta": int((v == 0.0).sum())}
    out["compact"] = {str(bits): int((v == value).sum()) for bits, value in COMPACT_VALUE.items()}
    return out


def candidate_tiers(ctx: PlanContext, plan: Plan | dict) -> np.ndarray:
    """The tier code of each candidate in a plan (planner/tiers.py: 0 omitted, 1/2/4 compact bits, 8 exact)."""
    experts = [e["id"] for e in ctx.experts]
    states = _state_array(ctx.layout, experts, api.as_plan(plan))
    pos = dict(zip(ctx.layout["tensor"], ctx.layout["first"]))
    first = np.array([pos[t["name"]] for t in ctx.tensors], dtype=np.int64)
    c = ctx.candidates
    v = states[c.expert, first[c.tensor] + c.block] if len(c.expert) else np.zeros(0)
    tier = np.zeros(len(v), dtype=np.int64)
    tier[v == 1.0] = api.EXACT
    for bits, value in COMPACT_VALUE.items():
        tier[v == value] = bits
    return tier


MASK_TOP = 16  # experts the Plan page's mask draws by default when a plan has more


def mask_rows(mask: pd.DataFrame, plan: Plan | dict, top: int | None = MASK_TOP, search: str = "") \
        -> tuple[pd.DataFrame, str | None]:
    """The rows of the access mask the Plan page draws, so that 64 experts stay legible: the experts whose id
    contains ``search`` (case-insensitive; with ``*`` or ``?`` an fnmatch pattern, ``e1*``), the ``top`` that read
    the most bytes, most first; and a caption saying what is drawn and what the others read (None when a plan of at
    most MASK_TOP experts is drawn whole, in its order). Only the drawing changes: the plan is the same."""
    from fnmatch import fnmatchcase

    plan = api.as_plan(plan)
    names = [str(i) for i in mask.index]
    query = (search or "").strip().lower()
    if query:
        pattern = any(c in query for c in "*?[")
        names = [n for n in names if (fnmatchcase(n.lower(), query) if pattern else query in n.lower())]
    if not query and len(names) <= MASK_TOP and (top is None or len(names) <= top):
        return mask, None  # few experts: every row, in the plan's order
    compact = plan.compact_read_by_expert if plan.compact else {}
    read = {e: int(plan.estimated_by_expert.get(e, 0)) + int(compact.get(e, 0)) for e in map(str, mask.index)}
    ranked = sorted(names, key=lambda n: (-read.get(n, 0), names.index(n)))
    shown = ranked if top is None else ranked[:top]
    total = sum(read.values())
    rest = [e for e in map(str, mask.index) if e not in shown]
    rest_read = sum(read.get(e, 0) for e in rest)
    caption = (f"{len(shown)} of {len(mask)} experts drawn, most bytes read first"
               + (f" (matching '{search.strip()}': {len(names)})" if query else "")
               + (f"; the other {len(rest)} read {api.human_bytes(rest_read)} "
                  f"({100 * rest_read / total:.1f} % of the expert read)" if rest and total else
                  f"; the other {len(rest)} read nothing" if rest else ""))
    return mask.loc[shown], caption
