"""docs/benchmarks/search.md from benchmarks/search.py's results: tables side by side and the goals, met or not."""

from __future__ import annotations

MIB = 1 << 20


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _best_default(defaults: dict) -> tuple[str, dict]:
    """The default recipe a user would pick: the best on validation (the held-out set is not looked at)."""
    name = max(defaults, key=lambda m: defaults[m]["validation"])
    return name, defaults[name]


def goals(k: dict) -> list[tuple[str, str, bool]]:
    name, default = _best_default(k["defaults"])
    cma, same, timed = k["cmaes"], k["mergepipe_same_trials"], k["mergepipe_same_time"]
    out = []
    for label, run in (("same trials", same), ("same wall time", timed)):
        out.append((f"K={k['k']} search ({label}) beats the best default recipe ({name}) on held-out accuracy",
                    f"{run['best_heldout']:.1f} vs {default['heldout']:.1f} ({run['best_heldout'] - default['heldout']:+.1f} points)",
                    run["best_heldout"] > default["heldout"]))
        out.append((f"K={k['k']} search ({label}) within 0.5 points of CMA-ES's best (held-out)",
                    f"{run['best_heldout']:.1f} vs {cma['best_heldout']:.1f} ({run['best_heldout'] - cma['best_heldout']:+.1f})",
                    run["best_heldout"] >= cma["best_heldout"] - 0.5))
    out.append((f"K={k['k']} search (same trials) reads <= 1/4 of CMA-ES's expert bytes",
                f"{_gib(same['expert_read'])} vs {_gib(cma['expert_read'])} ({same['expert_read'] / cma['expert_read']:.2f}x)",
                same["expert_read"] <= cma["expert_read"] / 4))
    out.append((f"K={k['k']} search (same trials) takes <= 1/2 of CMA-ES's wall time",
                f"{same['seconds']:.0f} s vs {cma['seconds']:.0f} s ({same['seconds'] / cma['seconds']:.2f}x)",
                same["seconds"] <= cma["seconds"] / 2))
    return out


def _k_section(k: dict) -> list[str]:
    cma, same, timed = k["cmaes"], k["mergepipe_same_trials"], k["mergepipe_same_time"]
    lines = [f"### K = {k['k']} ({', '.join(k['tasks'])}; experts {_gib(k['expert_bytes'])})", "",
             "| recipe or search | trials (pruned) | expert bytes read | wall time | validation acc. | held-out acc. |",
             "|---|---|---|---|---|---|"]
    for name, d in k["defaults"].items():
        lines.append(f"| default {name} | 1 | {_gib(k['expert_bytes'])} | - | {d['validation']:.1f} | {d['heldout']:.1f} |")
    lines.append(f"| CMA-ES, full fidelity, merged to disk | {cma['trials']} | {_gib(cma['expert_read'])} | "
                 f"{cma['seconds']:.0f} s | {cma['best_validation']:.1f} | {cma['best_heldout']:.1f} |")
    for label, run in (("same trials", same), ("CMA-ES's wall time", timed)):
        lines.append(f"| MergePipe TPE + Hyperband 10/25/100 %, in memory ({label}) | {run['trials']} ({run['pruned']}) "
                     f"| {_gib(run['expert_read'])} | {run['seconds']:.0f} s | {run['best_validation']:.1f} | "
                     f"{run['best_heldout']:.1f} |")
    lines += ["", "Low-fidelity merges of MergePipe's same-trials search (budget: merges, mean score, mean "
              "relative bound):", ""]
    by_budget: dict = {}
    for s in same["steps"]:
        by_budget.setdefault(s["budget"], []).append(s)
    for budget, steps in by_budget.items():
        mean = sum(s["score"] for s in steps) / len(steps)
        bound = sum(s["bound"] or 0 for s in steps) / len(steps)
        lines.append(f"- {budget}: {len(steps)} merges, mean validation {mean:.1f}, mean bound {bound:.3g}")
    for label, run in (("same trials", same), ("CMA-ES's wall time", timed)):
        agree = run.get("rank_agreement") or {}
        if agree:
            lines.append(f"- rank agreement with the 100 % score ({label}; Spearman's rho over the trials that reached "
                         "100 %): " + ", ".join(f"{b} {a['rho']:+.2f} ({a['trials']} trials)" for b, a in agree.items()))
    return lines + [""]


def render(res: dict) -> str:
    lines = ["# Recipe search: the budget as the fidelity", "",
             f"Run {res['run']}, {res['cpus']} CPUs, torch {res['torch']}, {res['seconds'] / 60:.0f} min in all. "
             "Reproduce: `python -m benchmarks.search` (families: see the script's docstring).", "",
             "Family A (docs/fidelity: all-MiniLM-L6-v2 full fine-tunes, heads outside the merge). Objective: mean "
             "validation accuracy (%) over the merged tasks, each with the merged encoder and its own head; "
             "report: held-out accuracy, scored only for each search's best recipe and the default recipes. "
             "Space (both searches): task_arithmetic or ties, per-expert weight in [0.1, 1.5] and, for ties, density in "
             "[0.1, 1.0] (CMA-ES samples the method independently, as Optuna's CMA-ES does with a choice). "
             "The baseline runs mergekit-evolve's loop: CMA-ES proposes, the candidate is merged in full to disk, the "
             "model is loaded back and scored. The full merge is MergePipe's full-read reference merge "
             "(research/baselines.naive_merge: every byte of every expert read, merged with torch, one file "
             "written), the work mergekit does: mergekit 0.1.5 itself cannot merge a BertModel (its bert "
             "architecture's weight aliases are a tuple that plan_tensor adds to a list: TypeError). Expert bytes "
             "are the bytes of expert tensors each merge reads (the full merge reads every tensor of every expert; "
             "MergePipe's are its realized reads, checked against each plan).",
             "", "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for k in res["family_a"]:
        lines += [f"| {g} | {m} | {'yes' if ok else 'no'} |" for g, m, ok in goals(k)]
    lines += ["", "## Family A", ""]
    for k in res["family_a"]:
        lines += _k_section(k)
    b = res.get("family_b")
    if b:
        best = b["best"] or {}
        lines += ["## Family B (tiny Llama, task-suite objective)", "", *([b["note"], ""] if b.get("note") else []),
                  f"task_arithmetic over {', '.join(b['tasks'])}, per-expert weight and lambda searched, TPE + "
                  f"successive halving at 25/100 %: {b['trials']} trials ({b['pruned']} pruned) in {b['seconds']:.0f} s. "
                  f"Best: validation {best.get('score', float('nan')):.3f}, held-out "
                  f"{best.get('holdout') if best.get('holdout') is not None else float('nan'):.3f} (exact match); "
                  f"the default recipe (weights 1, lambda 1): validation {b['default']['validation']:.3f}, held-out "
                  f"{b['default']['heldout']:.3f}.", ""]
    return "\n".join(lines) + "\n"
