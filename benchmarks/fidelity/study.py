"""The merge-fidelity study: budgeted merges of a trained family, in weights and in behaviour.

    python -m benchmarks.fidelity.study                   # builds the family if missing, ~10-15 min
    python -m benchmarks.fidelity.study --quick           # fewer examples, no extra random seeds

For each operator (linear, task_arithmetic, ties, dare_ties) it makes the full-budget merge, then the
budgeted merges at 5, 10, 25, 50 % of the full expert read under every planner strategy (norm,
conflict, kept, random, uniform; the 100 % point is shared). Per merge it records per-task exact-match
accuracy and mean, the relative l2 deviation from that operator's full-budget merge (see
mergepipe.research.evaluate), bytes read (planned and realized), the plan's bound (additive operators) and
seconds. Base and experts are evaluated on the same held-out suite.

"Merge size" (skip with --no-merge-size, ~2.5 min on 2 cores): merges of K = 2 (4 disjoint pairs) and
K = 4 (2 disjoint groups) experts, every operator, norm at 10/25/50/100 % and random at 25 %, with the
accuracy on the merged experts' own tasks, their retention ((merge - base) / (expert - base), see
:func:`retention`) and F1 per K. Writes ``docs/fidelity/``:
results.json, README.md (tables and targets F1-F3, norm vs random) and Plotly charts (HTML, PNG when the
local chromium can render them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.research.evaluate import accuracy, bound_check, deviation
from mergepipe.ops.core import coefficient, get_op
from mergepipe.catalog.models import register

from benchmarks.fidelity.tasks import suite
from benchmarks.fidelity.train import DEFAULT_OUT, FULL, MINI, build_family

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / "work" / "fidelity"
DOCS = ROOT / "docs" / "fidelity"
OPERATORS = ("linear", "task_arithmetic", "ties", "dare_ties")
BUDGETS = (5, 10, 25, 50)  # percent; 100 % is the full-budget merge, shared by every strategy
STRATEGIES = ("norm", "conflict", "kept", "random", "uniform")
BLOCK_BYTES = 16 << 10
DENSITY = 0.5
LAMBDAS = (0.125, 0.25, 0.5, 1.0)
EVAL_SEED, VALID_SEED = 10_000, 20_000
# "merge size": merges of K = 2 and 4 experts (how merges are usually made), fewer budgets, norm + random 25 %
SIZE_BUDGETS = (10, 25, 50)
SIZE_RANDOM_BUDGET = 25
SIZE_LAMBDAS = (0.125, 0.25, 0.5, 0.75, 1.0)
MIN_GAIN = 0.10  # retention is only defined on tasks where the expert beats the base by >= 10 points


def op_params(op: str, lam: float | None) -> dict:
    """Operator parameters of the study (why: see the README)."""
    if op == "linear":
        return {}
    if op == "task_arithmetic":
        return {"lam": lam}
    if op == "ties":
        return {"density": DENSITY}
    if op == "dare_ties":
        return {"density": DENSITY, "normalize": True}
    raise ValueError(op)


def size_groups(tasks) -> dict[int, list[tuple[str, ...]]]:
    """The merge-size study's fixed expert groups: K = 2 pairs task i with task i + n/2 (in suite order),
    K = 4 joins consecutive pairs. For the 8 tasks: 4 disjoint pairs, 2 disjoint groups of 4."""
    tasks = list(tasks)
    half = len(tasks) // 2
    pairs = [(tasks[i], tasks[i + half]) for i in range(half)]
    out = {2: pairs}
    quads = [pairs[2 * j] + pairs[2 * j + 1] for j in range(len(pairs) // 2)]
    if quads:
        out[4] = quads
    return out


def retention(merged: dict, base: dict, experts: dict, tasks, min_gain: float = MIN_GAIN) -> dict:
    """Share of each expert's gain over the base that a merge keeps, on the merged experts' own tasks.

    ``merged`` and ``base`` are per-task accuracies, ``experts[t]`` the accuracy of task t's expert on t.
    Per task r_t = (merged_t - base_t) / (expert_t - base_t): 1 = the expert's skill kept in full, 0 = the
    base's level, < 0 = worse than the base. Tasks where the expert gains less than ``min_gain`` over
    the base are left out (the ratio is undefined or noise there); ``mean`` averages the rest (None if none)."""
    per_task = {}
    for t in tasks:
        gain = experts[t] - base[t]
        per_task[t] = (merged[t] - base[t]) / gain if gain >= min_gain else None
    used = [v for v in per_task.values() if v is not None]
    return {"per_task": per_task, "mean": sum(used) / len(used) if used else None,
            "tasks_used": [t for t, v in per_task.items() if v is not None]}


def disjoint_block_bound(cat: Catalog, plan: dict) -> float:
    """A tighter bound on ||M_full - M_A|| for additive operators, from catalog statistics alone.

    Omitted updates of different (tensor, block) positions touch disjoint coordinates, so they are
    orthogonal: ||sum|| <= sqrt(sum over positions of (sum over experts of |c_i| ||delta_{i,t,b}||)^2).
    The plan's bound sums every omitted block norm (the triangle inequality across positions too)."""
    spec = get_op(plan["operator"])
    wsum = sum(e["weight"] for e in plan["experts"])
    coef = {e["id"]: abs(coefficient(spec, e["weight"], wsum, plan["params"])) for e in plan["experts"]}
    taken = {(eid, t, i) for eid, ts in plan["access"].items() for t, rs in ts.items() for a, b in rs
             for i in range(a, b)}
    pos: dict[tuple[str, int], float] = {}
    marks = ",".join("?" * len(coef))
    for mid, t, b, v in cat.conn.execute(
            f"SELECT model_id, tensor, block, delta_l2 FROM blocks WHERE delta_nnz > 0 AND model_id IN ({marks})",
            list(coef)):
        if (mid, t, b) not in taken:
            pos[(t, b)] = pos.get((t, b), 0.0) + coef[mid] * v
    return math.sqrt(sum(x * x for x in pos.values()))


