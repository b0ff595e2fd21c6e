"""Snapshot commands: verify, snapshots, lineage, recover, and starting the dashboard."""

from __future__ import annotations

from pathlib import Path

from mergepipe.cli.common import command, emit, open_catalog, short_date, table
from mergepipe.errors import MergePipeError


@command("verify", "re-hash a snapshot against its manifest (exit 1 on mismatch)")
def cmd_verify(args):
    from mergepipe.errors import VerifyError
    from mergepipe.api import verify
    cat = open_catalog(args) if (Path(args.db).exists() or not Path(args.ref).is_dir()) else None
    res = verify(cat, args.ref, check_inputs=not args.outputs_only)
    emit(args, res, lambda r: print(
        f"{'OK' if r['ok'] else 'MISMATCH'} {r['snapshot_id']} ({r['files_checked']} files, "
        f"{r['inputs_checked']} inputs) {r['out']}"
        + "".join(f"\n  {p}" for p in r["problems"])))
    if not res["ok"]:
        raise VerifyError(f"{res['snapshot_id']}: " + "; ".join(res["problems"]))


@command("snapshots", "list published snapshots", arguments=lambda p: p.add_argument(
    "--wide", action="store_true", help="show every column in full, however wide the lines (ids are never cut "
                                        "or wrapped)"))
def cmd_snapshots(args):
    from mergepipe.api import human_bytes, snapshots
    cat = open_catalog(args)
    emit(args, snapshots(cat), lambda rs: table(
        [{**r, "read": human_bytes(r["expert_read_bytes"]) + (
            f" ({r['expert_read_bytes'] / r['full_expert_bytes']:.0%})" if r.get("full_expert_bytes") else ""),
          "created_at": short_date(r["created_at"])} for r in rs],
        ["id", "model_id", "operator", "read", "created_at", "out"],
        headers={"model_id": "model", "operator": "op", "created_at": "created"}, wide=("out",),
        keep=("id", "model_id"), show_all=args.wide))


@command("lineage", "ancestors and descendants of a model (the whole DAG without an id)")
def cmd_lineage(args):
    from mergepipe.api import lineage, lineage_dot
    cat = open_catalog(args)
    g = lineage(cat, args.model_id)
    if args.dot:
        print(lineage_dot(g))
        return
    emit(args, g, lambda g: [print(f"{e['parent_id']} -[{e['role']}"
                                   + (f" w={e['weight']:g}" if e["weight"] is not None else "")
                                   + f"]-> {e['child_id']}") for e in g["edges"]] or print("(no merges yet)"))


@command("delete", "delete a snapshot: its folder and its catalog rows (refused while another model needs it)")
def cmd_delete(args):
    from mergepipe.api import delete_snapshot
    cat = open_catalog(args)
    res = delete_snapshot(cat, args.ref, force=args.force)
    emit(args, res, lambda r: print(
        f"deleted {r['snapshot_id']} ({r['model_id']})" + (f" and {r['out']}" if r["removed_files"] else
                                                            f"; {r['out']} was already gone")
        + (f"; forced: {', '.join(r['dependents'])} lose an input" if r["dependents"] else "")))


@command("evaluate", "perplexity on a held-out text and accuracy on a task suite (results stored; reused while "
                     "unchanged)")
def cmd_evaluate(args):
    from mergepipe import api
    cat = open_catalog(args)
    if not args.text and not args.tasks and not args.reference:
        raise MergePipeError("give a held-out text (--text), a task suite (--tasks) or a reference model "
                             "(--reference)")
    run = api.RunProgress(cat, args.run_id) if args.run_id is not None else None
    ids = list(args.model_ids)
    results = []
    try:
        jobs = [j for j in (_text_job(args), _suite_job(args), _reference_job(cat, args)) if j is not None]
        units = len(ids) * len(jobs) * 1000
        for i, mid in enumerate(ids):
            m = cat.model(mid)
            if m["kind"] != "full":
                raise MergePipeError(f"{mid} is a {m['kind']} checkpoint: only full checkpoints can be evaluated")
            for k, job in enumerate(jobs):
                step = (i * len(jobs) + k) * 1000

                def progress(done, total, step=step):
                    if run:
                        run(step + int(done / total * 1000), units, 0)
                results.append(_evaluate_one(cat, m, job, args.force, progress))
                if run:
                    run(step + 1000, units, 0)
    except BaseException as exc:
        if run:
            run.fail("cancelled" if isinstance(exc, KeyboardInterrupt) else "failed", str(exc))
        raise
    if run:
        run.finish()
    emit(args, results, lambda rs: [print(_evaluation_line(r)) for r in rs])


