"""The Plan page's compact tier (planner/tiers.py): the request's ``compact`` choices, a cache key that follows
the stored compacts, and a plan's blocks and bytes per tier (exact, compact by bits per entry, omitted)."""

from __future__ import annotations

import hashlib

import pandas as pd

from mergepipe import api
from mergepipe.api import Catalog, Plan, PlanContext
from mergepipe.dashboard.formatting import fmt_bytes, fmt_pct
from mergepipe.dashboard.plan_masks import candidate_tiers


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