class Study:
    def __init__(self, family: dict, out: Path, n_eval: int, log=print):
        tasks = tuple(family["experts"])
        self.family = family
        self.out = out
        self.log = log
        if out.exists():
            shutil.rmtree(out)
        (out / "merges").mkdir(parents=True)
        self.cat = Catalog(str(out / "catalog.sqlite"), create=True)
        self.experts = list(family["experts"])
        self.suite = suite(n_eval, EVAL_SEED, tasks)
        self.valid = suite(max(50, n_eval // 2), VALID_SEED, tasks)
        self.n = 0

    def setup(self) -> dict:
        t0 = time.perf_counter()
        register(self.cat, "base", self.family["base"])
        for task in self.experts:
            register(self.cat, task, self.family["experts"][task], base_id="base")
        analyze(self.cat, self.experts, block_bytes=BLOCK_BYTES)
        return {"analyze_seconds": time.perf_counter() - t0}

    def evaluate(self, model_dir, which=None) -> dict:
        return accuracy(model_dir, self.suite if which is None else which)

    def merge(self, op: str, budget: int, strategy: str, seed: int = 0, params=None, evaluate=True,
              reference: str | None = None, which=None, experts=None, tag: str = "") -> dict:
        self.n += 1
        mid = f"m{self.n:03d}{tag}-{op}-{budget}-{strategy}-s{seed}"
        out = self.out / "merges" / mid
        t0 = time.perf_counter()
        plan, _snap, manifest = merge(self.cat, "base", list(experts or self.experts), str(out), operator=op,
                                     budget=f"{budget}%",
                                     strategy=strategy, seed=seed, model_id=mid, **(params or {}))
        secs = time.perf_counter() - t0
        rec = {"operator": op, "budget_pct": budget, "strategy": strategy, "seed": seed, "model_id": mid,
               "experts": list(experts or self.experts),
               "dir": str(out), "plan_id": plan.id, "seconds": secs,
               "bytes_planned": plan["estimate"]["expert_read"],
               "bytes_realized": manifest.core["realized"]["expert_read"],
               "full_expert_bytes": plan["full_expert_bytes"], "budget_bytes": plan["budget"]["bytes"],
               "bound": plan["error_bound"]}
        if reference is not None:
            dev = deviation(out, reference, self.family["base"])
            dev.pop("per_tensor")
            rec["deviation"] = dev
            rec["bound_check"] = bound_check(plan.data, dev)
            if plan["error_bound"]:
                rec["bound_disjoint_blocks"] = disjoint_block_bound(self.cat, plan.data)
        if evaluate:
            t1 = time.perf_counter()
            rec["accuracy"] = self.evaluate(out, which)
            rec["eval_seconds"] = time.perf_counter() - t1
        self.log(f"{mid}: {secs:.2f}s merge, read {rec['bytes_realized']}/{rec['full_expert_bytes']} B"
                 + (f", rel dev {rec['deviation']['relative']:.3e} (of update {rec['deviation']['relative_delta']:.3e})"
                    if "deviation" in rec else "")
                 + (f", acc {rec['accuracy']['mean']:.3f}" if evaluate else ""))
        return rec

    def pick_lambda(self) -> dict:
        """task_arithmetic's lambda: the best full-budget mean accuracy on a validation suite (its own seed)."""
        scores = {}
        for lam in LAMBDAS:
            rec = self.merge("task_arithmetic", 100, "norm", params={"lam": lam}, which=self.valid)
            scores[lam] = rec["accuracy"]["mean"]
            shutil.rmtree(rec["dir"])
        best = max(LAMBDAS, key=lambda lam: (scores[lam], -abs(lam - 0.25)))
        return {"candidates": {str(k): v for k, v in scores.items()}, "chosen": best}

    def pick_lambda_groups(self, k: int, groups) -> dict:
        """task_arithmetic's lambda for K-expert merges: the best full-budget accuracy on the merged experts'
        own tasks (validation suite), averaged over the K groups; ties go to the smaller lambda."""
        scores = {}
        for lam in SIZE_LAMBDAS:
            accs = []
            for i, g in enumerate(groups):
                rec = self.merge("task_arithmetic", 100, "norm", params={"lam": lam}, experts=g, tag=f"-k{k}g{i}",
                                 which={t: self.valid[t] for t in g})
                accs.append(rec["accuracy"]["mean"])
                shutil.rmtree(rec["dir"])
            scores[lam] = sum(accs) / len(accs)
        best = max(SIZE_LAMBDAS, key=lambda lam: (scores[lam], -lam))
        return {"candidates": {str(k): v for k, v in scores.items()}, "chosen": best}

    def merge_size(self, base: dict, experts: dict) -> dict:
        """Merges of K = 2 and 4 experts (:func:`size_groups`) under norm budgets and random at 25 %."""
        t0 = time.perf_counter()
        groups = size_groups(self.experts)
        own = {t: experts[t]["per_task"][t] for t in self.experts}
        out = {"groups": {str(k): [list(g) for g in gs] for k, gs in groups.items()}, "min_gain": MIN_GAIN,
               "budgets_pct": [*SIZE_BUDGETS, 100], "random_budget_pct": SIZE_RANDOM_BUDGET,
               "lambda_selection": {}, "merges": []}
        for k, gs in groups.items():
            lam = self.pick_lambda_groups(k, gs)
            out["lambda_selection"][str(k)] = lam
            for i, g in enumerate(gs):
                for op in OPERATORS:
                    params = op_params(op, lam["chosen"])
                    runs = [(100, "norm"), *[(b, "norm") for b in SIZE_BUDGETS], (SIZE_RANDOM_BUDGET, "random")]
                    ref = None
                    for b, strategy in runs:
                        rec = self.merge(op, b, strategy, params=params, experts=g, tag=f"-k{k}g{i}", reference=ref)
                        if b == 100:
                            rec["strategy"] = "all"
                            ref = rec["dir"]
                        rec.update(k=k, group=i, params=params,
                                   own_mean=sum(rec["accuracy"]["per_task"][t] for t in g) / len(g),
                                   retention=retention(rec["accuracy"]["per_task"], base["per_task"], own, g))
                        if b != 100:  # only the reference is kept until its group is done (disk)
                            shutil.rmtree(rec["dir"])
                        out["merges"].append(rec)
                    shutil.rmtree(ref)
        for m in out["merges"]:
            m.pop("dir", None)
        out["seconds"] = time.perf_counter() - t0
        return out


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    spec = MINI if args.mini else FULL
    fam_dir = Path(args.family or (DEFAULT_OUT.with_name("mini") if args.mini else DEFAULT_OUT))
    if args.expert_lr is not None:  # same base, experts fine-tuned with another learning rate
        spec = replace(spec, expert_lr=args.expert_lr)
        if args.family is None:
            fam_dir = sweep_dir(args.expert_lr, "family")
        if not (fam_dir / "base").exists():
            build_family(DEFAULT_OUT, replace(FULL, tasks=()))  # the shared base
            fam_dir.mkdir(parents=True, exist_ok=True)
            shutil.copytree(DEFAULT_OUT / "base", fam_dir / "base")
    t0 = time.perf_counter()
    family = build_family(fam_dir, spec)
    build_seconds = time.perf_counter() - t0
    fam_meta = {name: json.loads((Path(p) / "fidelity.json").read_text())
                for name, p in [("base", family["base"]), *family["experts"].items()]}
    study = Study(family, WORK / ("study-mini" if args.mini else "study"), args.n_eval)
    setup = study.setup()
    results = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version()},
        # the experts' spec: the same as the base's except, in an --expert-lr run, the fine-tuning lr
        "family": {"dir": str(fam_dir), "spec": json.loads(fam_meta[next(iter(family["experts"]))]["spec"]),
                   "params": fam_meta["base"]["params"],
                   "train_seconds": {k: round(v["seconds"], 1) for k, v in fam_meta.items()},
                   "train_loss_last": {k: round(v["loss_last"], 4) for k, v in fam_meta.items()}},
        "settings": {"block_bytes": BLOCK_BYTES, "density": DENSITY, "budgets_pct": [*BUDGETS, 100],
                     "strategies": list(STRATEGIES), "operators": list(OPERATORS), "n_eval_per_task": args.n_eval,
                     "eval_seed": EVAL_SEED, "valid_seed": VALID_SEED, "random_seeds": args.random_seeds},
        "setup": setup,
    }
    study.log(f"family ready ({build_seconds:.0f}s), analyzed in {setup['analyze_seconds']:.1f}s")
    results["base"] = study.evaluate(family["base"])
    results["experts"] = {t: study.evaluate(p) for t, p in family["experts"].items()}
    study.log(f"base {results['base']['mean']:.3f}; experts on own task: "
              + ", ".join(f"{t} {results['experts'][t]['per_task'][t]:.2f}" for t in family["experts"]))
    lam = study.pick_lambda()
    results["lambda_selection"] = lam
    merges = []
    for op in OPERATORS:
        params = op_params(op, lam["chosen"])
        full = study.merge(op, 100, "norm", params=params)
        full["strategy"] = "all"
        ref = full["dir"]
        dev = deviation(ref, ref, family["base"])
        dev.pop("per_tensor")
        full["deviation"] = dev
        full["bound_check"] = None
        merges.append(full)
        for strategy in STRATEGIES:
            seeds = args.random_seeds if strategy == "random" and op != "dare_ties" else [0]
            for seed in seeds:
                for b in BUDGETS:
                    merges.append(study.merge(op, b, strategy, seed=seed, params=params, reference=ref,
                                              evaluate=(seed == seeds[0])))
    results["params"] = {op: op_params(op, lam["chosen"]) for op in OPERATORS}
    results["merges"] = merges
    if not args.no_merge_size:
        results["merge_size"] = study.merge_size(results["base"], results["experts"])
        study.log(f"merge size: {results['merge_size']['seconds']:.0f}s")
    results["seconds_total"] = time.perf_counter() - t_start
    return results


