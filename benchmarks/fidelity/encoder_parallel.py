"""The pretrained-encoder fidelity study in parallel processes: learning-rate search, family, every phase.

    python -m benchmarks.fidelity.encoder_parallel --procs 16      # the published run (a 16-core GPU machine)
    python -m benchmarks.fidelity.encoder_parallel --mini --procs 2  # the miniature family (a smoke run)
    python -m benchmarks.fidelity.encoder_study --report             # docs/fidelity from its results.json

1. For every learning-rate candidate (:data:`CANDIDATES`: full fine-tuning at 2e-5, 3e-5 and 5e-5, the
   usual range for BERT-size encoders, LoRA at 3e-4, 1e-3 and 2e-3) a family directory
   ``benchmarks/work/fidelity/minilm-<candidate>``; its experts train in parallel processes, two tasks
   each, on the GPU when there is one (merges and ANALYZE always run on the CPU).
2. Every candidate's experts are scored on validation sentences (neither trained on nor in the
   evaluation set); per variant the study takes the smallest learning rate at which every expert beats
   the base's linear probe on its task by at least :data:`CLEAR_MARGIN` (10 points), else the best
   mean validation accuracy (:func:`choose`). All candidates' accuracies go into results.json.
3. Every phase of :func:`benchmarks.fidelity.encoder_study.phase_list` (variant x K x strategy) and every
   block size of the sweep in its own process (``encoder_study --phases ... --tag ...``);
   at ``--deadline`` the processes still running are stopped and the finished phases are joined into
   ``benchmarks/work/fidelity/minilm-study/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.fidelity.encoder import (FULL, MINI, build_family, eval_suite, family_accuracy, prepare_family,
                                        valid_suite, write_base)
from benchmarks.fidelity.encoder_study import BLOCK_SWEEP, WORK, join_results, phase_list

CANDIDATES = (("lr2e-5", 2e-5, 3e-4), ("lr3e-5", 3e-5, 1e-3), ("lr5e-5", 5e-5, 2e-3))
CLEAR_MARGIN = 0.10
CHUNK = 2  # tasks per training process


def candidates(mini: bool, only=None) -> list[tuple[str, object]]:
    """(name, spec) of the learning-rate candidates (``only``: these names, e.g. a CPU-sized run)."""
    if mini:
        return [("mini", MINI)]
    return [(name, replace(FULL, lr=lr, lora_lr=lora_lr)) for name, lr, lora_lr in CANDIDATES
            if not only or name in only]


def family_dir(name: str) -> Path:
    return WORK / f"minilm-{name}"


def _env() -> dict:
    # one thread per process: the processes are the parallelism
    return {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def run_pool(jobs: list[tuple[str, list[str]]], procs: int, logs: Path, deadline: float | None = None) -> dict:
    """Run ``(name, argv)`` jobs, ``procs`` at a time, in order; returns name -> exit code (None: stopped
    at the deadline). Each job's output goes to ``logs/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    waiting, running, codes = list(jobs), {}, {}
    while waiting or running:
        while waiting and len(running) < procs and (deadline is None or time.time() < deadline):
            name, argv = waiting.pop(0)
            out = open(logs / f"{_slug(name)}.log", "w")
            running[name] = (subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                                              env=_env()), out)
        for name, (p, out) in list(running.items()):
            if p.poll() is not None:
                codes[name] = p.returncode
                out.close()
                del running[name]
                print(f"{time.strftime('%H:%M:%S')} {name}: exit {p.returncode}", flush=True)
        if deadline is not None and time.time() >= deadline:
            for name, (p, out) in running.items():
                p.kill()
                p.wait()
                out.close()
                codes[name] = None
                print(f"{name}: stopped at the deadline", flush=True)
            codes.update({name: None for name, _ in waiting})
            break
        time.sleep(0.5)
    return codes


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


