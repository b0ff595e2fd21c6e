"""The ``mergepipe`` command line: a thin layer over the Python API.

User errors print one line (``error: ...``) and exit 2; nothing in the catalog changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mergepipe.errors import MergePipeError
from mergepipe.planner.budget import human_bytes

SUBCOMMANDS: dict[str, callable] = {}


def command(name, help_text):
    def deco(fn):
        SUBCOMMANDS[name] = (fn, help_text)
        return fn
    return deco


def default_db() -> str:
    return os.environ.get("MERGEPIPE_DB", "mergepipe.sqlite")


def open_catalog(args, create: bool = False):
    from mergepipe.catalog.db import Catalog
    return Catalog(args.db, create=create)


def emit(args, data, render=None) -> None:
    """Print ``data`` as JSON with --json, else through ``render`` (or as indented JSON)."""
    if getattr(args, "json", False) or render is None:
        print(json.dumps(data, indent=2, default=str))
    else:
        render(data)


def table(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[_fmt(r.get(c)) for c in columns])
    Console().print(t)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def progress_bar(description: str):
    """A rich progress bar usable as an analyze/engine progress callback: cb(label, done, total)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    prog = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), transient=True, disable=not sys.stderr.isatty())
    tasks = {}

    def cb(label, done, total):
        if label not in tasks:
            tasks[label] = prog.add_task(f"{description} {label}", total=total)
        prog.update(tasks[label], completed=done)

    return prog, cb


# --- catalog commands ----------------------------------------------------------------------------
@command("init-db", "create (or migrate) a catalog")
def cmd_init_db(args):
    from mergepipe.catalog.models import schema_version
    cat = open_catalog(args, create=True)
    print(f"catalog ready: {cat.path} (schema v{schema_version(cat)})")


def _add_register(p):
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="checkpoint directories or .safetensors files, each named after its directory "
                        "(or file); all are registered in one transaction, or none")
    p.add_argument("--model-id", help="id of the one checkpoint given by --uri (or by one PATH)")
    p.add_argument("--uri", help="checkpoint directory or .safetensors file")
    p.add_argument("--base", dest="base_id", help="id of the base model (for experts)")
    p.add_argument("--kind", default="full", choices=["full", "delta", "lora"])
    p.add_argument("--content-hash", action="store_true", help="also hash every byte (slow)")
    p.add_argument("--replace", action="store_true", help="replace an id registered with other content")


def _register_items(args) -> list[tuple[str, str]]:
    """(model id, path) pairs from `--model-id ID --uri PATH` or from positional paths."""
    from mergepipe.catalog.models import named_by_path
    paths = ([args.uri] if args.uri is not None else []) + list(args.paths)
    if not paths:
        raise MergePipeError("give the checkpoints to register: PATH [PATH ...] or --model-id ID --uri PATH")
    if args.uri is not None and args.paths:
        raise MergePipeError("give either --uri PATH or positional paths, not both")
    if args.model_id is None:
        return named_by_path(paths)
    if len(paths) > 1:
        raise MergePipeError("--model-id names one checkpoint; with several paths each is named after "
                             "its directory")
    return [(args.model_id, paths[0])]


@command("register", "register checkpoints (reads headers only)")
def cmd_register(args):
    from mergepipe.catalog.models import register_many
    items = _register_items(args)
    cat = open_catalog(args, create=True)
    results = register_many(cat, items, base_id=args.base_id, kind=args.kind,
                            with_content_hash=args.content_hash, replace=args.replace)
    out = results[0] if args.uri is not None else results  # the single --uri form prints one object
    emit(args, out, lambda _: [print(f"{r['status']}: {r['model_id']} ({r['fingerprint'][:19]}...)")
                               for r in results])


def _add_analyze(p):
    p.add_argument("ids", nargs="*", metavar="ID", help="experts to analyze (default: all)")
    p.add_argument("--model-id", nargs="*", dest="model_ids", help="experts to analyze, as the IDs")
    p.add_argument("--block-bytes", type=int, default=None, help="block size target (default 1 MiB)")
    p.add_argument("--sketch-size", type=int, default=None, help="sketch samples per block (default 2048)")
    p.add_argument("--densities", type=float, nargs="*", help="extra top-k densities to store thresholds for")
    p.add_argument("--force", action="store_true", help="re-analyze even if unchanged")
    p.add_argument("--run-id", type=int, help=argparse.SUPPRESS)