# --- analysis and report ---------------------------------------------------------------------------
def _get(merges, op, strategy, budget, seed=0):
    for m in merges:
        if m["operator"] == op and m["budget_pct"] == budget and m["seed"] == seed and (
                m["strategy"] == strategy or (budget == 100 and m["strategy"] == "all")):
            return m
    return None


def targets(results: dict) -> list[dict]:
    merges = results["merges"]
    rows = []
    for op in ("ties", "task_arithmetic"):
        full = _get(merges, op, "all", 100)["accuracy"]["mean"]
        a25 = _get(merges, op, "norm", 25)["accuracy"]["mean"]
        rows.append({"target": f"F1 {op}: mean accuracy at 25 % within 1 point of full budget (norm)",
                     "measured": f"{100 * a25:.1f} vs {100 * full:.1f} (diff {100 * (a25 - full):+.1f} points)",
                     "met": abs(a25 - full) <= 0.01 + 1e-12})
    for op in OPERATORS:
        m = _get(merges, op, "norm", 50)
        r = m["deviation"]["relative"]
        rows.append({"target": f"F2 {op}: relative l2 deviation <= 5e-4 at 50 % (norm)",
                     "measured": f"{r:.2e} (of the update: {m['deviation']['relative_delta']:.2e})",
                     "met": r <= 5e-4})
    checks = [m for m in merges if m.get("bound_check")]
    worst = max(checks, key=lambda m: m["bound_check"]["realized_absolute"] / max(m["bound_check"]["bound_absolute"], 1e-30))
    ratio = worst["bound_check"]["realized_absolute"] / max(worst["bound_check"]["bound_absolute"], 1e-30)
    rows.append({"target": "F3 additive operators: realized deviation <= planned bound (every merge)",
                 "measured": f"{sum(m['bound_check']['holds'] for m in checks)}/{len(checks)} hold; "
                             f"max realized/bound {ratio:.3f} ({worst['model_id']})" + _disjoint_note(checks),
                 "met": all(m["bound_check"]["holds"] for m in checks)})
    for op in OPERATORS:
        losses = []
        for b in BUDGETS:
            norm = _get(merges, op, "norm", b)["deviation"]["relative"]
            rand = [m["deviation"]["relative"] for m in merges if m["operator"] == op and m["strategy"] == "random"
                    and m["budget_pct"] == b]
            if not norm < min(rand):
                losses.append(f"{b}%")
        rows.append({"target": f"norm beats random on deviation at every budget < 100 % ({op})",
                     "measured": "all budgets, every random seed" if not losses else "not at " + ", ".join(losses),
                     "met": not losses})
    rows[2:2] = size_targets(results)  # after the 8-expert F1 rows
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def size_cell(ms: dict, k: int, op: str, budget: int, strategy: str = "norm") -> dict | None:
    """Means over the K-expert groups of one operator/budget/strategy: own-task accuracy, retention (each
    merge's mean over its scored tasks, then over groups), accuracy over all tasks, rel. deviation."""
    sel = [m for m in ms["merges"] if m["k"] == k and m["operator"] == op and m["budget_pct"] == budget
           and (m["strategy"] == strategy or (budget == 100 and m["strategy"] == "all"))]
    if not sel:
        return None
    return {"own": _mean([m["own_mean"] for m in sel]), "retention": _mean([m["retention"]["mean"] for m in sel]),
            "all": _mean([m["accuracy"]["mean"] for m in sel]),
            "deviation": _mean([m["deviation"]["relative"] for m in sel if "deviation" in m]),
            "own_per_group": [m["own_mean"] for m in sorted(sel, key=lambda m: m["group"])], "n": len(sel)}


