"""The fidelity study on the pretrained-encoder family (all-MiniLM-L6-v2 experts, heads outside the merge).

    python -m benchmarks.fidelity.encoder_study            # builds the family if missing, then the study
    python -m benchmarks.fidelity.encoder_study --mini     # the miniature family (a smoke run, seconds)

Per expert variant (full fine-tunes, LoRA): for K = 8 (every task) and the disjoint groups of K = 4 and
K = 2 (:func:`benchmarks.fidelity.study.size_groups`), every operator at 100 % and with every planner
strategy at 5, 10, 25 and 50 %; task_arithmetic's lambda chosen per K on validation sentences (neither
trained on nor scored) at full budget; block sizes 16 KiB, 256 KiB and 1 MiB beside the grid's 64 KiB
(full experts, linear). Scored per task with the merged encoder + that task's head. Records accuracy,
retention of the experts' gain, relative deviation from the full merge, plan bound vs realized
deviation, bytes and seconds into ``benchmarks/work/fidelity/minilm-study/results.json`` (rewritten
after every phase, so a cut run still reports what it measured) and writes docs/fidelity from it
(:mod:`benchmarks.fidelity.encoder_report`). :mod:`benchmarks.fidelity.encoder_parallel` runs the
phases in parallel processes (one per phase) and is how the published run was made.

    python -m benchmarks.fidelity.encoder_study --jobs 2   # the whole study, one command
    python -m benchmarks.fidelity.encoder_study --variant full --tag full   # one variant (then --combine)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.fidelity.encoder import (DEFAULT_OUT, FULL, MINI, build_family, eval_suite, family_accuracy, load_spec,
                                        valid_suite)
from benchmarks.fidelity.study import disjoint_block_bound, retention, size_groups
from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.classify import default_device, merged_accuracy
from mergepipe.research.evaluate import bound_check, deviation

WORK = Path(__file__).resolve().parents[1] / "work" / "fidelity"
OPERATORS = ("linear", "task_arithmetic", "ties", "dare_ties")
BUDGETS = (5, 10, 25, 50)
STRATEGIES = ("norm", "conflict", "kept", "random", "uniform")
BLOCK_BYTES = 64 << 10
BLOCK_SWEEP = (16 << 10, 256 << 10, 1 << 20)  # beside the grid's 64 KiB; 1 MiB is the product default
SWEEP_BUDGETS = (10, 25, 50)
SIZE_OPERATORS = ("task_arithmetic", "ties")
DENSITY = 0.5
LAMBDAS = (0.3, 0.5, 1.0)
MIN_GAIN = 0.10


def op_params(op: str, lam: float) -> dict:
    return {"linear": {}, "task_arithmetic": {"lam": lam}, "ties": {"density": DENSITY},
            "dare_ties": {"density": DENSITY, "normalize": True}}[op]


class EncoderStudy:
    """One variant's catalog (base + experts analyzed at ``block_bytes``) and its merges."""

    def __init__(self, fam: dict, variant: str, out: Path, suite: dict, block_bytes: int, log=print):
        self.fam, self.variant, self.out, self.suite, self.log = fam, variant, out, suite, log
        self.heads = fam["heads"][variant]
        self.experts = list(fam["experts"][variant])
        shutil.rmtree(out, ignore_errors=True)
        (out / "merges").mkdir(parents=True)
        self.cat = Catalog(str(out / "catalog.sqlite"), create=True)
        t0 = time.perf_counter()
        register(self.cat, "base", fam["base"])
        for t in self.experts:
            register(self.cat, t, fam["experts"][variant][t], base_id="base")
        analyze(self.cat, self.experts, block_bytes=block_bytes)
        self.analyze_seconds = time.perf_counter() - t0
        self.block_bytes = block_bytes
        self.n = 0

    def merge(self, op: str, budget: int, strategy: str, params: dict, experts=None, reference=None,
              tasks=None, keep=False, seed: int = 0) -> dict:
        """One merge; scored on ``tasks`` (default: the merged experts' tasks; () = no accuracy)."""
        experts = list(experts or self.experts)
        self.n += 1
        mid = f"m{self.n:04d}-{op}-{budget}-{strategy}"
        out = self.out / "merges" / mid
        t0 = time.perf_counter()
        plan, _snap, manifest = merge(self.cat, "base", experts, str(out), operator=op, budget=f"{budget}%",
                                      strategy=strategy, seed=seed, model_id=mid, **params)
        rec = {"variant": self.variant, "operator": op, "budget_pct": budget, "strategy": strategy if budget < 100 else "all",
               "experts": experts, "k": len(experts), "block_bytes": self.block_bytes, "params": params,
               "seconds": time.perf_counter() - t0, "bytes_planned": plan["estimate"]["expert_read"],
               "bytes_realized": manifest.core["realized"]["expert_read"], "full_expert_bytes": plan["full_expert_bytes"],
               "budget_bytes": plan["budget"]["bytes"], "bound": plan["error_bound"]}
        if reference is not None:
            dev = deviation(out, reference, self.fam["base"])
            dev.pop("per_tensor")
            rec["deviation"] = dev
            rec["bound_check"] = bound_check(plan.data, dev)
            if plan["error_bound"]:
                rec["bound_disjoint_blocks"] = disjoint_block_bound(self.cat, plan.data)
        tasks = experts if tasks is None else tasks
        if tasks:
            t1 = time.perf_counter()
            rec["accuracy"] = merged_accuracy(out, {t: self.heads[t] for t in tasks}, {t: self.suite[t] for t in tasks})
            rec["eval_seconds"] = time.perf_counter() - t1
        self.log(f"{self.variant} K={len(experts)} {mid} bb={self.block_bytes}: {rec['seconds']:.1f}s"
                 + (f", dev {rec['deviation']['relative']:.2e}" if "deviation" in rec else "")
                 + (f", acc {rec['accuracy']['mean']:.3f}" if "accuracy" in rec else ""))
        if keep:
            rec["dir"] = str(out)
        else:
            shutil.rmtree(out)
        return rec

    def full_reference(self, op: str, params: dict, experts=None, tasks=None) -> dict:
        rec = self.merge(op, 100, "norm", params, experts=experts, keep=True, tasks=tasks)
        dev = deviation(rec["dir"], rec["dir"], self.fam["base"])
        dev.pop("per_tensor")
        rec["deviation"], rec["bound_check"] = dev, None
        return rec

    def pick_lambda(self, valid: dict, groups, lambdas=LAMBDAS) -> dict:
        """task_arithmetic's lambda: best full-budget own-task accuracy on a validation set, mean over groups."""
        if len(lambdas) == 1:
            return {"candidates": {}, "chosen": lambdas[0]}
        scores = {}
        for lam in lambdas:
            accs = []
            for g in groups:
                self.n += 1
                out = self.out / "merges" / f"lam{self.n}"
                merge(self.cat, "base", list(g), str(out), operator="task_arithmetic", lam=lam, model_id=f"lam{self.n}")
                accs.append(merged_accuracy(out, {t: self.heads[t] for t in g}, {t: valid[t] for t in g})["mean"])
                shutil.rmtree(out)
            scores[lam] = sum(accs) / len(accs)
        best = max(lambdas, key=lambda lam: (scores[lam], -lam))
        self.log(f"{self.variant} K={len(groups[0])} lambda {best} from {scores}")
        return {"candidates": {str(k): v for k, v in scores.items()}, "chosen": best}

    def grid(self, lam: float, cells: dict, operators=OPERATORS, experts=None) -> list[dict]:
        """Each operator's full merge, then ``cells[strategy] = (budgets, scored budgets)``: weight-space
        deviation at every listed budget, accuracy at the scored ones."""
        rows = []
        for op in operators:
            params = op_params(op, lam)
            ref = self.full_reference(op, params, experts)
            for strategy, (budgets, scored) in cells.items():
                for b in budgets:
                    rows.append(self.merge(op, b, strategy, params, experts=experts, reference=ref["dir"],
                                           tasks=None if b in scored else ()))
            shutil.rmtree(ref.pop("dir"))
            rows.append(ref)
        return rows