@command("analyze", "compute per-block delta statistics of experts against their base")
def cmd_analyze(args):
    from mergepipe.analyze.stats import DEFAULT_DENSITIES, analyze
    from mergepipe.catalog.sketch import DEFAULT_SKETCH_SIZE
    cat = open_catalog(args)
    if args.ids:
        args.model_ids = [*(args.model_ids or []), *args.ids]
    kw = {"force": args.force, "sketch_size": args.sketch_size or DEFAULT_SKETCH_SIZE,
          "densities": tuple(DEFAULT_DENSITIES) + tuple(args.densities or ())}
    if args.block_bytes is not None:
        kw["block_bytes"] = args.block_bytes
    prog, cb = progress_bar("analyze")
    run = None
    if args.run_id is not None:
        from mergepipe.engine.runs import RunProgress
        run = RunProgress(cat, args.run_id)
    total_models = max(1, len(args.model_ids or [m for m in cat.models() if m["base_id"]]))
    finished = []

    def progress(label, done, total):
        cb(label, done, total)
        if run:  # blocks_* columns carry bytes for analyze runs: models done + fraction of the current one
            if done >= total:
                finished.append(label)
            run(int((len(finished) + (0 if done >= total else done / max(total, 1))) * 1000), total_models * 1000, done)
    try:
        with prog:
            results = analyze(cat, args.model_ids, progress=progress, **kw)
    except BaseException as exc:
        if run:
            run.fail("cancelled" if isinstance(exc, KeyboardInterrupt) else "failed", str(exc))
        raise
    if run:
        run.finish()
    out = [r.__dict__ for r in results]

    def render(rows):
        for r in rows:
            if r["skipped"]:
                print(f"{r['model_id']}: unchanged, skipped")
            else:
                rate = r["bytes_read"] / r["seconds"] / 1e6 if r["seconds"] else 0
                print(f"{r['model_id']}: {r['n_blocks']} blocks, read {human_bytes(r['bytes_read'])} "
                      f"in {r['seconds']:.2f} s ({rate:.0f} MB/s)")
    emit(args, out, render)


@command("models", "list registered models")
def cmd_models(args):
    cat = open_catalog(args)
    rows = [{k: v for k, v in m.items() if k != "config"} for m in cat.models()]
    for r in rows:
        r["analyzed"] = bool(r["base_id"]) and cat.is_analyzed(r["id"])
    emit(args, rows, lambda rs: table(
        [{**r, "bytes": human_bytes(r["bytes"]), "fingerprint": r["fingerprint"][7:19]} for r in rs],
        ["id", "kind", "base_id", "architecture", "dtype", "params", "bytes", "fingerprint", "analyzed"]))


@command("blocks", "per-block statistics of an analyzed expert")
def cmd_blocks(args):
    from mergepipe.catalog.models import has_tensor
    cat = open_catalog(args)
    cat.model(args.model_id)
    if args.tensor is not None and not has_tensor(cat, args.model_id, args.tensor):
        raise MergePipeError(f"model {args.model_id!r} has no tensor {args.tensor!r}")
    rows = cat.blocks(args.model_id, args.tensor)
    if not rows:
        raise MergePipeError(f"{args.model_id!r} has no block statistics yet (run `mergepipe analyze`)")
    emit(args, rows, lambda rs: table(rs, ["tensor", "block", "row_start", "row_end", "offset", "nbytes",
                                           "delta_l2", "delta_max_abs", "delta_nnz"]))


@command("make-family", "write a synthetic base + K experts family")
def cmd_make_family(args):
    from mergepipe.research.family import make_family
    paths = make_family(args.out, experts=args.experts, size=args.size, dtype=args.dtype,
                        shard_bytes=args.shard_bytes, seed=args.seed)
    emit(args, paths, lambda p: print(f"wrote base {p['base']} and {len(p['experts'])} experts"))


@command("demo", "build a small family, register, analyze and merge it, then open the dashboard")
def cmd_demo(args):
    from mergepipe.cli.demo import run_demo
    run_demo(Path(args.dir), dashboard=not args.no_dashboard, port=args.port)