def size_targets(results: dict) -> list[dict]:
    """F1 per merge size: at 25 % (norm) the own-task mean accuracy, averaged over the K groups, within
    1 point of the full-budget merge (ties and task_arithmetic)."""
    ms = results.get("merge_size")
    if not ms:
        return []
    rows = []
    for k in sorted(int(x) for x in ms["groups"]):
        for op in ("ties", "task_arithmetic"):
            full, a25 = size_cell(ms, k, op, 100), size_cell(ms, k, op, 25)
            diffs = [a - f for a, f in zip(a25["own_per_group"], full["own_per_group"])]
            rows.append({"target": f"F1 K={k} {op}: own-task mean accuracy at 25 % within 1 point of full budget "
                                   f"(norm, mean of {full['n']} groups)",
                         "measured": f"{100 * a25['own']:.1f} vs {100 * full['own']:.1f} (diff "
                                     f"{100 * (a25['own'] - full['own']):+.1f} points; per group "
                                     + ", ".join(f"{100 * d:+.1f}" for d in diffs) + ")",
                         "met": abs(a25["own"] - full["own"]) <= 0.01 + 1e-12})
    return rows


def _tightness(merges) -> str:
    ms = [m for m in merges if "bound_disjoint_blocks" in m]
    if not ms:
        return "not computed in this run"
    f = [m["bound"]["absolute"] / m["bound_disjoint_blocks"] for m in ms]
    return f"{min(f):.0f}-{max(f):.0f}x tighter than the plan's bound over the {len(ms)} additive merges"


def _disjoint_note(checks) -> str:
    ms = [m for m in checks if "bound_disjoint_blocks" in m]
    if not ms:
        return ""
    ratios = [m["bound_check"]["realized_absolute"] / m["bound_disjoint_blocks"] for m in ms]
    held = sum(m["bound_check"]["realized_absolute"] <= m["bound_disjoint_blocks"] * (1 + 1e-5) for m in ms)
    return f"; disjoint-block bound: {held}/{len(ms)} hold, max realized/bound {max(ratios):.3f}"


def best_strategies(results: dict) -> dict:
    """Per operator and budget: the strategy with the lowest deviation and the one with the best accuracy."""
    out = {}
    for op in OPERATORS:
        for b in BUDGETS:
            cands = [m for m in results["merges"] if m["operator"] == op and m["budget_pct"] == b and "accuracy" in m]
            out[f"{op} {b}%"] = {
                "lowest_deviation": min(cands, key=lambda m: m["deviation"]["relative"])["strategy"],
                "best_accuracy": max(cands, key=lambda m: m["accuracy"]["mean"])["strategy"]}
    return out


def _pct(x):
    return f"{100 * x:.1f}"


