"""The Plan page: operators, plan context, budget/bound frontier, block masks, mergekit configs, saved plans."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mergepipe import api
from mergepipe.api import Budget, Catalog, MergeRequest, Plan, PlanContext
from mergepipe.dashboard.figures import MAX_CELLS, aggregate, layout_of, state_figure
from mergepipe.dashboard.formatting import bound_parts, fmt_bound, fmt_bytes, fmt_pct, no_bound_reason
from mergepipe.dashboard.paths import check_path
from mergepipe.errors import MergePipeError, PlanError


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


def plan_view(ctx: PlanContext, budget_pct: float | None = None, target_rel: float | None = None) -> PlanView:
    plan = make_plan(ctx, budget_pct=budget_pct, target_rel=target_rel)
    relative = ctx.op.additive
    x, y = current_point(ctx, plan, relative)
    bound = plan.error_bound or {}
    additive = bound.get("additive") is not None and bound.get("additive") != bound.get("absolute")
    return PlanView(plan=plan, mask=mask_heatmap(mask_matrix(ctx, plan), mask_levels(ctx, plan)),
                    frontier=frontier_figure(frontier_df(ctx), x, y, relative, ctx.op.name, additive_label=additive),
                    explain=plan.explain(),
                    tiers=tiers_table(plan, ctx), suggestion=budget_suggestion(plan))


# --- the compact tier (issue 27: planner/tiers.py) -------------------------------------------------------
COMPACT_MODE_HELP = {"auto": "the levels the experts' stored compacts hold (the planner chooses per block)",
                     "off": "no compact tier: every block is read exactly or omitted (the plans of a catalog "
                            "without compacts)"}


def compact_options(cat: Catalog, experts) -> list[str]:
    """The Plan page's choices for the request's ``compact`` setting: [] when none of ``experts`` has compact
    deltas in the catalog (no control: the request keeps ``auto``, which then plans exact/omit), else
    ``auto``, ``off`` and each codec whose levels every such expert's stored compact can serve."""
    wanted = set(experts or ())
    stored = [api.codec(r["codec"]).stored_level for r in api.compact_rows(cat) if r["model_id"] in wanted]
    if not stored:
        return []
    top = min(stored)
    return ["auto", "off", *(c for c in api.CODECS if all(lv <= top for lv in api.codec(c).levels))]


def compact_mode_help(mode: str) -> str:
    return COMPACT_MODE_HELP.get(mode) or f"read only this codec's levels: {api.codec(mode).help}"


def compacts_version(cat: Catalog) -> str:
    """Changes when an expert's compact deltas are stored, replaced or removed (a cache key beside
    stats_version, which an ``analyze --compact`` of analyzed experts may leave as it was)."""
    rows = [(r["model_id"], r["fingerprint"], r["block_bytes"], r["codec"], r["group_size"], r["sha256"],
             r.get("created_at")) for r in api.compact_rows(cat)]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16] if rows else ""


TIER_ORDER = ("exact", "compact", "omitted")


def tiers_df(plan: Plan | dict, ctx: PlanContext | None = None) -> pd.DataFrame | None:
    """Blocks and estimated bytes per tier of a plan (plan.tiers): exact, the compact tier by bits per entry
    (one row per level in its ``by_bits``; their bytes need the plan's context, else "-") and in total, omitted.
    Exact and compact bytes are what the budget counts; omitted bytes are the exact bytes left unread. None for
    a plan without tiers (plans saved before issue 27)."""
    plan = api.as_plan(plan)
    t = plan.tiers
    if not t:
        return None
    full = plan.full_expert_bytes or 0
    ex, co, om = (t.get(k) or {} for k in TIER_ORDER)
    by_bits = {int(b): int(n) for b, n in (co.get("by_bits") or {}).items()}
    level_bytes = {}
    if by_bits and ctx is not None and getattr(ctx, "tiers", None) is not None:
        tier = candidate_tiers(ctx, plan)
        read = ctx.tiers.compact_read(tier)
        level_bytes = {b: int(read[tier == b].sum()) for b in by_bits}
    rows = []

    def row(name, blocks, nbytes):
        rows.append({"tier": name, "blocks": int(blocks), "bytes": nbytes,
                     "estimated": "-" if nbytes is None else fmt_bytes(nbytes),
                     "of full": fmt_pct(nbytes / full) if full and nbytes is not None else "-"})

    row("exact", ex.get("blocks", 0), int(ex.get("bytes", 0)))
    for bits in sorted(by_bits):
        row(f"compact, {bits} bit{'s' if bits != 1 else ''} per entry", by_bits[bits], level_bytes.get(bits))
    row("compact tier (total)", co.get("blocks", 0), int(co.get("bytes", 0)))
    row("omitted (not read)", om.get("blocks", 0), int(om.get("bytes", 0)))
    return pd.DataFrame(rows, columns=["tier", "blocks", "bytes", "estimated", "of full"])