# What the study runs: for K = 8 (every task) and the disjoint groups of K = 4 and 2, every operator's full
# merge and every planner strategy at every budget; task_arithmetic's lambda validated for every K.
# Each (K, strategy) is a phase of its own, so parallel processes can take one each (encoder_parallel.py).
CELLS = {s: (BUDGETS, BUDGETS) for s in STRATEGIES}
SIZE_LAMBDAS = LAMBDAS


def phase_list(variants, tasks) -> list[tuple]:
    """(name, variant, k or None for every task, cells, operators) of every phase, most informative first."""
    small = size_groups(tasks) if len(tasks) >= 4 else {}
    phases = []
    for k in [None, *sorted(small, reverse=True)]:
        for strategy in STRATEGIES:
            for variant in variants:
                phases.append((f"{variant} K={len(tasks) if k is None else k} {strategy}", variant, k,
                               {strategy: CELLS[strategy]}, OPERATORS))
    return phases


def _train_device(fam_dir: Path, spec) -> str:
    """Where the family's experts were trained (their fidelity.json), e.g. "cuda" or "cpu"."""
    seen = {json.loads(p.read_text()).get("device", "cpu") for v in spec.variants for t in spec.tasks
            if (p := fam_dir / v / t / "fidelity.json").exists()}
    return ", ".join(sorted(seen)) or "cpu"