def markdown(results: dict, rows: list[dict], charts: list[Path]) -> str:
    merges = results["merges"]
    fam = results["family"]
    spec = fam["spec"]
    tasks = list(results["base"]["per_task"])
    lines = [
        "# Merge fidelity under a budget",
        "",
        f"Run {results['started']}, {results['machine']['cpus']} CPUs ({results['machine']['threads']} threads), "
        f"torch {results['machine']['torch']}; study wall time {results['seconds_total'] / 60:.1f} min. "
        "Reproduce: `python -m benchmarks.fidelity.train` (the family, cached in `benchmarks/work/fidelity/`), "
        "then `python -m benchmarks.fidelity.study`. Raw numbers: [results.json](results.json).",
        "",
        "## Family",
        "",
        f"A tiny Llama (`LlamaForCausalLM`, d={spec['hidden']}, {spec['layers']} layers, {spec['heads']} heads, "
        f"MLP {spec['intermediate']}, {fam['params']:,} parameters, fp32, 41-token character vocabulary) pretrained for "
        f"{spec['pretrain_steps']} steps (batch {spec['batch']}, lr {spec['pretrain_lr']}, cosine) on generic synthetic "
        f"text mixed with {100 * spec['task_fraction']:.0f} % task examples, then fine-tuned into {len(spec['tasks'])} "
        f"experts, one per task ({spec['expert_steps']} steps, lr {spec['expert_lr']}, loss on answer tokens). "
        f"Training time: base {fam['train_seconds']['base']:.0f} s, experts "
        f"{min(v for k, v in fam['train_seconds'].items() if k != 'base'):.0f}-"
        f"{max(v for k, v in fam['train_seconds'].items() if k != 'base'):.0f} s each.",
        "",
        f"Evaluation: {results['settings']['n_eval_per_task']} held-out examples per task (seed "
        f"{results['settings']['eval_seed']}), greedy decoding, exact match of the answer ('held out' means a different seed: tasks with tiny input "
        "spaces, such as modadd's 100 sums, necessarily repeat training inputs). Catalog grid "
        f"{results['settings']['block_bytes'] // 1024} KiB blocks.",
        "",
        "| model | " + " | ".join(tasks) + " | mean |",
        "|---|" + "---|" * (len(tasks) + 1),
        "| base | " + " | ".join(_pct(results["base"]["per_task"][t]) for t in tasks) + f" | {_pct(results['base']['mean'])} |",
    ]
    for e, acc in results["experts"].items():
        lines.append(f"| expert {e} | " + " | ".join(("**" + _pct(acc["per_task"][t]) + "**") if t == e else _pct(acc["per_task"][t])
                                                   for t in tasks) + f" | {_pct(acc['mean'])} |")
    for op in OPERATORS:
        m = _get(merges, op, "all", 100)
        lines.append(f"| {op} 100 % | " + " | ".join(_pct(m["accuracy"]["per_task"][t]) for t in tasks)
                     + f" | {_pct(m['accuracy']['mean'])} |")
    lam = results["lambda_selection"]
    lines += [
        "",
        "Operator parameters: equal weights; `linear` = average (normalize on); `task_arithmetic` "
        f"λ = {lam['chosen']:g}, chosen by full-budget mean accuracy on a separate validation suite from "
        + ", ".join(f"{k}: {_pct(v)}" for k, v in lam["candidates"].items())
        + f"; `ties` density {DENSITY} (normalize on, the default); `dare_ties` density {DENSITY}, rescale on, "
        "normalize on (as ties, so the two are comparable; off would sum 8 deltas), seed 0.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else 'no'} |" for r in rows],
        "",
        "Relative l2 deviation = ‖M_A − M_full‖₂ / ‖M_full‖₂ over all weights (the paper's definition: deviation of "
        "the budgeted merge from the full-budget merge, relative to the full-budget model). The deviation relative "
        "to the merged update, ‖M_A − M_full‖₂ / ‖M_full − base‖₂, is what the planner's bound is expressed in and "
        "is given in brackets / in results.json. The plan's bound (F3) sums the norms of all omitted blocks; "
        "it holds everywhere but is loose. Omitted blocks at different positions are orthogonal, so "
        "sqrt(Σ_positions (Σ_experts |c_i|·‖Δ_i,t,b‖)²) is also a valid bound from the same catalog statistics "
        f"({_tightness(merges)}; the 'disjoint-block bound' in the tables below).",
        "",
    ]
    for op in OPERATORS:
        full = _get(merges, op, "all", 100)
        lines += [f"## {op}", "",
                  "Mean accuracy (%) / relative l2 deviation / expert bytes read (realized, % of full read). "
                  f"Full budget: accuracy {_pct(full['accuracy']['mean'])}, {full['bytes_realized'] / 1e6:.2f} MB read.",
                  "", "| strategy | " + " | ".join(f"{b} %" for b in BUDGETS) + " |", "|---|" + "---|" * len(BUDGETS)]
        for s in STRATEGIES:
            cells = []
            for b in BUDGETS:
                m = _get(merges, op, s, b)
                cells.append(f"{_pct(m['accuracy']['mean'])} / {m['deviation']['relative']:.2e} / "
                             f"{100 * m['bytes_realized'] / m['full_expert_bytes']:.1f} %")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        rs = sorted({m["seed"] for m in merges if m["operator"] == op and m["strategy"] == "random"})
        if len(rs) > 1:
            cells = []
            for b in BUDGETS:
                vals = [m["deviation"]["relative"] for m in merges if m["operator"] == op and m["strategy"] == "random"
                        and m["budget_pct"] == b]
                cells.append(f"{statistics.mean(vals):.2e} ({min(vals):.2e}-{max(vals):.2e})")
            lines.append(f"| random, deviation over seeds {rs} | " + " | ".join(cells) + " |")
        if op in ("linear", "task_arithmetic"):
            cells = []
            for b in BUDGETS:
                m = _get(merges, op, "norm", b)
                cells.append(f"{m['deviation']['absolute']:.3g} ≤ {m['bound']['absolute']:.3g}"
                             + (f" (≤ {m['bound_disjoint_blocks']:.3g})" if "bound_disjoint_blocks" in m else ""))
            lines.append("| norm: realized ‖M_A − M_full‖ ≤ plan bound (≤ disjoint-block bound) | "
                         + " | ".join(cells) + " |")
        lines.append("")
    lines += findings(results)
    lines += merge_size_markdown(results)
    lines += ["## Which strategy wins", "", "| operator, budget | lowest deviation | best mean accuracy |", "|---|---|---|"]
    for k, v in best_strategies(results).items():
        lines.append(f"| {k} | {v['lowest_deviation']} | {v['best_accuracy']} |")
    sweep = sweep_rows(results)
    if len(sweep) > 1:
        lines += ["", "## Sensitivity: the experts' fine-tuning learning rate", "",
                  "Same base, experts fine-tuned with other learning rates (`python -m benchmarks.fidelity.study "
                  "--expert-lr LR`). ‖M_full − base‖/‖M_full‖ is the size of the linear merge's update relative to the "
                  "model; the relative deviation at a given budget scales with it.", "",
                  "| expert lr | experts, own task | base | linear 100 % | ties 100 % | ‖M_full − base‖/‖M_full‖ (linear) "
                  "| rel. deviation at 50 %, linear | ties |", "|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            lines.append(f"| {r['expert_lr']:g} | {_pct(r['experts_own_task'])} | {_pct(r['base'])} | "
                         f"{_pct(r['linear_full_acc'])} | {_pct(r['ties_full_acc'])} | {r['update_over_model']:.3f} | "
                         f"{r['linear_dev50']:.2e} | {r['ties_dev50']:.2e} |")
    lines += ["", "## Charts", ""]
    for c in charts:
        if c.suffix == ".png":
            lines.append(f"![{c.stem}]({c.name})")
        else:
            lines.append(f"- [{c.stem} (interactive)]({c.name})")
    return "\n".join(lines) + "\n"


def _r(x):
    return "n/a" if x is None else f"{round(x, 2) + 0.0:.2f}"  # + 0.0: no "-0.00"


def merge_size_markdown(results: dict) -> list[str]:
    ms = results.get("merge_size")
    if not ms:
        return []
    base = results["base"]["per_task"]
    own = {t: a["per_task"][t] for t, a in results["experts"].items()}
    scored = [t for t in own if own[t] - base[t] >= ms["min_gain"]]
    ks = sorted(int(x) for x in ms["groups"])
    budgets = ms["budgets_pct"]
    rb = ms["random_budget_pct"]
    lines = ["## Merge size: 2 and 4 experts", "",
             "Users usually merge a few experts, not eight. Same family and evaluation suite; fixed, disjoint groups "
             f"(task i paired with task i + {len(base) // 2} in suite order; K = 4 joins consecutive pairs): "
             + "; ".join(f"K = {k}: " + ", ".join("(" + " + ".join(g) + ")" for g in ms["groups"][str(k)]) for k in ks)
             + f". Budgets {', '.join(str(b) for b in budgets)} % with the norm strategy, and random at {rb} % as a "
             "baseline; operators as above (ties / dare_ties density "
             f"{DENSITY}), task_arithmetic λ chosen per K by full-budget own-task accuracy on the validation suite ("
             + "; ".join(f"K = {k}: λ = {ms['lambda_selection'][str(k)]['chosen']:g} from "
                         + ", ".join(f"{lam}: {_pct(v)}" for lam, v in ms['lambda_selection'][str(k)]['candidates'].items())
                         for k in ks)
             + f"). Evaluation: all {len(base)} tasks, {results['settings']['n_eval_per_task']} examples each, as above.",
             "",
             "**Retention** of a merge = mean over the merged experts' own tasks of (merge − base) / (expert − base) "
             "on that task: 1 keeps the expert's skill, 0 is the base's level, < 0 is worse than the base. Tasks where "
             f"the expert gains less than {100 * ms['min_gain']:.0f} points over the base are left out of it (there "
             f"the ratio is undefined or noise): retention is scored on {', '.join(scored)}"
             + ("; every group has at least one of them" if all(set(g) & set(scored) for k in ks
                                                                for g in ms["groups"][str(k)]) else "")
             + ". Cells are means over the K groups: own-task mean accuracy (%) / retention / mean accuracy "
             "over all tasks (%).", ""]
    head = [*[f"{b} %" for b in budgets], f"random {rb} %"]
    for k in ks:
        n = len(ms["groups"][str(k)])
        lines += [f"**K = {k}** ({n} group{'s' if n > 1 else ''}; the experts alone score "
                  + ", ".join(f"{_pct(_mean([own[t] for t in g]))}" for g in ms["groups"][str(k)])
                  + " % on their own tasks, the base "
                  + ", ".join(f"{_pct(_mean([base[t] for t in g]))}" for g in ms["groups"][str(k)]) + " %)", "",
                  "| operator | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
        for op in OPERATORS:
            cells = []
            for b, st in [*[(b, "norm") for b in budgets], (rb, "random")]:
                c = size_cell(ms, k, op, b, st)
                cells.append(f"{_pct(c['own'])} / {_r(c['retention'])} / {_pct(c['all'])}")
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Per group, retention at 100 % and 25 % (norm):", "",
              "| group | " + " | ".join(f"{op} 100 % / 25 %" for op in OPERATORS) + " |",
              "|---|" + "---|" * len(OPERATORS)]
    for k in ks:
        for i, g in enumerate(ms["groups"][str(k)]):
            cells = []
            for op in OPERATORS:
                v = [next(m["retention"]["mean"] for m in ms["merges"] if m["k"] == k and m["group"] == i
                          and m["operator"] == op and m["budget_pct"] == b and m["strategy"] in (st, "all"))
                     for b, st in ((100, "all"), (25, "norm"))]
                cells.append(f"{_r(v[0])} / {_r(v[1])}")
            lines.append(f"| K={k}: {' + '.join(g)} | " + " | ".join(cells) + " |")
    lines += [""] + size_findings(results) + [""]
    return lines