def _text_job(args) -> dict | None:
    from mergepipe.research.evaluate import text_job
    return text_job(args.text, args.window, args.max_tokens) if args.text else None


def _suite_job(args) -> dict | None:
    from mergepipe.research.evaluate import suite_job
    return suite_job(args.tasks) if args.tasks else None


def _reference_job(cat, args) -> dict | None:
    if not args.reference:
        return None
    ref = cat.model(args.reference)
    if ref["kind"] != "full":
        raise MergePipeError(f"{ref['id']} is a {ref['kind']} checkpoint: the reference must be a full checkpoint")
    return {"metric": "deviation", "dataset": ref["fingerprint"], "name": ref["id"], "uri": ref["uri"]}


def _evaluate_one(cat, m: dict, job: dict, force: bool, progress) -> dict:
    """One model on one text, suite or reference; a stored result of the same model and data is reused."""
    from mergepipe import api
    from mergepipe.research.evaluate import deviation, perplexity, score_task_suite
    head = {"model_id": m["id"], "metric": job["metric"], "dataset": job["name"]}
    cached = None if force else api.evaluation(cat, m["id"], m["fingerprint"], job["dataset"], job["metric"])
    if job["metric"] == "deviation":
        if cached is None:
            d = deviation(m["uri"], job["uri"])
            api.record_evaluation(cat, m["id"], m["fingerprint"], job["dataset"], job["name"], "deviation:relative",
                                  d["relative"], 0)
            api.record_evaluation(cat, m["id"], m["fingerprint"], job["dataset"], job["name"], "deviation",
                                  d["absolute"], 0)
            return {**head, "value": d["absolute"], "relative": d["relative"], "cached": False}
        rel = api.evaluation(cat, m["id"], m["fingerprint"], job["dataset"], "deviation:relative")
        return {**head, "value": cached["value"], "relative": rel["value"] if rel else None, "cached": True}
    if job["metric"] == "perplexity":
        if cached is not None:
            return {**head, "value": cached["value"], "perplexity": cached["value"], "tokens": cached["tokens"],
                    "cached": True}
        r = perplexity(m["uri"], job["text"], window=job["window"], max_tokens=job["max_tokens"], progress=progress)
        api.record_evaluation(cat, m["id"], m["fingerprint"], job["dataset"], job["name"], "perplexity",
                              r["perplexity"], r["tokens"])
        return {**head, "value": r["perplexity"], "perplexity": r["perplexity"], "tokens": r["tokens"], "cached": False}
    if cached is not None:
        per_task = {e["metric"].split(":", 1)[1]: e["value"]
                    for e in api.evaluations(cat, [m["id"]]) if e["dataset"] == job["dataset"]
                    and e["metric"].startswith("accuracy:")}
        return {**head, "value": cached["value"], "examples": cached["tokens"], "per_task": per_task, "cached": True}
    r = score_task_suite(m["uri"], job["suite"], progress=progress)
    for task, acc in r["per_task"].items():
        api.record_evaluation(cat, m["id"], m["fingerprint"], job["dataset"], job["name"], f"accuracy:{task}", acc,
                              len(job["suite"][task]))
    api.record_evaluation(cat, m["id"], m["fingerprint"], job["dataset"], job["name"], "accuracy", r["mean"],
                          r["examples"])
    return {**head, "value": r["mean"], "examples": r["examples"], "per_task": r["per_task"], "cached": False}


def _evaluation_line(r: dict) -> str:
    stored = " (stored)" if r["cached"] else ""
    if r["metric"] == "deviation":
        return (f"{r['model_id']}: ||M - R|| = {r['value']:.6g} from {r['dataset']}"
                + (f" (relative {r['relative']:.4g})" if r["relative"] is not None else "") + stored)
    if r["metric"] == "perplexity":
        return f"{r['model_id']}: perplexity {r['value']:.4g} on {r['tokens']} tokens of {r['dataset']}{stored}"
    tasks = ", ".join(f"{t} {v:.3f}" for t, v in r["per_task"].items())
    return f"{r['model_id']}: accuracy {r['value']:.3f} on {r['examples']} examples of {r['dataset']} ({tasks}){stored}"


