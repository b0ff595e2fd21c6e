"""EXPLAIN: a plan as text (inputs, budget, estimates, selection per expert and per tensor).

The sections are in planner/explain_sections.py (re-exported here), which imports no plan module so that
``Plan.explain`` can use them; this module adds :func:`explain_plan`, which takes a plan's data too, and a
snapshot's realized line."""

from __future__ import annotations

from mergepipe.planner.explain_sections import (  # noqa: F401  (re-exported)
    CONSENSUS_OPS, bound_lines, bound_section, budget_line, coalesce_line, error_bound_lines, estimate_line,
    expert_lines, explain_text, header_lines, layout_line, method_lines, shape_lines, soup_lines, suggestion_line,
    tensor_lines, tier_lines, tiers_line, tokenizer_lines, transfer_line, transfer_lines,
)
from mergepipe.planner.plan import as_plan


def explain_plan(p) -> str:
    """EXPLAIN-style text: inputs, budget, estimates, then selection per expert and per tensor (``p``: a
    :class:`~mergepipe.planner.plan.Plan` or its data), one section after another."""
    return explain_text(as_plan(p))


def realized_line(realized: dict, estimated: dict) -> str:
    """``realized   base read 9.54 MiB (as estimated), ...``: a snapshot's reads and write beside its plan's
    estimates, in binary units (the exact byte counts are in the manifest: ``explain --json``)."""
    from mergepipe.planner.budget import human_bytes

    def one(what: str, key: str) -> str:
        got, est = realized.get(key, 0), estimated.get(key, 0)
        if got == est:
            return f"{what} {human_bytes(got)} (as estimated)"
        if human_bytes(got) == human_bytes(est):  # too close for the units to show
            return f"{what} {human_bytes(got)} ({got - est:+d} B vs the estimate)"
        return f"{what} {human_bytes(got)} (est. {human_bytes(est)})"
    parts = [one("base read", "base_read"), one("expert read", "expert_read")]
    if realized.get("compact_read"):
        parts.append(one("compact read", "compact_read"))
    return "  realized   " + ", ".join(parts + [one("write", "output_write")])