def tiers_table(plan: Plan | dict, ctx: PlanContext | None = None) -> pd.DataFrame | None:
    """The tier summary for display (no raw byte column)."""
    df = tiers_df(plan, ctx)
    if df is None:
        return None
    return df.drop(columns=["bytes"]).rename(columns={"estimated": "est. bytes", "of full": "% of changed"})


def tiers_text(plan: Plan | dict) -> str | None:
    """One line: 'exact 39 blocks (152 KiB) · compact 189 blocks (97.9 KiB: 4 at 1 bit, 185 at 4 bits) ·
    omitted 25 blocks (100 KiB)'."""
    t = api.as_plan(plan).tiers
    if not t:
        return None
    ex, co, om = (t.get(k) or {} for k in TIER_ORDER)
    bits = ", ".join(f"{n} at {b} bit{'s' if int(b) != 1 else ''}" for b, n in sorted((co.get("by_bits") or {}).items(),
                                                                                    key=lambda kv: int(kv[0])) if n)
    return (f"exact {ex.get('blocks', 0)} blocks ({fmt_bytes(ex.get('bytes', 0))}) · compact {co.get('blocks', 0)} "
            f"blocks ({fmt_bytes(co.get('bytes', 0))}{': ' + bits if bits else ''}) · omitted {om.get('blocks', 0)} "
            f"blocks ({fmt_bytes(om.get('bytes', 0))} not read)")


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


PLAN_PAGE_TRI = {None: "default", True: "on", False: "off"}


def read_config_source(upload: bytes | None, path: str | None, roots: list[Path],
                       upload_name: str | None = None) -> tuple[bytes, str]:
    """The bytes of a mergekit YAML from an upload, else from a typed path under an allowed folder."""
    if upload is not None:
        return upload, upload_name or "uploaded config"
    p = check_path(path or "", roots)
    return api.read_config_file(p), p.name


