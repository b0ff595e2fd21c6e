"""Recipe search benchmark: MergePipe's search (TPE + Hyperband over budgets, trials merged in memory) against a
full-fidelity CMA-ES search as mergekit-evolve runs it (every candidate merged in full to disk, the model
loaded back and scored) and against the default recipes, side by side in one run.

    python -m benchmarks.search                    # family A (K = 4 and 8), family B, docs/benchmarks/search.md
    python -m benchmarks.search --ks 4 --cmaes-trials 8 --no-family-b --out /tmp/search.md   # a smoke run

Family A is docs/fidelity's all-MiniLM-L6-v2 family of full fine-tunes (built by
``python -m benchmarks.fidelity.encoder --only full --out benchmarks/work/fidelity/minilm-lr5e-5``); the
objective is the mean validation accuracy (merged encoder + each task's own head), the report the held-out
accuracy, scored only for each search's best recipe and the default recipes. Family B (docs/fidelity's tiny
Llama, ``python -m benchmarks.fidelity.train``) runs one search with a task-suite objective (exact match),
so that the language-model path is exercised.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity.study import size_groups  # noqa: E402
from benchmarks.fidelity.text_tasks import TEXT_TASK_NAMES  # noqa: E402
from mergepipe import api  # noqa: E402

WORK = ROOT / "benchmarks" / "work" / "search"
FAMILY_A = ROOT / "benchmarks" / "work" / "fidelity" / "minilm-lr5e-5"
FAMILY_B = ROOT / "benchmarks" / "work" / "fidelity" / "family"
DOCS = ROOT / "docs" / "benchmarks" / "search.md"
WEIGHT, DENSITY = (0.1, 1.5), (0.1, 1.0)
METHODS = ("task_arithmetic", "ties")
DEFAULTS = {  # mergekit's usual starting points: equal weights, lambda 1, ties at density 0.5
    "linear": {"weight": 1.0},
    "task_arithmetic": {"weight": 1.0},
    "ties": {"weight": 1.0, "density": 0.5},
}


# --- family A -------------------------------------------------------------------------------------------
def tasks_for(k: int) -> list[str]:
    return list(TEXT_TASK_NAMES) if k == len(TEXT_TASK_NAMES) else list(size_groups(TEXT_TASK_NAMES)[k][0])


def catalog_for(k: int, family: Path, log) -> Path:
    """A catalog of family A's base and the K experts, analyzed (ANALYZE's default densities grid)."""
    db = WORK / f"a-k{k}" / "catalog.sqlite"
    if db.exists():
        return db
    db.parent.mkdir(parents=True, exist_ok=True)
    cat = api.Catalog(db)
    try:
        api.register(cat, "base", str(family / "base"))
        for t in tasks_for(k):
            api.register(cat, t, str(family / "full" / t), base_id="base")
        t0 = time.perf_counter()
        api.analyze(cat, tasks_for(k))
        log(f"K={k}: catalog analyzed in {time.perf_counter() - t0:.1f} s")
    finally:
        cat.close()
    return db


def recipe(method: str, tasks: list[str], values: dict | None = None) -> dict:
    """A mergekit config over ``tasks`` (values: ``<task>.weight``/``<task>.density``; else the defaults)."""
    models = []
    for t in tasks:
        params = {k: (values or {}).get(f"{t}.{k}", v) for k, v in DEFAULTS[method].items()}
        models.append({"model": t, "parameters": params})
    return {"merge_method": method, "base_model": "base", "models": models}


def space_doc(tasks: list[str], settings: dict) -> dict:
    """The searched space (the same for both searches): task_arithmetic or ties, per-expert weight, and
    per-expert density when the method is ties."""
    models = [{"model": t, "parameters": {"weight": {"range": list(WEIGHT)}, "density": {"range": list(DENSITY)}}}
              for t in tasks]
    return {"merge_method": list(METHODS), "base_model": "base", "models": models, "search": settings}


def score_recipe(cat, doc: dict, work: Path) -> dict:
    """A recipe merged in memory at 100 % and scored on validation and held-out sentences."""
    from benchmarks import search_objective as objective
    path = work / "recipe.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    merged = api.merge_in_memory(cat, api.plan_config(cat, path, save=False))
    return {"validation": objective.validation(merged.tensors), "heldout": objective.heldout(merged.tensors)}


def defaults_row(cat, tasks: list[str], work: Path) -> dict:
    return {m: score_recipe(cat, recipe(m, tasks), work) for m in DEFAULTS}


# --- the full-fidelity baseline: CMA-ES, mergekit to disk, loaded back --------------------------------------
def full_merge_to_disk(method: str, tasks: list[str], values: dict, paths: dict, out: Path) -> None:
    """Every byte of every expert read, merged with torch, written to disk: MergePipe's full-read reference
    merge (research/baselines.naive_merge), the work mergekit does. mergekit 0.1.5 itself cannot merge a
    BertModel: its bert architecture's weight aliases are a tuple, and plan_tensor adds them to a list
    (TypeError), so the loop cannot call it on family A."""
    from mergepipe.research.baselines import naive_merge
    densities = [values.get(f"{t}.density", 1.0) for t in tasks]
    naive_merge(paths["base"], [paths[t] for t in tasks], out, method,
                weights=[values[f"{t}.weight"] for t in tasks], densities=densities)


def cmaes_search(tasks: list[str], paths: dict, trials: int, seed: int, expert_bytes: int, log) -> dict:
    """mergekit-evolve's loop: CMA-ES proposes, the candidate is merged in full to disk, loaded back and scored."""
    import optuna
    from transformers import AutoModel

    from benchmarks import search_objective as objective
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    t0, history = time.perf_counter(), []
    for _ in range(trials):
        trial = study.ask()
        method = trial.suggest_categorical("merge_method", list(METHODS))  # CMA-ES samples it independently
        keys = ("weight", "density") if method == "ties" else ("weight",)
        values = {f"{t}.{k}": trial.suggest_float(f"{t}.{k}", *(WEIGHT if k == "weight" else DENSITY))
                  for t in tasks for k in keys}
        out = Path(tempfile.mkdtemp(prefix="full-", dir=WORK)) / "merged"
        try:
            full_merge_to_disk(method, tasks, values, paths, out)
            model = AutoModel.from_pretrained(str(out)).eval()
            score = objective.encoder_accuracy(model, "validation")
        finally:
            shutil.rmtree(out.parent, ignore_errors=True)
        study.tell(trial, score)
        history.append({"score": score, "seconds": time.perf_counter() - t0})
        log(f"  cma-es trial {len(history)}: {score:.2f} ({history[-1]['seconds']:.0f} s)")
    best = study.best_trial
    return {"best_params": best.params, "best_validation": best.value, "trials": trials,
            "seconds": time.perf_counter() - t0, "expert_read": trials * expert_bytes, "history": history}


