"""The Plan page: operators, the merge request and its plan context, the plan at a budget (PlanView), its
summary, per-expert table and suggested budget, saved plans and URL parameters. The access mask
(plan_masks), the frontier (plan_frontier), the compact tier (plan_tiers) and the mergekit YAML
(plan_config) have modules of their own, re-exported here."""

from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Budget, Catalog, MergeRequest, Plan, PlanContext
from mergepipe.dashboard.figures import layout_of
from mergepipe.dashboard.formatting import bound_parts, fmt_bound, fmt_bytes, fmt_pct, no_bound_reason
from mergepipe.dashboard.plan_config import (  # noqa: F401  (re-exported)
    PLAN_PAGE_TRI, check_plan_yaml, mergekit_plan_settings, plan_yaml, read_config_source,
)
from mergepipe.dashboard.plan_frontier import (  # noqa: F401  (re-exported)
    current_point, frontier_df, frontier_figure, omitted_term, plan_residual,
)
from mergepipe.dashboard.plan_masks import (  # noqa: F401  (re-exported)
    COMPACT_STATES, COMPACT_VALUE, MASK_STATES, MASK_TOP, TIERED_MASK_STATES, block_labels, candidate_tiers,
    mask_heatmap, mask_levels, mask_matrix, mask_rows, mask_state_counts, mask_states,
)
from mergepipe.dashboard.plan_tiers import (  # noqa: F401  (re-exported)
    COMPACT_MODE_HELP, TIER_ORDER, compact_mode_help, compact_options, compacts_version, tiers_df, tiers_table,
    tiers_text,
)
from mergepipe.errors import PlanError


# --- plans ---------------------------------------------------------------------------------------------
def operators() -> list[str]:
    return [s.name for s in api.operators()]


def op_info(name: str) -> dict:
    """What the Plan page needs to know about an operator and its parameters. ``params`` are the
    operator's declared parameters as widgets (ops/spec.py): ``place`` is ``main`` for those only some
    operators take (density, gamma, epsilon), ``more`` for lambda, normalize and rescale, ``weights``
    for the per-expert weight."""
    spec = api.operator_spec(name)
    # the parameters every task-vector operator takes (the interpolation methods declare their own only)
    common = set.intersection(*({p.name for p in s.parameters} for s in api.operators() if s.common is None))
    params = []
    for p in spec.parameters:
        place = "weights" if p.name == "weight" else ("more" if p.name in common else "main")
        params.append({
            "name": p.name, "key": p.key, "label": p.label or p.name, "kind": p.kind.__name__, "place": place,
            "default": p.default if p.page_default is None else p.page_default, "declared_default": p.default,
            "min": p.low if p.page_low is None else p.page_low, "max": p.high, "step": p.step,
            "decimals": p.decimals, "help": p.help + (f" (range {p.range_text()})" if p.range_text() else ""),
            "per_tensor": p.per_tensor})
    return {"name": spec.name, "uses_density": spec.uses_density, "additive": spec.additive,
            "normalize": spec.normalize, "rescale": spec.rescale, "random": spec.random,
            "extra": dict(spec.params), "reference": spec.reference, "params": params}


def plan_request(base: str, experts, operator: str = "linear", **settings) -> MergeRequest:
    """The merge request of the Plan page's settings (keyword names as in :meth:`MergeRequest.build`)."""
    if not experts:
        raise PlanError("choose at least one expert")
    return api.merge_request(base, list(experts), operator, **settings)


def request_key(request: MergeRequest) -> str:
    """A stable text key of a request (the page caches one PlanContext per key)."""
    return json.dumps(dataclasses.asdict(request), sort_keys=True, default=str)


def plan_context(cat: Catalog, base: MergeRequest | str, experts: list[str] | None = None, operator: str = "linear",
                 weights=None, **settings) -> PlanContext:
    """A PlanContext ready for fast re-planning (the sketch-based norm estimate is computed now, so
    that moving the budget touches no catalog row). Takes a MergeRequest, or builds one from settings."""
    request = base if isinstance(base, MergeRequest) else plan_request(
        base, experts, operator, weights=list(weights) if weights is not None else None, **settings)
    ctx = api.plan_session(cat, request)
    ctx.layout = layout_of(ctx.tensors, ctx.block_bytes)
    return ctx


def make_plan(ctx: PlanContext, budget_pct: float | None = None, target_rel: float | None = None) -> Plan:
    """The plan at a budget in percent of the full expert read, or the smallest one meeting a relative bound."""
    if target_rel is not None:
        return ctx.plan(Budget.target(target_rel))
    if budget_pct is None:
        raise PlanError("give a budget")
    return ctx.plan(Budget.percent(budget_pct))


TARGET_TYPICAL = 0.1  # the target bound a page opened in target mode (a link) starts at
TARGET_HELP = ("The largest error the merge may have, relative to the full merge's change from the base: the smallest "
               "budget whose error bound ||M_full - M_A|| is at most this fraction of ||M_full - base||. 0 reads every "
               "changed block; 1 allows leaving every block out. Typical: 0.05 to 0.2. It starts at the bound of the "
               "budget shown before the switch, so the plan stays the same until you change it.")


