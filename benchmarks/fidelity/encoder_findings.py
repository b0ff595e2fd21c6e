"""The report's opening: findings across both families that bear on the product's defaults, computed from
the runs' results (the pretrained encoder's minilm_results and the tiny Llama's results.json)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.fidelity.encoder_report import (
    BUDGETS, OPERATORS, STRATEGIES, best_strategy, block_rows, cell, f1_rows, f2_rows, f3_row, pct, smallest_budget,
)
from mergepipe.planner.bounds import SUGGEST_BOUND_FRACTION


def rule_threshold(res: dict) -> dict:
    """A planner rule 'smallest budget whose bound ≤ x · ‖update‖': x = the smallest plan bound (relative to the
    update) at which each additive configuration's smallest F1-meeting budget lies, and what it picks."""
    rows = [r for r in smallest_budget(res) if r["op"] in ("linear", "task_arithmetic")]
    xs = [r["disjoint_rel"] for r in rows if r["disjoint_rel"] is not None]
    x = min(xs) if xs else None
    picks = []
    for r in rows:
        merges = res["variants"][r["variant"]]["merges"]
        pick = 100
        if x is not None:
            for b in BUDGETS:
                c = cell(merges, r["k"], r["op"], b)
                if c and c["disjoint_rel"] is not None and c["disjoint_rel"] <= x * (1 + 1e-6):
                    pick = b
                    break
        full = cell(merges, r["k"], r["op"], 100)["acc"]
        got = cell(merges, r["k"], r["op"], pick)["acc"]
        picks.append({**r, "pick": pick, "diff": got - full})
    return {"x": x, "picks": picks}


def plan_bound_range(res: dict) -> tuple[float, float]:
    """Smallest and largest plan (additive) bound relative to the update over the budgeted merges."""
    xs = [m["bound"]["relative"] for v in res["variants"].values() for m in v["merges"]
          if m.get("bound") and m["budget_pct"] < 100]
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def strategy_margins(res: dict) -> dict:
    """Per strategy, mean accuracy difference to norm over the scored K = 8 (variant, operator, budget) cells."""
    diffs = {}
    for v in res["variants"].values():
        k = max(m["k"] for m in v["merges"])
        for op in OPERATORS:
            for b in BUDGETS:
                base = cell(v["merges"], k, op, b, "norm")
                for s in STRATEGIES[1:]:
                    c = cell(v["merges"], k, op, b, s)
                    if base and c and base["acc"] is not None and c["acc"] is not None:
                        diffs.setdefault(s, []).append(c["acc"] - base["acc"])
    return {s: (sum(d) / len(d), min(d), max(d), len(d)) for s, d in diffs.items()}


def recommendation(res: dict, wins: dict) -> str:
    """Default strategy, block size and budget suggestion, each from the measured cells. A strategy other
    than norm is recommended only if its mean gain over norm exceeds an 8-task mean's standard error."""
    n_eval = res["family"]["spec"]["n_eval"]
    se = (0.25 / n_eval / 8) ** 0.5
    margins = strategy_margins(res)
    better = [s for s, (m, _lo, _hi, _n) in margins.items() if m > se]
    best = max(better, key=lambda s: margins[s][0]) if better else "norm"
    text = (f"default strategy `{best}`: mean accuracy difference to norm over the scored K = 8 cells (min..max): "
            + ", ".join(f"{s} {100 * m:+.1f} ({100 * lo:+.1f}..{100 * hi:+.1f}, {n} cells)"
                        for s, (m, lo, hi, n) in margins.items()))
    text += (f" — {'it beats' if better else 'none beats'} norm by more than an 8-task mean's standard error "
             f"({100 * se:.1f} points)")
    if res.get("block_sweep"):
        rows = block_rows(res)
        small, big = min(rows), max(rows)
        text += (f"; block size: {big // 1024} KiB vs {small // 1024} KiB: relative deviation at 25 / 50 % "
                 + " / ".join(f"{rows[big]['dev'][b] / rows[small]['dev'][b] - 1:+.0%}" for b in (25, 50) if b in rows[big]["dev"])
                 + f", accuracy at 25 % {100 * (rows[big]['acc25'] - rows[small]['acc25']):+.1f} points")
    sb = smallest_budget(res)
    by_op = {}
    for r in sb:
        by_op.setdefault(r["op"], []).append(r["budget"])
    text += ("; budget: the smallest budget within 1 point of the full merge is, over the (variant, K) configurations, "
             + ", ".join(f"{op} {min(b)}-{max(b)} %" for op, b in by_op.items()) + ".")
    return text


def llama_results(docs: Path) -> dict | None:
    js = docs / "results.json"
    return json.loads(js.read_text()) if js.exists() else None