def run(args) -> dict:
    """The study in phases, most informative first; results.json is rewritten after every phase, so an
    interrupted run still reports what it measured."""
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    fam_dir = Path(args.family or (DEFAULT_OUT.with_name("minilm-mini") if args.mini else DEFAULT_OUT))
    spec = load_spec(fam_dir) or (MINI if args.mini else FULL)
    fam = build_family(fam_dir, spec, only=args.variant, device=default_device())
    cached = fam_dir / ("accuracy.json" if not args.variant else f"accuracy-{args.variant}.json")
    acc = json.loads(cached.read_text()) if cached.exists() else family_accuracy(fam, spec, variants=[args.variant] if args.variant else None)
    cached.write_text(json.dumps(acc, indent=2))
    suite = eval_suite(spec)
    valid = valid_suite(spec)
    tasks = list(spec.tasks)
    results = {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                           "train_device": _train_device(fam_dir, spec), "eval_device": default_device(),
                           "python": platform.python_version()},
               "family": {"dir": str(fam_dir), "spec": fam["spec"], "tasks": fam["tasks"],
                          "seconds_per_step": fam["seconds_per_step"]},
               "settings": {"block_bytes": BLOCK_BYTES, "block_sweep": list(BLOCK_SWEEP), "density": DENSITY,
                            "budgets_pct": [*BUDGETS, 100], "strategies": list(STRATEGIES),
                            "operators": list(OPERATORS), "size_operators": list(SIZE_OPERATORS),
                            "lambdas": list(LAMBDAS), "size_lambdas": list(SIZE_LAMBDAS), "min_gain": MIN_GAIN,
                            "lambda_on": "validation",
                            "cells": CELLS},
               "accuracy": acc, "variants": {}, "phases_done": []}
    out_root = WORK / (("minilm-study-mini" if args.mini else "minilm-study") + (f"-{args.tag}" if args.tag else ""))

    def save(phase):
        for variant, v in results["variants"].items():
            for m in v["merges"]:
                if "accuracy" in m and "retention" not in m:
                    own = {t: acc["experts"][variant][t] for t in m["experts"]}
                    m["retention"] = retention(m["accuracy"]["per_task"], acc["base_probe"], own, m["experts"], MIN_GAIN)
        results["phases_done"].append(phase)
        results["seconds_total"] = time.perf_counter() - t_start
        (out_root / "results.json").write_text(json.dumps(results, indent=1))
        print(f"phase {phase} done at {results['seconds_total']:.0f}s", flush=True)

    if args.blocks:  # only the block-size sweep, at these sizes
        results["block_sweep"] = block_sweep(fam, suite, None, out_root / "blocks",
                                             tuple(int(b) for b in args.blocks.split(",")))
        save("block sweep")
        return results
    small = size_groups(tasks) if len(tasks) >= 4 else {}
    variants = [args.variant] if args.variant else list(spec.variants)
    phases = phase_list(variants, tasks)
    if args.phases:  # e.g. "K=2,K=4" or "K=8 norm": run only the phases whose name contains one of these
        phases = [p for p in phases if any(f in p[0] for f in args.phases.split(","))]
    studies = {v: EncoderStudy(fam, v, out_root / v, suite, BLOCK_BYTES) for v in spec.variants
               if any(p[1] == v for p in phases)}
    for variant, st in studies.items():
        results["variants"][variant] = {"analyze_seconds": st.analyze_seconds, "lambda": {}, "merges": []}
    for name, variant, k, cells, ops in phases:
        if args.ops:  # a cut run: these operators, norm at these budgets, a fixed lambda
            ops = tuple(args.ops.split(","))
            cells = {"norm": (tuple(int(b) for b in args.budgets.split(",")),) * 2}
        st, v = studies[variant], results["variants"][variant]
        if args.lam is not None:
            v["lambda"][str(len(tasks) if k is None else k)] = {"candidates": {}, "chosen": args.lam}
        groups = [tuple(tasks)] if k is None else small[k]
        key = str(len(groups[0]))
        if key not in v["lambda"] and "task_arithmetic" in ops and args.lam is None:
            v["lambda"][key] = st.pick_lambda(valid, groups, LAMBDAS if k is None else SIZE_LAMBDAS)
        for i, g in enumerate(groups):
            rows = st.grid(v["lambda"].get(key, {"chosen": None})["chosen"], cells, operators=ops, experts=None if k is None else g)
            if k is not None:
                for row in rows:
                    row["group"] = i
            if "norm" not in name:  # the full merges are already in from the norm phase
                rows = [r for r in rows if r["budget_pct"] < 100]
            v["merges"] += rows
        save(name)
    for st in studies.values():
        shutil.rmtree(st.out / "merges", ignore_errors=True)
    if not args.no_block_sweep and not args.phases and "full" in variants:
        results["block_sweep"] = block_sweep(fam, suite, results["variants"]["full"]["lambda"][str(len(tasks))]["chosen"],
                                             out_root / "blocks")
        save("block sweep")
    return results