def target_default(bound: dict | None) -> float:
    """Where the target bound starts when the page switches to it: the relative bound of the plan shown, rounded
    up to the control's 0.001 (so the smallest budget meeting it reads no more), else TARGET_TYPICAL."""
    rel = (bound or {}).get("relative")
    return TARGET_TYPICAL if rel is None else math.ceil(float(rel) * 1000 - 1e-9) / 1000


@dataclasses.dataclass(frozen=True)
class PlanView:
    """Everything the Plan page draws for one budget: built once per (settings, budget) and then reused
    as is (the page caches it), so a cached load or a return to an earlier budget plans nothing."""
    plan: Plan
    mask: go.Figure
    frontier: go.Figure
    explain: str
    tiers: pd.DataFrame | None = None  # blocks and bytes per tier (tiers_df)
    suggestion: dict | None = None  # the suggested budget (budget_suggestion)
    mask_matrix: pd.DataFrame | None = None  # every expert's row of the mask (the figure draws the top MASK_TOP)
    mask_levels: tuple = ()


def plan_view(ctx: PlanContext, budget_pct: float | None = None, target_rel: float | None = None) -> PlanView:
    plan = make_plan(ctx, budget_pct=budget_pct, target_rel=target_rel)
    relative = ctx.op.additive
    x, y = current_point(ctx, plan, relative)
    bound = plan.error_bound or {}
    additive = bound.get("additive") is not None and bound.get("additive") != bound.get("absolute")
    matrix, levels = mask_matrix(ctx, plan), mask_levels(ctx, plan)
    return PlanView(plan=plan, mask=mask_heatmap(mask_rows(matrix, plan)[0], levels),
                    frontier=frontier_figure(frontier_df(ctx), x, y, relative, ctx.op.name, additive_label=additive),
                    explain=plan.explain(),
                    tiers=tiers_table(plan, ctx), suggestion=budget_suggestion(plan), mask_matrix=matrix,
                    mask_levels=levels)


def plan_mask(view: PlanView, top: int | None = MASK_TOP, search: str = "") -> tuple[go.Figure, str | None]:
    """The access mask of a plan view with its rows chosen (plan_masks.mask_rows: the ``top`` experts by bytes
    read among those matching ``search``) and the caption saying what is drawn; the view's own figure when every
    expert is drawn."""
    if view.mask_matrix is None:
        return view.mask, None
    rows, caption = mask_rows(view.mask_matrix, view.plan, top, search)
    if caption is None:
        return view.mask, None
    if rows.empty:
        return None, caption
    return mask_heatmap(rows, view.mask_levels), caption


def budget_suggestion(plan: Plan | dict) -> dict | None:
    """The planner's suggested budget (plan.suggested_budget, additive operators) as the Plan page shows it
    beside the slider: ``pct`` (the whole percentage the slider takes: rounded up, so its bound stays within the
    rule), ``text`` (one line) and ``help`` (what the rule is and where it was measured). None without one."""
    s = api.as_plan(plan).suggested_budget
    if not s or s.get("fraction_of_full") is None:
        return None
    frac = float(s["fraction_of_full"])
    pct = min(100, max(1, math.ceil(100 * frac - 1e-9)))
    rule = s.get("bound_fraction")
    nbytes = s.get("bytes")
    rule_text = (f"the smallest budget whose blockwise bound is <= {rule:g} x the update's norm "
                 f"(||M_full - base||)" if rule is not None else "the planner's rule")
    text = (f"Suggested: {pct} %" + (f" ({fmt_bytes(nbytes)})" if nbytes is not None else "")
            + f": {rule_text}; a rule measured in the fidelity study (docs/fidelity), not a guarantee for this merge.")
    parts = []
    if s.get("blockwise") is not None:
        parts.append(f"blockwise bound there {s['blockwise']:.4g}")
    if s.get("full_delta_norm") is not None:
        parts.append(f"estimated update norm {s['full_delta_norm']:.4g}")
    v = s.get("validation") or {}
    measured = (f"In the fidelity study on real fine-tunes ({v.get('where', 'docs/fidelity')}), {v['within']} of "
                f"{v['of']} held-out configurations at this rule lost at most 1 point against their full merge"
                if v.get("of") else "It was measured in the fidelity study on real fine-tunes")
    help_text = ("The planner walks its greedy order and stops at the first budget whose bound falls to the rule's "
                 f"fraction of the update. {measured}; other models and tasks may differ"
                 + (f" ({'; '.join(parts)})" if parts else "") + ".")
    return {"pct": pct, "fraction": frac, "bytes": nbytes, "bound_fraction": rule, "text": text, "help": help_text}