# --- MergePipe's search --------------------------------------------------------------------------------------
def mergepipe_search(cat, tasks: list[str], trials: int, seed: int, timeout: float | None, work: Path, log) -> dict:
    settings = {"name": f"bench-k{len(tasks)}", "trials": trials, "sampler": "tpe", "seed": seed,
                "objective": {"python": "benchmarks.search_objective:validation"},
                "holdout": {"python": "benchmarks.search_objective:heldout"},
                "fidelities": ["10%", "25%", "100%"], "pruner": "hyperband"}
    if timeout:
        settings["timeout"] = timeout
    t0 = time.perf_counter()
    res = api.search(cat, api.parse_search(space_doc(tasks, settings), root=work),
                     on_trial=lambda r: log(f"  mergepipe trial {r['number']}: {r['status']} {r['score']} "
                                            f"at {r['fidelity']}"))
    seconds = time.perf_counter() - t0
    trials_ = res["trials"]
    return {"best_params": res["best"]["params"], "best_validation": res["best"]["score"],
            "best_heldout": res["best"]["holdout"], "trials": len(trials_), "seconds": seconds,
            "expert_read": sum(t["expert_read"] or 0 for t in trials_),
            "pruned": sum(t["status"] == "pruned" for t in trials_), "rank_agreement": rank_agreement(trials_),
            "steps": [{"budget": s["budget"], "score": s["score"], "expert_read": s["expert_read"],
                       "bound": s["error_bound"]} for t in trials_ for s in t["steps"]], "search_id": res["id"]}


