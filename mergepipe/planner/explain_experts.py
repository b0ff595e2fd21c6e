"""Which experts EXPLAIN lists: with many experts (K = 64) the per-expert table shows the top N by bytes read
(16 by default) and one line for the rest (how many, their bytes and share of the expert read, their blocks);
a pattern (fnmatch on expert ids, ``e1*``) keeps only the experts it matches. Only the text changes: the plan
and its digest are the same whatever is shown."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

DEFAULT_TOP = 16  # experts listed by default; the rest are one summary line


@dataclass(frozen=True)
class ExpertView:
    """``top``: how many experts to list (None: every one); ``pattern``: fnmatch pattern on expert ids."""

    top: int | None = DEFAULT_TOP
    pattern: str | None = None

    @classmethod
    def of(cls, top: int | None = DEFAULT_TOP, pattern: str | None = None, show_all: bool = False) -> ExpertView:
        if top is not None and top < 1:
            raise ValueError(f"experts to list must be at least 1, not {top}")
        return cls(None if show_all else top, pattern or None)


def split_experts(plan, view: ExpertView) -> tuple[list[dict], list[dict], int]:
    """(experts listed, experts summed in the "more" line, experts the pattern leaves out). Listed: all the
    matching experts in plan order when they fit, else the top N by bytes read (ties: plan order)."""
    matching = [e for e in plan.experts if view.pattern is None or fnmatchcase(e["id"], view.pattern)]
    hidden = len(plan.experts) - len(matching)
    if view.top is None or len(matching) <= view.top:
        return matching, [], hidden
    by_bytes = sorted(range(len(matching)), key=lambda i: (-_read(plan, matching[i]["id"]), i))
    return [matching[i] for i in by_bytes[:view.top]], [matching[i] for i in by_bytes[view.top:]], hidden


def _read(plan, eid: str) -> int:
    return plan.estimated_by_expert.get(eid, 0) + (plan.compact_read_by_expert.get(eid, 0) if plan.compact else 0)


def experts_heading(plan, view: ExpertView, shown: list[dict], rest: list[dict], hidden: int) -> str:
    """``  experts (top 16 of 64 by bytes read; --all lists every one)``, or plain ``  experts``."""
    notes = []
    if rest:
        notes.append(f"top {len(shown)} of {len(shown) + len(rest)} by bytes read; --all lists every one")
    if view.pattern is not None:
        notes.append(f"{len(shown) + len(rest)} of {len(plan.experts)} match {view.pattern!r}")
    return "  experts" + (f" ({'; '.join(notes)})" if notes else "")


def more_line(plan, rest: list[dict]) -> str | None:
    """``    … 48 more experts: read 12.0 MiB (37.5 % of the expert read), blocks 120/480``; None without a rest."""
    from mergepipe.planner.budget import human_bytes
    if not rest:
        return None
    read = sum(_read(plan, e["id"]) for e in rest)
    total = sum(_read(plan, e["id"]) for e in plan.experts)
    share = f"{100 * read / total:.1f} %" if total else "0 %"
    selected = sum(plan.blocks_selected.get(e["id"], 0) for e in rest)
    candidates = sum(plan.blocks_candidate.get(e["id"], 0) for e in rest)
    return (f"    … {len(rest)} more experts: read {human_bytes(read)} ({share} of the expert read), "
            f"blocks {selected}/{candidates}")
