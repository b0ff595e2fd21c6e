"""The suggested-budget rule, fitted on one set of configurations and validated on another (issue 27).

    python -m benchmarks.fidelity.suggest_rule [RESULTS.json]   # default: the tiered study's results

The rule: the smallest budget whose plan's blockwise bound is <= f x the estimated ||M_full - base||
(planner/bounds.py SUGGEST_RULES). Configurations: (compact setting, variant, K, group, operator) of the tiered
study (benchmarks/fidelity/encoder_tiered.py) for the additive operators (the only ones with a suggestion). Fit
on K = 8 and the first K = 4 group: f is the largest value, rounded down to 2 decimals, at which the rule picks
no measured budget (5/10/25/50 %) that lost more than 1 point of mean accuracy against its full merge (100 %
when none qualifies). Validation: the same f on the other groups of K = 4 and on K = 2; a configuration passes
when the budget the rule picks is within 1 point of its full merge. Prints both counts per compact setting
(progressive: three-way plans; off: exact-or-omitted plans).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from benchmarks.fidelity.encoder_study import WORK

RESULTS = WORK / "minilm-tiered-study" / "results.json"
ADDITIVE = ("linear", "task_arithmetic")


def configurations(merges: list[dict], codec: str) -> dict:
    """(variant, K, group, operator) -> {budget: (accuracy difference in points, blockwise relative bound)}."""
    full = {(m["variant"], m["k"], tuple(m["experts"]), m["operator"]): m["accuracy"]["mean"]
            for m in merges if m["budget_pct"] == 100 and "accuracy" in m}
    out: dict = {}
    for m in merges:
        key = (m["variant"], m["k"], tuple(m["experts"]), m["operator"])
        if (m.get("codec") != codec or m["operator"] not in ADDITIVE or m["budget_pct"] >= 100
                or "accuracy" not in m or not m.get("bound") or key not in full):
            continue
        out.setdefault((m["variant"], m["k"], m.get("group", 0), m["operator"]), {})[m["budget_pct"]] = (
            100 * (m["accuracy"]["mean"] - full[key]), m["bound"]["blockwise_relative"])
    return out


def pick(cells: dict, f: float) -> tuple[int, float]:
    """(budget the rule picks, its accuracy difference); 100 % (difference 0) when no measured budget meets f."""
    for b, (diff, rel) in sorted(cells.items()):
        if rel <= f:
            return b, diff
    return 100, 0.0


def fit(merges: list[dict], codec: str) -> dict:
    cfg = configurations(merges, codec)
    fit_keys = [k for k in cfg if k[1] == 8 or (k[1] == 4 and k[2] == 0)]
    val_keys = [k for k in cfg if k not in fit_keys]
    limits = [min((rel for diff, rel in cells.values() if diff < -1), default=math.inf)
              for cells in (cfg[k] for k in fit_keys)]
    f = math.floor(min(limits) * 100) / 100 if limits else math.nan
    fitted = {k: pick(cfg[k], f) for k in fit_keys}
    validated = {k: pick(cfg[k], f) for k in val_keys}
    return {"codec": codec, "fraction": f,
            "fit": [sum(d >= -1 for _, d in fitted.values()), len(fitted)],
            "validation": [sum(d >= -1 for _, d in validated.values()), len(validated)],
            "picked_fit": {" ".join(map(str, k)): v for k, v in fitted.items()},
            "picked_validation": {" ".join(map(str, k)): v for k, v in validated.items()}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else RESULTS
    merges = json.loads(path.read_text())["merges"]
    for codec in ("progressive", "off"):
        r = fit(merges, codec)
        print(f"{codec}: f = {r['fraction']:g}; fit {r['fit'][0]}/{r['fit'][1]} within 1 point, "
              f"validation {r['validation'][0]}/{r['validation'][1]}")
        for name in ("picked_fit", "picked_validation"):
            print(f"  {name}: " + "; ".join(f"{k} -> {b} % ({d:+.1f})" for k, (b, d) in r[name].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