def _ranks(xs) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for m in range(i, j + 1):  # ties share their mean rank
            ranks[order[m]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs, ys) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (0 when either side is constant)."""
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else 0.0


def rank_agreement(trials: list[dict]) -> dict:
    """Spearman's rho between each low fidelity's score and the 100 % score, over the trials that reached
    100 % (promoted trials only: a restricted range, so a rho near 0 says the low fidelity did not order
    what it promoted, not how well it prunes)."""
    out = {}
    by_trial = [{s["budget"]: s["score"] for s in t["steps"]} for t in trials]
    for budget in sorted({b for t in by_trial for b in t} - {"100%"}, key=lambda b: float(b.rstrip("%"))):
        pairs = [(t[budget], t["100%"]) for t in by_trial if budget in t and "100%" in t]
        if len(pairs) >= 3:
            out[budget] = {"trials": len(pairs), "rho": spearman(*zip(*pairs))}
    return out


def run_k(k: int, args, log) -> dict:
    os.environ["SEARCH_FAMILY"], os.environ["SEARCH_TASKS"] = str(args.family_a), ",".join(tasks_for(k))
    tasks, work = tasks_for(k), WORK / f"a-k{k}"
    cat = api.Catalog(catalog_for(k, args.family_a, log))
    try:
        paths = {"base": str(args.family_a / "base"), **{t: str(args.family_a / "full" / t) for t in tasks}}
        expert_bytes = sum(f.stat().st_size for t in tasks for f in (args.family_a / "full" / t).glob("*.safetensors"))
        log(f"K={k}: default recipes")
        defaults = defaults_row(cat, tasks, work)
        log(f"K={k}: CMA-ES, {args.cmaes_trials} full-fidelity trials merged to disk")
        cmaes = cmaes_search(tasks, paths, args.cmaes_trials, args.seed, expert_bytes, log)
        best = cmaes["best_params"]
        cmaes["best_heldout"] = score_recipe(cat, recipe(best["merge_method"], tasks, best), work)["heldout"]
        log(f"K={k}: MergePipe, {args.cmaes_trials} trials")
        same_trials = mergepipe_search(cat, tasks, args.cmaes_trials, args.seed, None, work, log)
        log(f"K={k}: MergePipe, CMA-ES's wall time ({cmaes['seconds']:.0f} s)")
        same_time = mergepipe_search(cat, tasks, 10_000, args.seed, cmaes["seconds"], work, log)
    finally:
        cat.close()
    return {"k": k, "tasks": tasks, "expert_bytes": expert_bytes, "defaults": defaults, "cmaes": cmaes,
            "mergepipe_same_trials": same_trials, "mergepipe_same_time": same_time}


# --- family B ----------------------------------------------------------------------------------------------
def run_family_b(args, log) -> dict:
    """One search on the tiny Llama with a task-suite objective (validation and held-out suites)."""
    from benchmarks.fidelity.tasks import TASK_NAMES, suite
    from mergepipe.research.evaluate import write_suite
    work = WORK / "b"
    work.mkdir(parents=True, exist_ok=True)
    names = list(TASK_NAMES)[:4]
    write_suite(suite(40, 777, names), work / "val.jsonl")
    write_suite(suite(60, 888, names), work / "test.jsonl")
    db = work / "catalog.sqlite"
    if db.exists():
        db.unlink()
    cat = api.Catalog(db)
    try:
        api.register(cat, "base", str(args.family_b / "base"))
        for t in names:
            api.register(cat, t, str(args.family_b / t), base_id="base")
        api.analyze(cat, names)
        models = [{"model": t, "parameters": {"weight": {"range": [0.2, 1.5]}}} for t in names]
        doc = {"merge_method": "task_arithmetic", "base_model": "base", "models": models,
               "parameters": {"lambda": {"range": [0.5, 2.0]}},
               "search": {"name": "bench-b", "trials": args.b_trials, "sampler": "tpe", "seed": args.seed,
                          "objective": {"tasks": "val.jsonl"}, "holdout": {"tasks": "test.jsonl"},
                          "fidelities": ["25%", "100%"], "pruner": "successive_halving"}}
        t0 = time.perf_counter()
        res = api.search(cat, api.parse_search(doc, root=work))
        default = recipe("task_arithmetic", names)
        default_path = work / "default.yml"
        default_path.write_text(yaml.safe_dump(default, sort_keys=False))
        merged = api.merge_in_memory(cat, api.plan_config(cat, default_path, save=False))
        from mergepipe.search.objectives import prepare
        from mergepipe.search.settings import Objective
        held = prepare(Objective("tasks", str(work / "test.jsonl")), args.family_b / "base")
        val = prepare(Objective("tasks", str(work / "val.jsonl")), args.family_b / "base")
        return {"tasks": names, "seconds": time.perf_counter() - t0, "note": args.family_b_note, "trials": len(res["trials"]),
                "pruned": sum(t["status"] == "pruned" for t in res["trials"]),
                "best": res["best"], "default": {"validation": val(merged.tensors), "heldout": held(merged.tensors)}}
    finally:
        cat.close()


# --- the report ------------------------------------------------------------------------------------------
def report(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    out.write_text(render(res))


def render(res: dict) -> str:
    from benchmarks.search_report import render as render_md
    return render_md(res)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="4,8", help="family A merge sizes (comma-separated; 4 and/or 8; empty: "
                                                "family B alone, added to the stored results)")
    ap.add_argument("--cmaes-trials", type=int, default=24, help="full-fidelity CMA-ES trials (and MergePipe's "
                                                                   "same-trials search)")
    ap.add_argument("--b-trials", type=int, default=12, help="family B search trials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family-a", type=Path, default=FAMILY_A)
    ap.add_argument("--family-b", type=Path, default=FAMILY_B)
    ap.add_argument("--family-b-note", default="", help="how family B was built, for the report")
    ap.add_argument("--no-family-b", action="store_true")
    ap.add_argument("--out", type=Path, default=DOCS)
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)
    import torch
    torch.set_num_threads(1)  # both searches score with one thread (mergekit merges with one too)
    res = {"run": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "torch": torch.__version__,
           "family_a": [run_k(int(k), args, log) for k in args.ks.split(",") if k]}
    if not res["family_a"]:  # family B alone: added to the stored family A results
        kept = json.loads(args.out.with_suffix(".json").read_text())
        res = {**kept, "family_b_run": res["run"]}
    if not args.no_family_b:
        res["family_b"] = run_family_b(args, log)
    elapsed = time.perf_counter() - t0
    res["seconds"] = res["seconds"] + elapsed if "family_b_run" in res else elapsed
    report(res, args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
