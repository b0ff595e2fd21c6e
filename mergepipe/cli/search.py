"""``mergepipe search``: find the best recipe in a search space (Optuna samplers, the budget as the fidelity,
trials merged in memory), resume a killed search, show one, list them, publish the best."""

from __future__ import annotations

import sys

from mergepipe import api
from mergepipe.cli.common import command, emit, open_catalog, table
from mergepipe.errors import MergePipeError

USAGE = ("search SPACE.yml | search --resume ID | search show ID | search list | "
         "search publish ID --out DIR [--top N]")


def _add_search_args(p):
    p.add_argument("what", nargs="*", metavar="SPACE.yml | show ID | list | publish ID",
                   help="a search file to run, or an action on stored searches")
    p.add_argument("--resume", metavar="ID", help="run the trials search ID has not finished (none runs twice)")
    p.add_argument("--executor", choices=("local", "ray"), help="override search.executor")
    p.add_argument("--address", help="with --executor ray: the cluster to join (default: a new local one on "
                                     "127.0.0.1 only, with token authentication)")
    p.add_argument("--concurrency", type=int, help="trials in flight at once (override)")
    p.add_argument("--trials", type=int, help="override search.trials")
    p.add_argument("--out", help="with publish: the directory the best recipes are published under")
    p.add_argument("--top", type=int, default=1, help="with publish: how many of the best recipes (default 1)")


@command("search", "search recipes (ranges and choices in a mergekit config) against an objective, "
                   "trials merged in memory at rising budgets", arguments=_add_search_args)
def cmd_search(args):
    what = list(args.what)
    if args.resume:
        if what:
            raise MergePipeError(f"--resume takes no search file (usage: {USAGE})")
        return _run(args, lambda cat, progress: api.search_resume(cat, args.resume, on_trial=progress))
    if not what:
        raise MergePipeError(f"search needs a search file or an action (usage: {USAGE})")
    action, rest = what[0], what[1:]
    if action in ("show", "publish") and len(rest) == 1:
        return _show(args, rest[0]) if action == "show" else _publish(args, rest[0])
    if action == "list" and not rest:
        return _list(args)
    if len(what) != 1:
        raise MergePipeError(f"unexpected arguments {' '.join(what[1:])} (usage: {USAGE})")
    space = api.load_search(action).with_overrides(executor=args.executor, address=args.address,
                                                   concurrency=args.concurrency, trials=args.trials)
    return _run(args, lambda cat, progress: api.search(cat, space, on_trial=progress))


def _run(args, start):
    cat = open_catalog(args, write=True)
    res = start(cat, _progress)
    emit(args, res, _render)


def _progress(row: dict) -> None:
    print(f"trial {row['number']}: {_outcome(row)}  {_params(row['params'])}", file=sys.stderr, flush=True)


def _outcome(row: dict) -> str:
    if row["status"] == "failed":
        return f"failed ({row['error']})"
    return f"{row['status']} {row['score']:.4g} at {row['fidelity']}"


def _params(params: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _render(res: dict) -> None:
    trials = res["trials"]
    counts = {s: sum(t["status"] == s for t in trials) for s in ("complete", "pruned", "failed")}
    expert = sum(t["expert_read"] or 0 for t in trials)
    print(f"search {res['id']} ({res['name']}): {res['status']}, {len(trials)} trials ({counts['complete']} "
          f"complete, {counts['pruned']} pruned, {counts['failed']} failed), expert read {api.human_bytes(expert)}")
    best = res.get("best")
    if best is None:
        print("no complete trial")
        return
    held = f", held-out {best['holdout']:.4g}" if best.get("holdout") is not None else ""
    print(f"best: trial {best['trial']}, score {best['score']:.4g}{held}  {_params(best['params'])}")
    print(f"publish it: mergepipe search publish {res['id']} --out DIR")


def _show(args, search_id: str) -> None:
    cat = open_catalog(args)
    res = api.search_show(cat, search_id)

    def render(r):
        _render(r)
        rows = [{"trial": t["number"], "status": t["status"], "fidelity": t["fidelity"] or "-",
                 "score": "-" if t["score"] is None else f"{t['score']:.4g}",
                 "expert read": api.human_bytes(t["expert_read"] or 0), "seconds": f"{t['seconds'] or 0:.1f}",
                 "params": _params(t["params"])} for t in r["trials"]]
        table(rows, ["trial", "status", "fidelity", "score", "expert read", "seconds", "params"], keep=("trial",))
    emit(args, res, render)


def _list(args) -> None:
    cat = open_catalog(args)
    rows = api.searches(cat)
    emit(args, rows, lambda rs: table(
        [{"id": r["id"], "name": r["name"], "status": r["status"], "started": r["started_at"]} for r in rs],
        ["id", "name", "status", "started"]) if rs else print("no searches"))


def _publish(args, search_id: str) -> None:
    if not args.out:
        raise MergePipeError("search publish needs --out DIR")
    cat = open_catalog(args, write=True)
    res = api.search_publish(cat, search_id, args.out, top=args.top)
    emit(args, res, lambda rs: print("\n".join(f"published trial {r['trial']}: {r['snapshot_id']} "
                                               f"({r['model_id']} at {r['out']})" for r in rs)))