# --- plan / merge / execute ---------------------------------------------------------------------
def _add_plan_args(p, with_out: bool):
    p.add_argument("--config", help="a mergekit YAML config (models, base_model, merge_method, parameters); "
                                    "paths in it are registered and analyzed on the fly; flags given here "
                                    "override its values")
    p.add_argument("--base", help="base model id (required without --config)")
    p.add_argument("--experts", nargs="+", help="expert model ids (required without --config)")
    p.add_argument("--op", "--operator", dest="op", default=None,
                   help="linear (AVG), task_arithmetic, ties, dare_linear, dare_ties (DARE), breadcrumbs, "
                        "breadcrumbs_ties, della, della_linear (default linear, or the config's merge_method)")
    p.add_argument("--weights", nargs="+", type=float)
    p.add_argument("--density", type=float)
    p.add_argument("--lambda", dest="lam", type=float)
    p.add_argument("--gamma", type=float, help="breadcrumbs: fraction of largest magnitudes dropped (0.01)")
    p.add_argument("--epsilon", type=float, help="della: spread of keep probabilities (0.1)")
    p.add_argument("--normalize", dest="normalize", action="store_true", default=None)
    p.add_argument("--no-normalize", dest="normalize", action="store_false")
    p.add_argument("--rescale", dest="rescale", action="store_true", default=None)
    p.add_argument("--no-rescale", dest="rescale", action="store_false")
    p.add_argument("--budget", help="expert-read budget: 10%%, 0.1, 512MiB, 8GB (default 100%%)")
    p.add_argument("--io-budget-mb", type=float, help="expert-read budget in MiB")
    p.add_argument("--target-bound", type=float, help="smallest budget whose relative error bound <= this")
    p.add_argument("--strategy", default=None,
                   help="how blocks are ranked: norm (default), conflict, kept, random, uniform")
    p.add_argument("--seed", type=int, default=None, help="seed of the random operators and strategy (default 0)")
    if with_out:
        _add_out_args(p)