def mergekit_plan_settings(cat: Catalog, text: str | bytes, source: str, roots: list[Path]) -> dict:
    """Plan-page settings (widget key -> value) equivalent to a mergekit YAML config.

    Only looks at the catalog: the config's models must be registered already (a path is matched by
    uri and fingerprint; paths must lie under an allowed folder). Refuses what the page cannot show
    (per-model densities that differ, a budget that is not a whole percentage)."""
    cfg = api.parse_config(text, source)
    r = api.resolve_config(cat, cfg, register_paths=False, check_path=lambda t: check_path(t, roots))
    spec = api.operator_spec(cfg.method)
    if r.layout is not None:
        raise PlanError(f"{source}: its `slices:` renumber, repeat or copy layers, which the Plan page cannot show; "
                        f"use `mergepipe merge --config`")
    experts = [e["model"] for e in r.experts]
    for e in experts:
        if cat.model(e)["base_id"] != r.base:
            raise PlanError(f"expert {e!r} is registered with base {cat.model(e)['base_id']!r}, not {r.base!r}")
    settings: dict = {"base": r.base, "experts": experts, "op": spec.name, "lam": 1.0 if cfg.lam is None else cfg.lam,
                      "normalize": PLAN_PAGE_TRI[cfg.normalize], "rescale": PLAN_PAGE_TRI[cfg.rescale],
                      "seed": 0 if cfg.seed is None else cfg.seed, "strategy": cfg.strategy or "norm"}
    if getattr(cfg, "compact", None) is not None:  # the `mergepipe: compact:` key (issue 27)
        settings["compact"] = cfg.compact
    for e in r.experts:
        for key in ("weight", "density"):
            if isinstance(e.get(key), list):
                raise PlanError(f"{source}: the {key} of {e['model']} varies per tensor (a filter or gradient), "
                                f"which the Plan page cannot show; use `mergepipe merge --config`")
        settings[f"w_{e['model']}"] = float(e.get("weight", 1.0))
    if spec.uses_density:
        densities = sorted({float(e.get("density", 1.0)) for e in r.experts})
        if len(densities) > 1:
            raise PlanError(f"{source}: the models' densities differ ({', '.join(f'{d:g}' for d in densities)}); "
                            f"the Plan page uses one density for all (use `mergepipe merge --config`)")
        d = densities[0]
        if not (0.01 <= d <= 1.0 and abs(round(d, 2) - d) < 1e-9):
            raise PlanError(f"{source}: density {d:g} is not one the Plan page offers (0.01 to 1 in steps of 0.01)")
        settings["density"] = round(d, 2)
    for p in spec.extras:
        value = cfg.method_params.get(p.name) if p.name in cfg.method_params else getattr(cfg, p.key, None)
        value = p.default if value is None else value
        if isinstance(value, (list, dict)):
            raise PlanError(f"{source}: {p.name} varies per tensor, which the Plan page cannot show; use "
                            f"`mergepipe merge --config`")
        if not p.in_range(value):
            raise PlanError(f"{source}: {p.name} {value:g} is outside the Plan page's range {p.range_text()}")
        settings[p.name] = float(value)
    if cfg.target_bound is not None:
        if not spec.additive:
            raise PlanError(f"{source}: a target bound needs an additive operator (linear, task_arithmetic)")
        settings.update({"mode": "target bound", "target": float(cfg.target_bound)})
    elif cfg.budget is not None:
        settings.update({"mode": "budget", "budget": _whole_percent(cfg.budget, source)})
    return settings


def _whole_percent(budget: Budget, source: str) -> int:
    pct = None if budget.fraction is None else budget.fraction * 100
    if pct is None or not 0 <= pct <= 100 or abs(pct - round(pct)) > 1e-9:
        raise PlanError(f"{source}: budget {budget.spec} is not a whole percentage, which the Plan page's slider needs "
                        f"(use `mergepipe merge --config` for other budgets)")
    return round(pct)


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
        "blocks": f"{selected} of {candidates} candidate blocks ({plan['blocks_total']} per model)",
        "blocks_selected": selected, "blocks_candidate": candidates, "blocks_total": plan["blocks_total"],
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
    yt = ("relative error bound" if y == "bound_rel" else
          ("error bound ||M_full - M_A||" if op_info(operator)["additive"] else
           f"omitted |c|*||delta|| (not a bound for {operator})"))
    if additive_label and op_info(operator)["additive"]:
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


# --- the settings as mergekit YAML (shown, edited and applied on the Plan page) -------------------------
def plan_yaml(cat: Catalog, plan: Plan | dict) -> str:
    """The mergekit YAML (with the ``mergepipe:`` key: budget, strategy, seed) of a plan, saved or not."""
    return api.plan_as_yaml(cat, plan)


def check_plan_yaml(cat: Catalog, text: str, roots: list[Path]) -> tuple[dict, str]:
    """(Plan-page settings, a one-line description) of an edited YAML; raises a MergePipeError saying what
    is wrong (syntax, unknown model, a value out of range, what the page cannot show)."""
    if not (text or "").strip():
        raise MergePipeError("the YAML is empty")
    settings = mergekit_plan_settings(cat, text, "the edited YAML", roots)
    how = (f"target bound {settings['target']:g}" if settings.get("mode") == "target bound"
           else f"budget {settings['budget']}%" if "budget" in settings else "budget 100%")
    return settings, f"{settings['op']} of {', '.join(settings['experts'])} on {settings['base']}, {how}"


def request_key_digest(text: str) -> str:
    """A short digest of a text (widget keys that follow what they show)."""
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:16]