def all_experts_retention(results: dict, op: str, budget: int):
    """Retention of the main study's merge of every expert (norm strategy), over all tasks."""
    m = _get(results["merges"], op, "norm" if budget < 100 else "all", budget)
    own = {t: a["per_task"][t] for t, a in results["experts"].items()}
    return retention(m["accuracy"]["per_task"], results["base"]["per_task"], own, list(own))["mean"]


def size_findings(results: dict) -> list[str]:
    """Computed observations on the merge-size section (numbers and directions from this run)."""
    ms = results["merge_size"]
    ks = sorted(int(x) for x in ms["groups"])
    out = []
    full = {(k, op): size_cell(ms, k, op, 100) for k in ks for op in OPERATORS}
    b25 = {(k, op): size_cell(ms, k, op, 25) for k in ks for op in OPERATORS}
    r25 = {(k, op): size_cell(ms, k, op, ms["random_budget_pct"], "random") for k in ks for op in OPERATORS}
    eight = {op: _get(results["merges"], op, "all", 100)["accuracy"]["mean"] for op in OPERATORS}
    best = max(full, key=lambda x: full[x]["retention"])
    out.append("- **Retention by merge size (full budget).** "
               + "; ".join(f"K = {k}: " + ", ".join(f"{op} {_r(full[(k, op)]['retention'])}" for op in OPERATORS)
                           for k in ks)
               + f"; all {len(results['experts'])} (the study above, on the same tasks): "
               + ", ".join(f"{op} {_r(all_experts_retention(results, op, 100))}" for op in OPERATORS)
               + " (25 %: " + ", ".join(f"{op} {_r(all_experts_retention(results, op, 25))}" for op in OPERATORS) + ")"
               + f". Best: {best[1]} with K = {best[0]} ({_r(full[best]['retention'])}, own-task accuracy "
               f"{_pct(full[best]['own'])} %).")
    out.append(f"- **Accuracy over all tasks** at full budget (the {len(results['experts'])}-expert merges: "
               + ", ".join(f"{op} {_pct(eight[op])}" for op in OPERATORS) + f" %; base {_pct(results['base']['mean'])} %): "
               + "; ".join(f"K = {k}: " + ", ".join(f"{op} {_pct(full[(k, op)]['all'])}" for op in OPERATORS)
                           for k in ks) + " %.")
    moves = []
    for k in ks:
        for op in OPERATORS:
            d = b25[(k, op)]["retention"] - full[(k, op)]["retention"]
            moves.append(f"{op} K={k} {d:+.2f}")
    out.append("- **Budget 25 % vs full (retention, norm):** " + ", ".join(moves)
               + ". **Norm vs random at 25 % (retention):** "
               + ", ".join(f"{op} K={k} {_r(b25[(k, op)]['retention'])} vs {_r(r25[(k, op)]['retention'])}"
                           for k in ks for op in OPERATORS) + ".")
    # where the skills survive: per task, the best full-budget retention over operators (smallest K)
    k0 = ks[0]
    per_task = {}
    for m in ms["merges"]:
        if m["k"] == k0 and m["budget_pct"] == 100:
            for t, v in m["retention"]["per_task"].items():
                if v is not None:
                    per_task.setdefault(t, []).append((v, m["operator"]))
    kept = sorted(((max(v), t) for t, v in per_task.items()), reverse=True)
    out.append(f"- **Which skills survive a {k0}-expert merge** (best full-budget retention over the operators, per "
               "task): " + ", ".join(f"{t} {_r(v)} ({op})" for (v, op), t in kept) + ".")
    # interpretation: does a budget cost skill where the full merge has some to lose?
    gain = {(k, op): full[(k, op)]["retention"] for k in ks for op in OPERATORS}
    some = [x for x in gain if gain[x] is not None and gain[x] >= 0.2]
    little = [x for x in gain if gain[x] is not None and gain[x] < 0.1]
    kept25 = [b25[x]["retention"] / gain[x] for x in some]
    mean_k = {k: _mean([gain[(k, op)] for op in OPERATORS]) for k in ks}
    fewer = all(mean_k[a] > mean_k[b] for a, b in itertools.pairwise(ks))
    base, own = results["base"]["per_task"], {t: a["per_task"][t] for t, a in results["experts"].items()}
    unscored = [t for t in own if own[t] - base[t] < ms["min_gain"]]
    text = ("- **Interpretation.** " + ("Merging fewer experts keeps more of their skills" if fewer else
                                          "Merging fewer experts does not consistently keep more of their skills")
            + (f", but on this family only a {ks[0]}-expert merge keeps a measurable share, and only of some tasks"
               if some and all(k == ks[0] for k, _ in some) else ""))
    if some:
        text += (": the merges that keep at least 0.2 of the experts' gain at full budget ("
                 + ", ".join(f"{op} K={k}" for k, op in some)
                 + f") keep {100 * min(kept25):.0f}-{100 * max(kept25):.0f} % of that retention at a 25 % budget, so the "
                 "budget removes most of what the merge had kept")
    if little:
        text += ("; where a full merge keeps almost nothing (retention < 0.1: "
                 + ", ".join(f"{op} K={k}" for k, op in little)
                 + ", and the 8-expert merges above), a budgeted merge is closer to the base and its accuracy moves "
                 "with the base's own skills (" + ", ".join(unscored) + "), which is why budgeted merges can score higher there")
    lin = max(gain[(k, "linear")] for k in ks)
    lam = {k: ms["lambda_selection"][str(k)]["chosen"] for k in ks}
    text += (f". Plain averaging (linear) keeps at most {_r(lin)} at any K; what is kept comes from operators that do "
             "not divide each update by K (task_arithmetic with the tuned λ: "
             + ", ".join(f"{lam[k]:g} at K={k}" for k in ks) + "; ties / dare_ties, which average only agreeing signs)")
    out.append(text + ". Budgets do hurt, as soon as there is skill to lose; the 8-expert study's 'budget helps' "
               f"was a merge with little to lose. Retention is scored on the {len(own) - len(unscored)} tasks where the "
               f"experts gain at least {100 * ms['min_gain']:.0f} points, {results['settings']['n_eval_per_task']} examples each "
               "(a per-task accuracy's standard error is up to 3.5 points).")
    return out