def _add_out_args(p):
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--model-id", help="id of the merged model (default: the output directory's name)")
    p.add_argument("--out-shard-size", type=int, default=2 << 30, help="bytes per output shard (default 2 GiB)")


def _make_plan(args, cat, save=True, reserved_ids=()):
    from mergepipe.planner.context import Planner
    if args.budget is not None and args.io_budget_mb is not None:
        raise MergePipeError("give either --budget or --io-budget-mb, not both")
    if args.config is not None:
        return _config_plan(args, cat, save, reserved_ids)
    if not args.base or not args.experts:
        raise MergePipeError("--base and --experts are required (or give a mergekit YAML with --config)")
    return Planner(cat).plan(
        args.base, args.experts, args.op or "linear", budget=args.budget, budget_mb=args.io_budget_mb,
        target_bound=args.target_bound, save=save, weights=args.weights, density=args.density, lam=args.lam,
        normalize=args.normalize, rescale=args.rescale, seed=0 if args.seed is None else args.seed,
        strategy=args.strategy or "norm", gamma=args.gamma, epsilon=args.epsilon)


def _load_config(args):
    """The --config file, parsed and validated, with the command line's flags applied over it."""
    from mergepipe.planner.budget import mib
    from mergepipe.config.mergekit import load_config
    if args.base or args.experts:
        raise MergePipeError("--base/--experts cannot be combined with --config (the config names the models)")
    budget = mib(args.io_budget_mb) if args.io_budget_mb is not None else args.budget
    return load_config(args.config).with_overrides(
        operator=args.op, weights=args.weights, density=args.density, lam=args.lam, normalize=args.normalize,
        rescale=args.rescale, gamma=args.gamma, epsilon=args.epsilon, budget=budget,
        target_bound=args.target_bound, strategy=args.strategy, seed=args.seed)


def _config_plan(args, cat, save, reserved_ids):
    from mergepipe.config.mergekit import plan_from_config
    plan, resolved = plan_from_config(cat, args.config_parsed, save=save, reserved_ids=reserved_ids)
    for kw in resolved.to_register:
        print(f"registered {kw['model_id']} ({kw['kind']}) from {kw['uri']}", file=sys.stderr)
    return plan


def _plan_summary(plan) -> dict:
    return {"plan_id": plan.id, "digest": plan.digest, "operator": plan["operator"],
            "budget_bytes": plan["budget"]["bytes"], "full_expert_bytes": plan["full_expert_bytes"],
            "estimated": plan["estimate"], "blocks_selected": plan["blocks_selected"],
            "expert_read_by_expert": plan["expert_read_by_expert"], "error_bound": plan["error_bound"]}


def _open_for_plan(args):
    """The catalog for plan/merge; with --config the YAML is read first (a bad file creates nothing)
    and a missing catalog is created, since the config's paths get registered into it."""
    if args.config is not None:
        args.config_parsed = _load_config(args)
        return open_catalog(args, create=True)
    return open_catalog(args)


@command("plan", "make and store a plan (reads no expert bytes)")
def cmd_plan(args):
    cat = _open_for_plan(args)
    plan = _make_plan(args, cat)
    emit(args, _plan_summary(plan), lambda _: print(plan.explain()))


def _execute(args, cat, plan):
    from mergepipe.api import merge_summary
    from mergepipe.engine.engine import Engine
    from mergepipe.engine.runs import RunProgress
    run = RunProgress(cat, args.run_id) if getattr(args, "run_id", None) is not None else None
    prog, cb = progress_bar("merge")

    def progress(done, total, nbytes):
        cb("blocks", done, total)
        if run:
            run(done, total, nbytes)
    try:
        with prog:
            _, manifest = Engine(cat).execute(plan, out=args.out, model_id=args.model_id,
                                              out_shard_bytes=args.out_shard_size, progress=progress,
                                              run_id=getattr(args, "run_id", None))
    except KeyboardInterrupt:
        if run:
            run.fail("cancelled", "cancelled by the user")
        raise
    except MergePipeError as exc:
        if run:
            run.fail("failed", str(exc))
        raise
    except Exception as exc:
        if run:
            run.fail("failed", f"{type(exc).__name__}: {exc}")
        raise
    summary = merge_summary(plan, manifest)
    emit(args, summary, lambda s: print(
        f"published {s['snapshot_id']} as model {s['model_id']} at {s['out']}\n"
        f"  manifest {s['manifest_hash']}\n"
        f"  expert read {human_bytes(s['realized']['expert_read'])} of {human_bytes(s['full_expert_bytes'])} "
        f"(budget {human_bytes(s['budget_bytes'])}), base read {human_bytes(s['realized']['base_read'])}, "
        f"wrote {human_bytes(s['realized']['output_write'])} in {s['seconds']:.2f} s"
        + (f"\n  error bound {s['error_bound']['absolute']:.4g} (relative {s['error_bound']['relative']:.3e})"
           if s["error_bound"] else "")))


@command("merge", "plan and execute a merge, publishing a snapshot")
def cmd_merge(args):
    cat = _open_for_plan(args)
    # Not saved here: the engine stores the plan once the output path and model id are known to be
    # usable, so a refused merge leaves the catalog unchanged.
    reserved = ()
    if args.config is not None:  # refuse a taken output before registering or analyzing anything
        from mergepipe.api import check_target
        _, model_id = check_target(cat, args.out, args.model_id)
        reserved = (model_id,)
    _execute(args, cat, _make_plan(args, cat, save=False, reserved_ids=reserved))


@command("execute", "execute a stored plan")
def cmd_execute(args):
    from mergepipe.planner.plan import load_plan
    cat = open_catalog(args)
    try:
        plan = load_plan(cat, args.plan_id)
    except MergePipeError as exc:
        if args.run_id is not None:
            from mergepipe.engine.runs import RunProgress
            RunProgress(cat, args.run_id).fail("failed", str(exc))
        raise
    _execute(args, cat, plan)


@command("explain", "print a plan or a snapshot, per expert and per tensor")
def cmd_explain(args):
    from mergepipe.api import explain, load_manifest, load_plan
    from mergepipe.catalog.plans import find_plan_id
    if args.as_mergekit:
        return _explain_mergekit(args)
    if args.out is not None:
        raise MergePipeError("--out goes with --as-mergekit")
    cat = open_catalog(args)
    if args.json:
        if find_plan_id(cat, args.ref) is not None:
            print(load_plan(cat, args.ref).to_json(indent=2))
        else:
            print(load_manifest(cat, args.ref).to_json())
        return
    print(explain(cat, args.ref))


def _explain_mergekit(args):
    from mergepipe.config.mergekit import export_mergekit
    cat = open_catalog(args) if (Path(args.db).exists() or not Path(args.ref).is_dir()) else None
    text = export_mergekit(cat, args.ref)
    if args.out is None:
        sys.stdout.write(text)
        return
    out = Path(args.out)
    if out.is_dir():
        raise MergePipeError(f"{out} is a directory; give a file name for the YAML")
    if not out.parent.is_dir():
        raise MergePipeError(f"{out.parent}: directory does not exist")
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)