def summary(res: dict, docs: Path) -> list[str]:
    f1, f2, f3 = f1_rows(res), f2_rows(res), f3_row(res)
    lines = ["Two checkpoint families measure what a merge budget costs: **A**, eight sentence-classification "
             "experts fine-tuned from a genuinely pretrained encoder (all-MiniLM-L6-v2), as full fine-tunes and as "
             "LoRA adapters; **B**, eight sequence-task experts of a tiny Llama pretrained here from scratch. Budgets "
             "are shares of the full expert read; the planner picks blocks by its strategy; the deviation is measured "
             "against the same operator's full-budget merge.", "", "## Findings that bear on the product", ""]
    met1 = [r for r in f1 if r["met"]]
    lines.append(f"- **F1 (25 % within 1 point of the full merge), family A:** met in {len(met1)}/{len(f1)} "
                 "(variant, K, operator) cells: "
                 + "; ".join(f"{r['target'].split(': ')[0][3:]} {100 * r['diff']:+.1f}" for r in f1) + ".")
    lines.append(f"- **F2 (relative deviation ≤ 5e-4 at 50 %), family A:** "
                 + "; ".join(f"{r['target'].split(': ')[0][3:]} {r['value']:.1e}" for r in f2)
                 + f" — met in {sum(r['met'] for r in f2)}/{len(f2)}. {f3['target'][3:]}: {f3['measured']}.")
    wins = {}
    for variant, v in res["variants"].items():
        k = max(m["k"] for m in v["merges"])
        for s, w in best_strategy(v["merges"], k).items():
            acc = wins.setdefault(s, {"deviation": 0, "accuracy": 0, "cells": 0, "compared": 0})
            for key in acc:
                acc[key] += w.get(key, 0)
    n = max(w["compared"] for w in wins.values())
    lines.append(f"- **Strategy (family A, K = 8, both variants, {n} operator-budget cells compared):** " + ", ".join(
        f"{s}: lowest deviation {w['deviation']}" + (f", best accuracy {w['accuracy']}/{w['cells']}" if w["cells"] else "")
        for s, w in wins.items()) + ".")
    if res.get("block_sweep"):
        rows = block_rows(res)
        lines.append("- **Block size (family A, full, K = 8, linear, norm):** relative deviation at 25 % / accuracy at 25 %: "
                     + ", ".join(f"{bb // 1024} KiB {r['dev'][25]:.2e} / {pct(r['acc25'])}" for bb, r in rows.items()) + ".")
    rule = rule_threshold(res)
    lo, hi = plan_bound_range(res)
    if rule["x"] is not None:
        lines.append(f"- **A budget rule the planner can suggest (additive operators):** the smallest budget whose "
                     f"disjoint-block bound is ≤ {rule['x']:.3f} × ‖merged update‖ (the smallest such bound at which an "
                     "additive configuration of family A was within 1 point of its full merge; the planner ships it "
                     f"rounded down, {SUGGEST_BOUND_FRACTION:g} in planner/bounds.py; the plan's additive bound "
                     f"is {lo:.0f}-{hi:.0f}× the update here, useless as a threshold). On the measured grid of budgets it "
                     "picks " + "; ".join(f"{p['variant']} K={p['k']} {p['op']} {p['pick']} % ({100 * p['diff']:+.1f} points)"
                                          for p in rule["picks"]) + ".")
    lines.append("- **Smallest budget within 1 point of the full merge (norm), per configuration:** " + "; ".join(
        f"{r['variant']} K={r['k']} {r['op']} {r['budget']} %" for r in smallest_budget(res)) + ".")
    lines.append("- **Recommendation:** " + recommendation(res, wins))
    llama = llama_results(docs)
    if llama:
        from benchmarks.fidelity.study import targets
        rows = [r for r in targets(llama) if r["target"].startswith(("F1", "F2"))]
        lin = next(m for m in llama["merges"] if m["operator"] == "linear" and m["budget_pct"] == 100)["deviation"]
        sizes = []
        for variant, v in res["variants"].items():
            k = max(m["k"] for m in v["merges"])
            d = next(m for m in v["merges"] if m["k"] == k and m["operator"] == "linear" and m["budget_pct"] == 100)
            sizes.append(f"{variant} {d['deviation']['update_norm'] / d['deviation']['reference_norm']:.1e}")
        lines.append(f"- **Family B (tiny Llama):** F1/F2 met in {sum(r['met'] for r in rows)}/{len(rows)} cells "
                     "(details in its section below). Update size ‖M_full − base‖/‖M_full‖ of the 8-expert linear merge: "
                     f"family B {lin['update_norm'] / lin['reference_norm']:.1e}, family A " + ", ".join(sizes)
                     + "; the relative deviation at a given budget scales with it.")
    return lines + [""]