def findings(results: dict) -> list[str]:
    """Short, computed observations (the numbers come from this run's results)."""
    merges = results["merges"]
    base = results["base"]
    own = {t: a["per_task"][t] for t, a in results["experts"].items()}
    lin = _get(merges, "linear", "all", 100)
    gains = [t for t in base["per_task"] if lin["accuracy"]["per_task"][t] > base["per_task"][t] + 0.02]
    upd = lin["deviation"]["update_norm"] / lin["deviation"]["reference_norm"]
    out = ["## Findings", "",
           f"- **Merges vs base and experts.** Experts reach {_pct(sum(own.values()) / len(own))} % on their own task "
           f"(mean), the base {_pct(base['mean'])} % over all tasks. The full-budget merges average "
           + ", ".join(f"{op} {_pct(_get(merges, op, 'all', 100)['accuracy']['mean'])}" for op in OPERATORS)
           + f" %: they keep only a small share of the experts' skills (linear gains more than 2 points over the base on "
           f"{', '.join(gains) or 'no task'}) and lose some of the base's own (length, max). Budgeted merges, which add "
           "less of each update, stay closer to the base and therefore often score *higher* than the full-budget merge: "
           "accuracy is not monotonic in the budget here, which is why F1 fails upwards.",
           f"- **Why F2 is far off.** Adam fine-tuning moves every weight: the linear merge's update is "
           f"{upd:.3f} of the model's norm (‖M_full − base‖/‖M_full‖), and no small set of blocks carries most of it: the "
           f"best half of the bytes by norm still leaves "
           f"{_get(merges, 'linear', 'norm', 50)['deviation']['relative_delta']:.2f} of the update's norm out (linear, "
           "norm, 50 %). The relative deviation at a given budget scales with that "
           "ratio (see the sensitivity table): 5e-4 at 50 % needs fine-tuning updates that are orders of magnitude smaller "
           "relative to the weights, or concentrated in few blocks, as in large pretrained LLMs.",
           ]
    rows = []
    for op in OPERATORS:
        for b in BUDGETS:
            n = _get(merges, op, "norm", b)["deviation"]["relative"]
            r = _get(merges, op, "random", b)["deviation"]["relative"]
            c = _get(merges, op, "conflict", b)["deviation"]["relative"]
            k = _get(merges, op, "kept", b)["deviation"]["relative"]
            rows.append((op, b, n, r, c, k))
    gain_r = [1 - n / r for _, _, n, r, _, _ in rows]
    gain_c = [1 - c / n for _, _, n, _, c, _ in rows]
    gain_k = [1 - k / n for op, _, n, _, _, k in rows if op == "ties"]
    out.append(f"- **Does the planner's choice matter?** In weight space, yes: norm-per-byte has "
               f"{100 * min(gain_r):.0f}-{100 * max(gain_r):.0f} % lower deviation than random selection at the same budget "
               f"for every operator and budget. The conflict-aware score is lower still in "
               f"{sum(g > 0 for g in gain_c)}/{len(gain_c)} operator-budget cells, by {100 * min(gain_c):+.1f} to "
               f"{100 * max(gain_c):+.1f} %; 'kept' changes the TIES deviation by {100 * min(gain_k):+.1f} to "
               f"{100 * max(gain_k):+.1f} % (it equals norm for the other operators). In accuracy the strategies differ by "
               "a few points with no consistent winner: on this family, accuracy tracks how close a merge stays to the "
               "base rather than how close it is to the full merge.")
    out.append("")
    return out


def charts(results: dict, out: Path) -> list[Path]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    colors = {"norm": "#1f77b4", "conflict": "#ff7f0e", "kept": "#2ca02c", "random": "#d62728", "uniform": "#9467bd"}
    merges = results["merges"]
    paths, figs = [], []
    xs = [*BUDGETS, 100]
    for op in OPERATORS:
        fig = make_subplots(rows=1, cols=3, subplot_titles=("mean exact-match accuracy", "relative l2 deviation from full",
                                                            "expert bytes read (MB)"))
        for s, color in colors.items():
            ms = [_get(merges, op, s, b) for b in xs]
            style = dict(mode="lines+markers", name=s, legendgroup=s, line=dict(color=color))
            fig.add_trace(go.Scatter(x=xs, y=[m["accuracy"]["mean"] for m in ms], **style), 1, 1)
            fig.add_trace(go.Scatter(x=xs[:-1], y=[m["deviation"]["relative"] for m in ms[:-1]], showlegend=False,
                                     **style), 1, 2)
            fig.add_trace(go.Scatter(x=xs, y=[m["bytes_realized"] / 1e6 for m in ms], showlegend=False, **style), 1, 3)
        base = results["base"]["mean"]
        fig.add_hline(y=base, line_dash="dot", line_color="gray", annotation_text="base", row=1, col=1)
        fig.update_xaxes(title_text="budget (% of full expert read)", type="log", tickvals=xs)
        fig.update_yaxes(type="log", row=1, col=2)
        fig.update_layout(title=f"{op}: fidelity vs budget, one line per planner strategy", height=440)
        p = out / f"{op}.html"
        fig.write_html(p, include_plotlyjs="cdn")
        paths.append(p)
        figs.append((fig, p.with_suffix(".png")))
    if results.get("merge_size"):
        fig = size_chart(results)
        p = out / "merge_size.html"
        fig.write_html(p, include_plotlyjs="cdn")
        paths.append(p)
        figs.append((fig, p.with_suffix(".png")))
    pngs = []
    try:
        from benchmarks.report import figures_to_png
        pngs = figures_to_png(figs)
    except Exception as exc:  # rendering is optional (needs the local chromium + playwright)
        print(f"PNG rendering skipped: {exc}")
    return paths + pngs