def train_jobs(cands, mini: bool, variants=None) -> list[tuple[str, list[str]]]:
    jobs = []
    for name, spec in cands:
        for variant in variants or spec.variants:
            for i in range(0, len(spec.tasks), CHUNK):
                tasks = ",".join(spec.tasks[i:i + CHUNK])
                jobs.append((f"train {name} {variant} {tasks}",
                             ["-m", "benchmarks.fidelity.encoder", "--out", str(family_dir(name)), "--only", variant,
                              "--tasks", tasks, "--lr", str(spec.lr), "--lora-lr", str(spec.lora_lr),
                              *(["--mini"] if mini else [])]))
    return jobs


def choose(scores: dict, variant: str, order: list[str], margin: float = CLEAR_MARGIN) -> str:
    """The candidate (of ``order``, smallest learning rate first) at which every expert of ``variant``
    beats the base's probe by ``margin`` on validation; else the one with the best mean accuracy."""
    def gains(c):
        acc = scores[c]
        return [acc["experts"][variant][t] - acc["base_probe"][t] for t in acc["base_probe"]]

    for c in order:
        if min(gains(c)) >= margin:
            return c
    return max(order, key=lambda c: sum(scores[c]["experts"][variant].values()))


def study_jobs(chosen: dict, tasks: list[str], mini: bool) -> list[tuple[str, list[str]]]:
    """One job per phase (every K's phases in turn, the block sizes after K = all tasks)."""
    mini_arg = ["--mini"] if mini else []
    jobs, blocks = [], []
    for name, variant, k, _cells, _ops in phase_list(list(chosen), tasks):
        if k is not None and not blocks:
            blocks = block_jobs(chosen, mini_arg)
            jobs += blocks
        jobs.append((name, ["-m", "benchmarks.fidelity.encoder_study", "--family", str(family_dir(chosen[variant])),
                            "--variant", variant, "--phases", name, "--tag", _slug(name), *mini_arg]))
    return jobs if blocks else jobs + block_jobs(chosen, mini_arg)


def block_jobs(chosen: dict, mini_arg: list) -> list:
    if "full" not in chosen:
        return []
    return [(f"blocks {bb}", ["-m", "benchmarks.fidelity.encoder_study", "--family", str(family_dir(chosen["full"])),
                              "--variant", "full", "--blocks", str(bb), "--tag", f"blocks-{bb}", *mini_arg])
            for bb in BLOCK_SWEEP]