def run_parallel(args, argv: list[str]) -> dict:
    """Each variant's phases in its own process (``--variant v --tag v``), then one results.json."""
    import subprocess
    spec = MINI if args.mini else FULL
    build_family(Path(args.family or (DEFAULT_OUT.with_name("minilm-mini") if args.mini else DEFAULT_OUT)), spec)
    rest = [a for i, a in enumerate(argv) if not a.startswith("--jobs") and not (i and argv[i - 1] == "--jobs")]
    procs = {v: subprocess.Popen([sys.executable, "-m", "benchmarks.fidelity.encoder_study", *rest, "--variant", v,
                                  "--tag", v]) for v in spec.variants}
    failed = [v for v, p in procs.items() if p.wait() != 0]
    if failed:
        raise SystemExit(f"error: the study of {', '.join(failed)} failed")
    return combine(spec.variants, args.mini)


def combine(variants, mini: bool = False) -> dict:
    """One results.json from the per-variant runs (``--variant v --tag v``)."""
    base = "minilm-study-mini" if mini else "minilm-study"
    parts = [json.loads((WORK / f"{base}-{v}" / "results.json").read_text()) for v in variants]
    res = parts[0]
    for more in parts[1:]:
        res = join_results(res, more)
    (WORK / base).mkdir(parents=True, exist_ok=True)
    (WORK / base / "results.json").write_text(json.dumps(res, indent=1))
    for v in variants:  # merged: not to be merged again by --report
        (WORK / f"{base}-{v}" / "results.json").rename(WORK / f"{base}-{v}" / "results.merged.json")
    return res