@command("verify", "re-hash a snapshot against its manifest (exit 1 on mismatch)")
def cmd_verify(args):
    from mergepipe.errors import VerifyError
    from mergepipe.manifest.build import verify
    cat = open_catalog(args) if (Path(args.db).exists() or not Path(args.ref).is_dir()) else None
    res = verify(cat, args.ref)
    emit(args, res, lambda r: print(
        f"{'OK' if r['ok'] else 'MISMATCH'} {r['snapshot_id']} ({r['files_checked']} files) {r['out']}"
        + "".join(f"\n  {p}" for p in r["problems"])))
    if not res["ok"]:
        raise VerifyError(f"{res['snapshot_id']}: " + "; ".join(res["problems"]))


@command("snapshots", "list published snapshots")
def cmd_snapshots(args):
    from mergepipe.api import snapshots
    cat = open_catalog(args)
    emit(args, snapshots(cat), lambda rs: table(rs, ["id", "model_id", "operator", "plan_id", "out",
                                                      "expert_read_bytes", "manifest_hash", "created_at"]))


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


@command("recover", "roll back unfinished merges and clean up their leftovers")
def cmd_recover(args):
    from mergepipe.engine.txn import recover
    cat = open_catalog(args)
    res = recover(cat)
    emit(args, res, lambda r: print(f"rolled back {len(r['rolled_back'])} transaction(s), removed "
                                    f"{len(r['removed'])} path(s), marked {len(r['failed_runs'])} run(s) failed"))


@command("dashboard", "start the Streamlit dashboard on 127.0.0.1")
def cmd_dashboard(args):
    from mergepipe.dashboard.server import run_dashboard
    run_dashboard(args.db, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=argparse.SUPPRESS, help="catalog path (default $MERGEPIPE_DB or ./mergepipe.sqlite)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    parser = argparse.ArgumentParser(prog="mergepipe", parents=[common],
                                     description="Budget-aware parameter management for LLM merging.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers = {}
    for name, (fn, help_text) in SUBCOMMANDS.items():
        parsers[name] = sub.add_parser(name, help=help_text, parents=[common], description=help_text)
        parsers[name].set_defaults(func=fn)
    _add_register(parsers["register"])
    _add_analyze(parsers["analyze"])
    parsers["blocks"].add_argument("--model-id", required=True)
    parsers["blocks"].add_argument("--tensor")
    mf = parsers["make-family"]
    mf.add_argument("out")
    mf.add_argument("--experts", type=int, default=4)
    mf.add_argument("--size", default="small", choices=["tiny", "small", "medium", "qwen3-0.6b"])
    mf.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    mf.add_argument("--shard-bytes", type=int, default=256 << 20)
    mf.add_argument("--seed", type=int, default=0)
    demo = parsers["demo"]
    demo.add_argument("--dir", default="mergepipe-demo", help="where the demo family and catalog go")
    demo.add_argument("--no-dashboard", action="store_true", help="stop after the merge")
    demo.add_argument("--port", type=int, default=8501)
    _add_plan_args(parsers["plan"], with_out=False)
    _add_plan_args(parsers["merge"], with_out=True)
    parsers["execute"].add_argument("plan_id")
    _add_out_args(parsers["execute"])
    parsers["execute"].add_argument("--run-id", type=int, help=argparse.SUPPRESS)
    for name in ("explain", "verify"):
        parsers[name].add_argument("ref", help="plan id, snapshot id, merged model id or snapshot directory")
    parsers["explain"].add_argument("--as-mergekit", action="store_true",
                                    help="print the equivalent mergekit YAML config instead")
    parsers["explain"].add_argument("--out", help="with --as-mergekit: write the YAML to this file")
    parsers["lineage"].add_argument("model_id", nargs="?")
    parsers["lineage"].add_argument("--dot", action="store_true", help="print Graphviz DOT")
    parsers["dashboard"].add_argument("--port", type=int, default=8501)
    return parser


def _first_positional(argv: list[str]) -> str | None:
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--db":
            i += 2
        elif tok.startswith("-"):
            i += 1
        else:
            return tok
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if _first_positional(argv) not in SUBCOMMANDS and ("--base" in argv or "--config" in argv):
        argv = ["merge", *argv]  # the original MergePipe quick start: `mergepipe --db P --base B ...`
    args = parser.parse_args(argv)
    args.db = getattr(args, "db", None) or default_db()
    args.json = getattr(args, "json", False)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        args.func(args)
    except MergePipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