def longest_first(jobs: list) -> list:
    """K = 2 phases (four groups) first, then K = 4, then the rest: with a process per job the pool ends
    together. With fewer processes than jobs the informative order of :func:`phase_list` is kept instead,
    so that a deadline cuts the small merges first."""
    return sorted(jobs, key=lambda j: (0 if "K=2" in j[0] else 1 if "K=4" in j[0] else 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mini", action="store_true", help="the miniature family (seconds)")
    ap.add_argument("--procs", type=int, default=os.cpu_count())
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start: stop the study there")
    ap.add_argument("--candidates", default=None, help="only these learning-rate candidates (comma-separated names)")
    ap.add_argument("--variants", default=None,
                    help="only these variants (comma-separated: full, lora); the others' results are kept from "
                         "the previous results.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.deadline if args.deadline else None
    cands = candidates(args.mini, args.candidates.split(",") if args.candidates else None)
    if not cands:
        raise SystemExit(f"error: no candidate named {args.candidates} (there are {', '.join(c[0] for c in CANDIDATES)})")
    variants = args.variants.split(",") if args.variants else list(cands[0][1].variants)
    if set(variants) - set(cands[0][1].variants):
        raise SystemExit(f"error: no variant named {args.variants} (there are full, lora)")
    logs = WORK / ("minilm-parallel-mini" if args.mini else "minilm-parallel")
    for name, spec in cands:
        prepare_family(family_dir(name), spec)  # before the builders: a changed variant is rebuilt
        write_base(family_dir(name) / "base", spec)
    codes = run_pool(train_jobs(cands, args.mini, variants), args.procs, logs)
    if any(c != 0 for c in codes.values()):
        raise SystemExit(f"error: training failed: {[n for n, c in codes.items() if c != 0]} (logs in {logs})")
    t_train = time.time() - t0
    fams = {name: build_family(family_dir(name), spec, log=lambda *_: None) for name, spec in cands}  # loads only
    specs = dict(cands)
    scores = {name: family_accuracy(fams[name], spec, variants=variants, suite=valid_suite(spec))
              for name, spec in cands}
    order = [name for name, _ in cands]
    spec0 = cands[0][1]
    chosen = {v: choose(scores, v, order) for v in variants}
    print(f"chosen: {chosen} after {time.time() - t0:.0f}s", flush=True)
    evals = {}
    for v, name in chosen.items():  # what each study process would otherwise compute again
        evals[v] = family_accuracy(fams[name], specs[name], variants=[v], suite=eval_suite(specs[name]))
        (family_dir(name) / f"accuracy-{v}.json").write_text(json.dumps(evals[v], indent=2))
    jobs = study_jobs(chosen, list(spec0.tasks), args.mini)
    codes = run_pool(longest_first(jobs) if args.procs >= len(jobs) else jobs, args.procs, logs, deadline)
    res = join_parts({name: codes[name] for name, _ in jobs}, args.mini)  # in phase order: full first
    res["lr_search"] = {"candidates": {n: asdict(s) for n, s in cands}, "validation": scores, "evaluation": evals,
                        "chosen": chosen, "rule": f"smallest lr with every expert >= {CLEAR_MARGIN:g} over the probe "
                                                  "on validation, else the best mean validation accuracy"}
    res["family"]["spec_by_variant"] = {v: asdict(specs[c]) for v, c in chosen.items()}
    res["parallel"] = {"procs": args.procs, "seconds_train": t_train, "seconds_total": time.time() - t0,
                       "variants": variants, "stopped": [n for n, c in codes.items() if c is None],
                       "failed": [n for n, c in codes.items() if c not in (0, None)]}
    out = WORK / ("minilm-study-mini" if args.mini else "minilm-study")
    out.mkdir(parents=True, exist_ok=True)
    if set(variants) != set(spec0.variants):
        res = keep_other_variants(json.loads((out / "results.json").read_text()), res, variants)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(f"{out / 'results.json'}: {sum(len(v['merges']) for v in res['variants'].values())} merges, "
          f"{time.time() - t0:.0f}s; stopped {res['parallel']['stopped']}, failed {res['parallel']['failed']}")
    return 0


def keep_other_variants(prev: dict, new: dict, variants: list[str]) -> dict:
    """``new`` (a run of ``variants`` only) joined with the previous run's results of the other variants:
    its merges, accuracies, phases, block sweep and learning-rate search for them are kept."""
    res = json.loads(json.dumps(prev))
    for v in variants:
        res["variants"].pop(v, None)
        for part in ("experts", "base_expert_head"):
            res["accuracy"][part].pop(v, None)
    res["phases_done"] = [p for p in res["phases_done"] if p.split()[0] not in variants]
    res = join_results(res, new)
    search, more = res["lr_search"], new["lr_search"]
    for c, spec in more["candidates"].items():
        search["candidates"][c] = spec  # the other variants' fields are unchanged (prepare_family)
    for c, acc in more["validation"].items():
        mine = search["validation"].setdefault(c, {"base_probe": acc["base_probe"], "base_expert_head": {},
                                                   "experts": {}})
        for part in ("experts", "base_expert_head"):
            mine[part].update(acc[part])
    search["evaluation"].update(more["evaluation"])
    search["chosen"].update(more["chosen"])
    res["family"]["spec_by_variant"].update(new["family"]["spec_by_variant"])
    res["parallel"] = {**new["parallel"], "previous": prev.get("parallel")}
    return res


def join_parts(codes: dict, mini: bool) -> dict:
    """One result from the finished phases' results.json files (each renamed results.merged.json)."""
    base = "minilm-study-mini" if mini else "minilm-study"
    res = None
    for name, code in codes.items():
        tag = f"blocks-{name.split()[1]}" if name.startswith("blocks ") else _slug(name)
        path = WORK / f"{base}-{tag}" / "results.json"
        if code != 0 or not path.exists():
            continue
        part = json.loads(path.read_text())
        res = part if res is None else join_results(res, part)
        path.rename(path.with_name("results.merged.json"))
    if res is None:
        raise SystemExit("error: no phase of the study finished")
    return res


if __name__ == "__main__":
    raise SystemExit(main())