def join_results(res: dict, more: dict) -> dict:
    """``res`` with a partial run's merges (those not in it yet), lambdas, accuracies and sweep added."""
    def key(m):
        return m["operator"], m["budget_pct"], m["strategy"], tuple(m["experts"])

    for variant, v in more["variants"].items():
        mine = res["variants"].setdefault(variant, {"analyze_seconds": v.get("analyze_seconds"), "lambda": {},
                                                    "merges": []})
        have = {key(m) for m in mine["merges"]}
        mine["merges"] += [m for m in v["merges"] if key(m) not in have]
        for k, lam in v["lambda"].items():
            mine["lambda"].setdefault(k, lam)
    for part in ("experts", "base_expert_head"):
        res["accuracy"][part].update(more["accuracy"][part])
    res["phases_done"] += more["phases_done"]
    res["family"]["seconds_per_step"].update(more["family"]["seconds_per_step"])
    res["seconds_total"] = max(res["seconds_total"], more["seconds_total"])
    res["block_sweep"] = res.get("block_sweep", []) + more.get("block_sweep", [])
    return res


def block_sweep(fam: dict, suite: dict, lam: float, out: Path, sizes=BLOCK_SWEEP) -> list[dict]:
    """Full fine-tunes, K = all: norm at SWEEP_BUDGETS for linear and ties under each block size
    (weight space; accuracy at 25 %)."""
    rows = []
    for bb in sizes:
        st = EncoderStudy(fam, "full", out / f"bb{bb}", suite, bb)
        for op in ("linear",):
            params = op_params(op, lam)
            ref = st.full_reference(op, params, tasks=())
            for b in (25, 50):
                rows.append(st.merge(op, b, "norm", params, reference=ref["dir"], tasks=None if b == 25 else ()))
            shutil.rmtree(ref["dir"])
        rows[-1]["analyze_seconds"] = st.analyze_seconds
        shutil.rmtree(st.out, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=None, help=f"family directory (default {DEFAULT_OUT})")
    ap.add_argument("--mini", action="store_true", help="the miniature family (seconds)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-block-sweep", action="store_true")
    ap.add_argument("--phases", default=None, help="comma-separated filters on phase names (e.g. K=2,K=4); no block sweep")
    ap.add_argument("--blocks", default=None, help="only the block-size sweep at these block sizes (bytes, comma-separated)")
    ap.add_argument("--ops", default=None, help="cut run: only these operators (with --budgets, --lam)")
    ap.add_argument("--budgets", default="25,50")
    ap.add_argument("--lam", type=float, default=None, help="task_arithmetic lambda without validation")
    ap.add_argument("--tag", default="", help="suffix of the study's work directory (parallel partial runs)")
    ap.add_argument("--report", action="store_true", help="write docs/fidelity from the last results.json")
    ap.add_argument("--variant", choices=("full", "lora"), help="only this expert variant's phases")
    ap.add_argument("--jobs", type=int, default=1, help="2: the variants in two processes, one result")
    ap.add_argument("--combine", action="store_true", help="join the --variant full / lora runs, then the report")
    args = ap.parse_args(argv)
    if args.combine:
        combine(("full", "lora"), args.mini)
        args.report = True
    if args.jobs > 1 and not args.report:
        run_parallel(args, sys.argv[1:] if argv is None else list(argv))
    elif not args.report:
        run(args)
        if args.phases or args.blocks or args.variant:
            return 0
    from benchmarks.fidelity.encoder_report import write_report
    main_dir = WORK / ("minilm-study-mini" if args.mini else "minilm-study")
    res = json.loads((main_dir / "results.json").read_text())
    extras = [] if args.mini else sorted(p for p in WORK.glob(main_dir.name + "-*/results.json")
                                         if p.parent.name != "minilm-study-mini")
    for extra in extras:  # partial runs (--phases, --tag)
        res = join_results(res, json.loads(extra.read_text()))
    for p in write_report(res, mini=args.mini):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