def plan_summary(plan: Plan | dict, experts_bytes: int | None = None) -> dict:
    """Formatted estimates of a plan (strings) plus the raw numbers they come from. ``full_expert`` is
    the experts' changed (delta != 0) bytes, what a budget percentage is a share of; ``experts_size``
    their size on disk (``experts_bytes``, when given)."""
    plan = api.as_plan(plan)
    full = plan.full_expert_bytes
    est = plan.estimated
    selected = sum(plan.blocks_selected.values())
    candidates = sum(plan.blocks_candidate.values())
    bound = plan.error_bound
    return {
        "plan_id": plan.id, "operator": plan.operator,
        "budget": f"{fmt_bytes(plan.budget_bytes)} ({plan.budget['spec']})",
        "budget_bytes": plan.budget_bytes,
        "expert_read": fmt_bytes(est["expert_read"]), "expert_read_bytes": est["expert_read"],
        "expert_read_pct": fmt_pct(est["expert_read"] / full) if full else "-",
        "base_read": fmt_bytes(est["base_read"]), "write": fmt_bytes(est["output_write"]),
        "full_expert": fmt_bytes(full),
        "full_text": f"{fmt_bytes(full)} changed (delta != 0) expert bytes"
        + (f" of {fmt_bytes(experts_bytes)} expert size" if experts_bytes else ""),
        "experts_size": fmt_bytes(experts_bytes) if experts_bytes else None,
        "compact_read": fmt_bytes(est.get("compact_read") or 0), "compact_read_bytes": est.get("compact_read") or 0,
        "budget_read_pct": fmt_pct((est["expert_read"] + (est.get("compact_read") or 0)) / full) if full else "-",
        "bound": fmt_bound(bound),
        "bounds": bound_parts(bound),
        "bound_why": None if bound else no_bound_reason(plan.operator),
        "bound_abs": bound.get("absolute") if bound else None,
        "bound_rel": bound.get("relative") if bound else None,
        "blocks": f"{selected} of {candidates} candidate blocks ({plan.blocks_total} per model)",
        "blocks_selected": selected, "blocks_candidate": candidates, "blocks_total": plan.blocks_total,
        "first_merge": first_merge_note(plan),
    }


def first_merge_note(plan: Plan | dict) -> str | None:
    """What a first merge does, when some experts have no current statistics (None otherwise)."""
    plan = api.as_plan(plan)
    pending = [f"{e['id']} ({e['analyze']})" for e in plan.analyzed_on_the_way]
    if not pending:
        return None
    return (f"First merge: {', '.join(pending)}. This merge reads every expert in full and analyzes "
            f"{'it' if len(pending) == 1 else 'them'} on the way (no separate analyze needed); the "
            f"{plan.budget['spec']} budget applies from the next merge.")


def plan_experts_df(plan: Plan | dict) -> pd.DataFrame:
    plan = api.as_plan(plan)
    rows = []
    for e in plan.experts:
        eid = e["id"]
        rows.append({"expert": eid, "weight": e["weight"], "density": e.get("density"),
                     "blocks": plan.blocks_selected[eid], "candidates": plan.blocks_candidate[eid],
                     "read": plan.estimated_by_expert[eid]})
    return pd.DataFrame(rows, columns=["expert", "weight", "density", "blocks", "candidates", "read"])


def plan_experts_table(plan: Plan | dict) -> pd.DataFrame:
    """The per-expert selection for display: the bytes read in binary units (no raw byte column)."""
    df = plan_experts_df(plan)
    df["read"] = df["read"].map(fmt_bytes)
    return df.rename(columns={"blocks": "blocks read", "candidates": "changed blocks"})


def plans_df(cat: Catalog) -> pd.DataFrame:
    rows = []
    for r in api.plan_rows(cat):
        p = Plan.from_json(r["json"])
        rows.append({"plan": r["id"], "created": r["created_at"], "base": r["base_id"], "operator": r["operator"],
                     "experts": ", ".join(p.expert_ids), "budget": p.budget["spec"],
                     "expert_read": fmt_bytes(r["expert_read_bytes"]),
                     "of_full": fmt_pct(r["expert_read_bytes"] / r["full_expert_bytes"]) if r["full_expert_bytes"] else "-",
                     "bound": "-" if r["error_bound"] is None else f"{r['error_bound']:.4g}"})
    cols = ["plan", "created", "base", "operator", "experts", "budget", "expert_read", "of_full", "bound"]
    return pd.DataFrame(rows, columns=cols)


def url_replacements(given: dict, used: dict, ranges: dict | None = None) -> list[str]:
    """Messages for URL query parameters the page could not use as given (out of range, not an option):
    ``given`` is the URL's key -> text when the page loaded, ``used`` the widgets' values after it drew
    them, ``ranges`` key -> (low, high) for the numeric ones."""
    out = []
    for key, text in given.items():
        if key not in used or isinstance(used[key], (list, tuple)):
            continue
        value = used[key]
        try:
            same = float(text) == float(value)
        except (TypeError, ValueError):
            same = str(text) == str(value)
        if same:
            continue
        low, high = (ranges or {}).get(key, (None, None))
        why = (f"outside {low:g} to {high:g}" if low is not None and high is not None else "not one of the choices")
        try:
            float(text)
        except ValueError:
            if low is not None:
                why = "not a number"
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        out.append(f"URL parameter {key}={text} is {why}; replaced by {shown}.")
    return out


def request_key_digest(text: str) -> str:
    """A short digest of a text (widget keys that follow what they show)."""
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:16]
