"""The incremental plan's format: its name, how to recognise one, and its EXPLAIN (kept apart from
planner/extend.py, which plans one with a PlanContext, so that a Plan can explain itself without
importing the planner)."""

from __future__ import annotations

from mergepipe.planner.budget import human_bytes

EXTEND_FORMAT = "mergepipe.extend-plan/1"


def is_extend(plan_data: dict) -> bool:
    return plan_data.get("format") == EXTEND_FORMAT


def explain_extend(p: dict) -> str:
    """EXPLAIN of an incremental plan, with the from-scratch merge of the same sets beside it."""
    c, e, fs = p["change"], p["estimate"], p["from_scratch_estimate"]
    if c["action"] == "add":
        what = f"add {c['expert']} (weight {c['weight']:g})"
    elif c["action"] == "remove":
        what = f"remove {c['expert']} (weight {c['weight_old']:g})"
    else:
        what = f"reweight {c['expert']} {c['weight_old']:g} -> {c['weight']:g}"
    incr = e["snapshot_read"] + e["base_read"] + e["expert_read"]
    scratch = fs["base_read"] + fs["expert_read"]
    coefs = p["coefficients"]
    b = p["error_bound"]
    lines = [
        f"PLAN {p['id']}  ({p['digest']})  incremental",
        f"  extends    snapshot {p['parent']['snapshot_id']} (model {p['parent']['model_id']})",
        f"  change     {what}",
        f"  operator   {p['operator']}  experts after: " + ", ".join(f"{x['id']}:{x['weight']:g}" for x in p["experts"]),
        f"  update     M' = {coefs['a']:.6g} M + {coefs['g']:.6g} base + {coefs['b']:.6g} delta"
        + ("  (untouched blocks copied)" if coefs["copy_unread"] else ""),
        f"  expert     {human_bytes(e['expert_read'])} of {human_bytes(p['full_expert_bytes'])} "
        f"({p['budget']['spec']})",
        f"  incremental reads  snapshot {human_bytes(e['snapshot_read'])} + base {human_bytes(e['base_read'])} + "
        f"expert {human_bytes(e['expert_read'])} = {human_bytes(incr)}",
        f"  from scratch reads base {human_bytes(fs['base_read'])} + experts {human_bytes(fs['expert_read'])} = "
        f"{human_bytes(scratch)}  ({scratch / incr:.2f}x the incremental)" if incr else "",
        f"  bound      ||M_full - M_A|| <= {b['absolute']:.6g}"
        + (f"  (relative ~{b['relative']:.3e})" if b.get("relative") is not None else ""),
    ]
    return "\n".join(x for x in lines if x)