def size_chart(results: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    ms = results["merge_size"]
    colors = {"linear": "#1f77b4", "task_arithmetic": "#ff7f0e", "ties": "#2ca02c", "dare_ties": "#d62728"}
    dashes = {2: "solid", 4: "dash"}
    xs = ms["budgets_pct"]
    rb = ms["random_budget_pct"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("retention on own tasks ((merge − base)/(expert − base))",
                                                        "own-task mean exact-match accuracy"))
    for k in sorted(int(x) for x in ms["groups"]):
        for op, color in colors.items():
            cells = [size_cell(ms, k, op, b) for b in xs]
            rnd = size_cell(ms, k, op, rb, "random")
            name = f"K={k} {op}"
            style = {"mode": "lines+markers", "name": name, "legendgroup": name,
                     "line": {"color": color, "dash": dashes.get(k, "dot")}}
            fig.add_trace(go.Scatter(x=xs, y=[c["retention"] for c in cells], **style), 1, 1)
            fig.add_trace(go.Scatter(x=xs, y=[c["own"] for c in cells], showlegend=False, **style), 1, 2)
            mk = {"mode": "markers", "legendgroup": name, "showlegend": False, "name": f"{name} random {rb} %",
                  "marker": {"color": color, "symbol": "x", "size": 9}}
            fig.add_trace(go.Scatter(x=[rb], y=[rnd["retention"]], **mk), 1, 1)
            fig.add_trace(go.Scatter(x=[rb], y=[rnd["own"]], **mk), 1, 2)
    fig.add_hline(y=0, line_dash="dot", line_color="gray", annotation_text="base", row=1, col=1)
    fig.add_hline(y=1, line_dash="dot", line_color="gray", annotation_text="experts", row=1, col=1)
    fig.update_xaxes(title_text="budget (% of full expert read)", type="log", tickvals=xs)
    fig.update_layout(title="Merge size: K experts merged (solid K=2, dashed K=4; x = random selection at "
                            f"{rb} %), means over the K groups", height=460)
    return fig


def sweep_dir(lr: float, kind: str) -> Path:
    return WORK / f"{kind}-lr{lr:g}"


def sweep_rows(results: dict) -> list[dict]:
    """This run and every ``--expert-lr`` run found under benchmarks/work/fidelity, by fine-tuning lr."""
    runs = [results]
    for js in sorted(WORK.glob("docs-lr*/results.json")):
        other = json.loads(js.read_text())
        if other["family"]["spec"]["expert_lr"] != results["family"]["spec"]["expert_lr"]:
            runs.append(other)
    rows = []
    for r in sorted(runs, key=lambda r: r["family"]["spec"]["expert_lr"]):
        own = [r["experts"][t]["per_task"][t] for t in r["experts"]]
        row = {"expert_lr": r["family"]["spec"]["expert_lr"], "experts_own_task": sum(own) / len(own),
               "base": r["base"]["mean"]}
        for op in ("linear", "ties"):
            row[f"{op}_full_acc"] = _get(r["merges"], op, "all", 100)["accuracy"]["mean"]
            m = _get(r["merges"], op, "norm", 50)["deviation"]
            row[f"{op}_dev50"] = m["relative"]
        full = _get(r["merges"], "linear", "all", 100)["deviation"]
        row["update_over_model"] = full["update_norm"] / full["reference_norm"]
        rows.append(row)
    return rows


def write_report(results: dict, out: Path = DOCS) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = targets(results)
    slim = json.loads(json.dumps(results))
    for m in slim["merges"]:
        m.pop("dir", None)
    js = out / "results.json"
    js.write_text(json.dumps({**slim, "targets": rows, "best_strategies": best_strategies(results)}, indent=1))
    files = charts(results, out)
    md = out / "README.md"
    if (out / "minilm_results.json").exists():  # one report for both families
        from benchmarks.fidelity.encoder_report import rewrite_readme
        rewrite_readme(out)
    else:
        md.write_text(markdown(results, rows, files))
    return [js, md, *files]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=None, help=f"family directory (default {DEFAULT_OUT})")
    ap.add_argument("--mini", action="store_true", help="the miniature family (a smoke run of the pipeline)")
    ap.add_argument("--docs", default=None, help=f"report directory (default {DOCS}; "
                    "benchmarks/work/fidelity/docs-mini with --mini)")
    ap.add_argument("--n-eval", type=int, default=200, help="held-out examples per task")
    ap.add_argument("--random-seeds", default="0,1,2", help="seeds of the random strategy (not for dare_ties)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--expert-lr", type=float, default=None,
                    help="sensitivity run: experts fine-tuned from the same base with this lr "
                         "(family and report under benchmarks/work/fidelity/*-lr<LR>; the main report lists them)")
    ap.add_argument("--no-merge-size", action="store_true", help="skip the merge-size section (K = 2, 4 experts)")
    ap.add_argument("--quick", action="store_true", help="60 examples per task, one random seed")
    ap.add_argument("--report-only", action="store_true", help="rewrite docs/fidelity from results.json")
    args = ap.parse_args(argv)
    args.random_seeds = [int(s) for s in args.random_seeds.split(",")]
    if args.quick:
        args.n_eval, args.random_seeds = 60, [0]
    docs = Path(args.docs) if args.docs else (WORK / "docs-mini" if args.mini else
                                              sweep_dir(args.expert_lr, "docs") if args.expert_lr is not None else DOCS)
    if args.report_only:
        results = json.loads((docs / "results.json").read_text())
    else:
        results = run(args)
    for p in write_report(results, docs):
        print(p)
    for r in targets(results):
        print(f"{'MET    ' if r['met'] else 'NOT MET'} {r['target']}: {r['measured']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