@command("recover", "roll back unfinished merges and clean up their leftovers")
def cmd_recover(args):
    from mergepipe.api import recover
    cat = open_catalog(args, write=True)
    res = recover(cat)
    emit(args, res, lambda r: print(f"rolled back {len(r['rolled_back'])} transaction(s), removed "
                                    f"{len(r['removed'])} path(s), marked {len(r['failed_runs'])} run(s) failed"))


@command("doctor", "check the catalog: file integrity, unfinished merges, registered models' files "
                   "(exit 0 healthy, 1 findings)")
def cmd_doctor(args):
    from mergepipe.api import doctor
    report = doctor(args.db)
    checked = report["checked"]

    def render(r):
        for line in r["findings"]:
            print(line)
        if r["healthy"]:
            print(f"catalog {r['catalog']} is healthy: integrity_check ok, schema current, nothing to recover, "
                  f"{checked['models']} model(s) unchanged")
        else:
            skipped = "" if checked["transactions"] else " (transactions and models not checked: fix the file first)"
            print(f"{len(r['findings'])} finding(s){skipped}")
    emit(args, report, render)
    return 0 if report["healthy"] else 1


@command("dashboard", "start the Streamlit dashboard on 127.0.0.1")
def cmd_dashboard(args):
    from mergepipe.dashboard.server import run_dashboard
    run_dashboard(args.db, port=args.port, extra_roots=args.allow_root)


@command("diff", "what changed from snapshot A to snapshot B (experts, weights, bytes, bound, scores)")
def cmd_diff(args):
    from mergepipe.api import diff_snapshots, diff_text, human_bytes
    cat = open_catalog(args)
    emit(args, diff_snapshots(cat, args.a, args.b), lambda d: print(diff_text(d, human_bytes)))


@command("recipe", "named, versioned merge recipes: save, show, list, explain, run")
def cmd_recipe(args):
    from mergepipe import api
    if args.action == "list":
        rows = api.recipe_list(open_catalog(args))
        return emit(args, rows, lambda rs: table(rs, ["name", "version", "runs", "last_snapshot", "created_at"]))
    if not args.name:
        raise MergePipeError(f"recipe {args.action} needs a recipe NAME")
    if args.action == "save":
        cat = open_catalog(args, write=True)
        version = api.recipe_save(cat, args.name, args.base, args.experts or [], args.op or "linear",
                                  _weights(args.weight), _recipe_params(args), args.budget, args.out)
        return emit(args, {"name": args.name, "version": version},
                    lambda d: print(f"recipe {d['name']} v{d['version']} saved"))
    if args.action == "show":
        return emit(args, api.recipe_show(open_catalog(args), args.name, args.version))
    if args.action == "explain":
        return print(api.recipe_explain(open_catalog(args), args.name))
    res = api.recipe_run(open_catalog(args, write=True), args.name)
    emit(args, res, lambda r: print(r["explain"] + (
        f"\npublished {r['snapshot_id']} as model {r['model_id']} at {r['out']} ({r['choice']})"
        if r["snapshot_id"] else "")))


def _weights(items) -> dict:
    out = {}
    for item in items or ():
        pattern, sep, value = item.rpartition("=")
        try:
            out[pattern] = float(value)
        except ValueError:
            sep = ""
        if not sep or not pattern:
            raise MergePipeError(f"--weight takes PATTERN=W (e.g. 'math-*=0.5'), not {item!r}")
    return out


def _recipe_params(args) -> dict:
    from mergepipe import api
    return {p.key: getattr(args, p.key) for p in api.parameters()
            if p.key != "weights" and getattr(args, p.key, None) is not None}


@command("watch", "watch folders for new or changed checkpoints and run a recipe on them (until SIGTERM)")
def cmd_watch(args):
    import sys
    from mergepipe import api
    if not args.interval > 0:
        raise MergePipeError("--interval must be a positive number of seconds")
    res = api.watch(open_catalog(args, write=True), args.dirs, args.recipe, interval=args.interval, once=args.once,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    emit(args, {"snapshots": [r["snapshot_id"] for r in res["runs"]], "stopped_by": res["stopped_by"]},
         lambda d: print(f"{len(d['snapshots'])} snapshot(s) published"))
