"""Snapshot commands: verify, snapshots, lineage, delete, evaluate, recover, doctor, diff, and starting the
dashboard."""

from __future__ import annotations

import argparse
from pathlib import Path

from mergepipe import api
from mergepipe.cli.common import command, emit, open_catalog, short_date, table
from mergepipe.errors import MergePipeError, VerifyError


def _add_verify(p):
    p.add_argument("ref", help="plan id, snapshot id, merged model id or snapshot directory")
    p.add_argument("--outputs-only", action="store_true",
                   help="check the snapshot's files only, not whether its inputs are unchanged")


@command("verify", "re-hash a snapshot against its manifest (exit 1 on mismatch)", arguments=_add_verify)
def cmd_verify(args):
    cat = open_catalog(args) if (Path(args.db).exists() or not Path(args.ref).is_dir()) else None
    res = api.verify(cat, args.ref, check_inputs=not args.outputs_only)
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
    cat = open_catalog(args)
    emit(args, api.snapshots(cat), lambda rs: table(
        [{**r, "read": api.human_bytes(r["expert_read_bytes"]) + (
            f" ({r['expert_read_bytes'] / r['full_expert_bytes']:.0%})" if r.get("full_expert_bytes") else ""),
          "created_at": short_date(r["created_at"])} for r in rs],
        ["id", "model_id", "operator", "read", "created_at", "out"],
        headers={"model_id": "model", "operator": "op", "created_at": "created"}, wide=("out",),
        keep=("id", "model_id"), show_all=args.wide))


def _add_lineage(p):
    p.add_argument("model_id", nargs="?", help="a model id (default: the whole DAG)")
    p.add_argument("--dot", action="store_true", help="print Graphviz DOT")


@command("lineage", "ancestors and descendants of a model (the whole DAG without an id)", arguments=_add_lineage)
def cmd_lineage(args):
    cat = open_catalog(args)
    g = api.lineage(cat, args.model_id)
    if args.dot:
        print(api.lineage_dot(g))
        return
    emit(args, g, lambda g: [print(f"{e['parent_id']} -[{e['role']}"
                                   + (f" w={e['weight']:g}" if e["weight"] is not None else "")
                                   + f"]-> {e['child_id']}") for e in g["edges"]] or print("(no merges yet)"))


def _add_delete(p):
    p.add_argument("ref", help="snapshot id or merged model id")
    p.add_argument("--force", action="store_true", help="delete even when another model's lineage needs it")


@command("delete", "delete a snapshot: its folder and its catalog rows (refused while another model needs it)",
         arguments=_add_delete)
def cmd_delete(args):
    cat = open_catalog(args)
    res = api.delete_snapshot(cat, args.ref, force=args.force)
    emit(args, res, lambda r: print(
        f"deleted {r['snapshot_id']} ({r['model_id']})" + (f" and {r['out']}" if r["removed_files"] else
                                                            f"; {r['out']} was already gone")
        + (f"; forced: {', '.join(r['dependents'])} lose an input" if r["dependents"] else "")))


def _add_evaluate(p):
    p.add_argument("model_ids", nargs="+", metavar="MODEL", help="registered full checkpoints (snapshots too)")
    p.add_argument("--text", help="a held-out UTF-8 text file: perplexity")
    p.add_argument("--tasks", metavar="SUITE.jsonl",
                   help="a task suite: accuracy per task and their mean; one JSON object per line, "
                        '{"task", "prompt", "answer"} (exact match of the greedy answer) or '
                        '{"task", "prompt", "choices": [...], "answer": index} (multiple choice by log-likelihood)')
    p.add_argument("--reference", metavar="MODEL",
                   help="a registered full checkpoint: the realized weight-space deviation ||M - R|| (and relative "
                        "to ||R||) of each model from it, e.g. from the full-budget merge")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window (default 256)")
    p.add_argument("--max-tokens", type=int, default=8192, help="score at most this many tokens (default 8192)")
    p.add_argument("--force", action="store_true", help="score again even when a stored result applies")
    p.add_argument("--run-id", type=int, help=argparse.SUPPRESS)


@command("evaluate", "perplexity on a held-out text and accuracy on a task suite (results stored; reused while "
                     "unchanged)", arguments=_add_evaluate)
def cmd_evaluate(args):
    cat = open_catalog(args)
    if not args.text and not args.tasks and not args.reference:
        raise MergePipeError("give a held-out text (--text), a task suite (--tasks) or a reference model "
                             "(--reference)")
    ids = list(args.model_ids)
    results = []
    with api.recorded_run(cat, args.run_id) as run:
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
    emit(args, results, lambda rs: [print(_evaluation_line(r)) for r in rs])


def _text_job(args) -> dict | None:
    from mergepipe.research.evaluate import text_job  # imports torch: only when evaluating
    return text_job(args.text, args.window, args.max_tokens) if args.text else None


def _suite_job(args) -> dict | None:
    from mergepipe.research.evaluate import suite_job  # imports torch: only when evaluating
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
    from mergepipe.research.evaluate import deviation, perplexity, score_task_suite  # imports torch
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
    cat = open_catalog(args, write=True)
    res = api.recover(cat)
    emit(args, res, lambda r: print(f"rolled back {len(r['rolled_back'])} transaction(s), removed "
                                    f"{len(r['removed'])} path(s), marked {len(r['failed_runs'])} run(s) failed"))


@command("doctor", "check the catalog: file integrity, unfinished merges, registered models' files "
                   "(exit 0 healthy, 1 findings)")
def cmd_doctor(args):
    report = api.doctor(args.db)
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


def _add_dashboard(p):
    p.add_argument("--port", type=int, default=8501, help="port on 127.0.0.1 (default 8501; refused when taken)")
    p.add_argument("--allow-root", action="append", metavar="DIR",
                   help="also let the dashboard read checkpoints from and write merges into DIR (repeatable); added "
                        "to $MERGEPIPE_ALLOWED_ROOTS when set, else to the working directory and the catalog's folder")


@command("dashboard", "start the Streamlit dashboard on 127.0.0.1", arguments=_add_dashboard)
def cmd_dashboard(args):
    from mergepipe.dashboard.server import run_dashboard  # (http.client, ssl: only this command needs them)
    run_dashboard(args.db, port=args.port, extra_roots=args.allow_root)


def _add_diff(p):
    p.add_argument("a", help="the earlier snapshot (id or merged model id)")
    p.add_argument("b", help="the later snapshot")


@command("diff", "what changed from snapshot A to snapshot B (experts, weights, bytes, bound, scores)",
         arguments=_add_diff)
def cmd_diff(args):
    cat = open_catalog(args)
    emit(args, api.diff_snapshots(cat, args.a, args.b), lambda d: print(api.diff_text(d, api.human_bytes)))
