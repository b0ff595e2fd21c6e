"""How the dashboard writes sizes, percentages, bounds, durations and fingerprints."""

from __future__ import annotations

from mergepipe.units import human_bytes

# --- formatting ------------------------------------------------------------------------------------
fmt_bytes = human_bytes  # 1536 -> '1.50 KiB'; None -> '-'


def fmt_pct(x) -> str:
    """0.253 -> '25.3%'."""
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_bound(bound: dict | None, operator: str | None = None) -> str:
    """The planner's error bound as one line (or why there is none)."""
    if not bound:
        return "n/a (not an additive operator)" if operator is None else f"n/a: {no_bound_reason(operator)}"
    rel = bound.get("relative")
    return f"{bound['absolute']:.4g}" + ("" if rel is None else f" (relative {rel:.3g})")


def no_bound_reason(operator: str) -> str:
    """Why a plan of ``operator`` has no error bound."""
    return (f"{operator} is not additive (it trims, elects signs or drops entries per expert, so the merged delta "
            f"is not a weighted sum of the experts' deltas); the bound ||M_full - M_A|| <= sum of the omitted "
            f"|c|*||delta|| holds only for linear and task_arithmetic. The frontier shows that omitted sum as a "
            f"guide, not a bound")


def fmt_seconds(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def short_fp(fp: str | None) -> str:
    """'sha256:abcdef0123...' -> 'abcdef012345'."""
    if not fp:
        return "-"
    return fp.split(":", 1)[-1][:12]


# The error-bound keys a plan may carry (planner/context.py, planner/bounds.py), each with how the page names it.
# Values are read by key (a plan may lack some: older plans, operators without a bound); keys not listed here
# are not shown.
BOUND_KEYS = (("absolute", "absolute"), ("additive", "additive"), ("blockwise", "blockwise (disjoint blocks)"))
RELATIVE_KEYS = {"absolute": "relative", "additive": "additive_relative", "blockwise": "blockwise_relative"}


def bound_parts(bound: dict | None) -> list[str]:
    """The bounds a plan states, one labelled text per key present: 'absolute (blockwise) 0.0184 (relative
    0.0834)', 'additive 0.143 (relative 0.648)'. The headline (``absolute``) names the bound it is (its ``kind``,
    or the key whose value it equals), which is then not repeated. Empty without a bound."""
    if not bound:
        return []
    kind = bound.get("kind")
    if kind is None:
        same = [k for k, _ in BOUND_KEYS[1:] if bound.get(k) is not None and bound.get(k) == bound.get("absolute")]
        kind = same[0] if same else None
    out = []
    for key, label in BOUND_KEYS:
        value = bound.get(key)
        if value is None or (key == kind and key != "absolute" and value == bound.get("absolute")):
            continue
        if key == "absolute" and kind not in (None, "absolute"):
            label = f"absolute ({kind})"
        rel = bound.get(RELATIVE_KEYS[key])
        out.append(f"{label} {value:.4g}" + ("" if rel is None else f" (relative {rel:.3g})"))
    return out


# --- tables ------------------------------------------------------------------------------------------------
MISSING = "-"  # what a table shows for a missing value (Streamlit would write `None`), as the formatters above


def fmt_cell(value) -> str:
    """One table cell as text: a missing value (None, NaN, NaT) is MISSING; numbers keep up to five significant
    digits (1.0 -> '1', 5.29652 -> '5.2965'); anything else as str()."""
    import pandas as pd
    if value is None or (not isinstance(value, (list, tuple, dict)) and pd.isna(value)):
        return MISSING
    if isinstance(value, float):
        return f"{value:.5g}"
    return str(value)


def table(df):
    """A DataFrame as every dashboard table shows it: the columns holding a missing value are written out with
    fmt_cell (MISSING where a value is missing); the other columns keep their type (numeric sorting, column
    formats). The data itself is not changed: pages pass the result to st.dataframe."""
    missing = [c for c in df.columns if df[c].isna().any()]
    if not missing:
        return df
    out = df.copy()
    for c in missing:
        out[c] = out[c].map(fmt_cell).astype(object)
    return out
