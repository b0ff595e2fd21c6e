"""Recipe commands: ``mergepipe recipe save|show|list|explain|run`` and ``mergepipe watch``."""

from __future__ import annotations

import sys

from mergepipe import api
from mergepipe.cli.common import command, command_group, emit, open_catalog, table
from mergepipe.cli.merge import add_param
from mergepipe.errors import MergePipeError

command_group("recipe", "named, versioned merge recipes: save, show, list, explain, run")


def _add_name(p) -> None:
    p.add_argument("name", nargs="?", help="the recipe's name")


def _name(args) -> str:
    if not args.name:
        raise MergePipeError(f"recipe {args.action} needs a recipe NAME")
    return args.name


def _add_save(p) -> None:
    _add_name(p)
    p.add_argument("--base", help="save: the base model id")
    p.add_argument("--experts", nargs="+", help="save: expert ids or name patterns ('math-*')")
    p.add_argument("--op", "--operator", dest="op", help="save: the operator (default linear)")
    p.add_argument("--weight", action="append", metavar="PATTERN=W", help="save: weight of matching experts (default 1)")
    p.add_argument("--budget", help="save: expert-read budget (default 100%%)")
    p.add_argument("--out", help="save: output folder pattern with {name}, {n}, {version}, {date} (default {name}-{n})")
    for param in api.parameters():
        if param.key != "weights":
            add_param(p, param)


@command("save", "store a recipe (a new version when it differs from the latest)", arguments=_add_save,
         group="recipe")
def cmd_recipe_save(args):
    name = _name(args)
    cat = open_catalog(args, write=True)
    version = api.recipe_save(cat, name, args.base, args.experts or [], args.op or "linear", _weights(args.weight),
                              _recipe_params(args), args.budget, args.out)
    emit(args, {"name": name, "version": version}, lambda d: print(f"recipe {d['name']} v{d['version']} saved"))


def _add_show(p) -> None:
    _add_name(p)
    p.add_argument("--version", type=int, help="show: this version (default the latest)")


@command("show", "print a recipe (the latest version, or --version)", arguments=_add_show, group="recipe")
def cmd_recipe_show(args):
    name = _name(args)
    emit(args, api.recipe_show(open_catalog(args), name, args.version))


@command("list", "the recipes: latest version, runs, last snapshot", group="recipe")
def cmd_recipe_list(args):
    rows = api.recipe_list(open_catalog(args))
    emit(args, rows, lambda rs: table(rs, ["name", "version", "runs", "last_snapshot", "created_at"]))


@command("explain", "both ways to run a recipe now (from scratch, incremental) with their estimated reads",
         arguments=_add_name, group="recipe")
def cmd_recipe_explain(args):
    name = _name(args)
    print(api.recipe_explain(open_catalog(args), name))


@command("run", "run the cheaper of from scratch and incremental (nothing when the recipe's last snapshot is up "
                "to date)", arguments=_add_name, group="recipe")
def cmd_recipe_run(args):
    name = _name(args)
    res = api.recipe_run(open_catalog(args, write=True), name)
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
    return {p.key: getattr(args, p.key) for p in api.parameters()
            if p.key != "weights" and getattr(args, p.key, None) is not None}


def _add_watch(p) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="folders whose checkpoint sub-folders are watched; a checkpoint is taken once its files are "
                        "unchanged over two scans and, for a full checkpoint, sampled windows of its tensors hold "
                        "data (not zeros where the base has data: a writer that preallocated its files and stalled "
                        "waits)")
    p.add_argument("--recipe", required=True, help="the recipe to run on every new or changed checkpoint")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between scans (default 5)")
    p.add_argument("--once", action="store_true", help="scan until nothing is pending, run the recipe, exit")


@command("watch", "watch folders for new or changed checkpoints and run a recipe on them (until SIGTERM)",
         arguments=_add_watch)
def cmd_watch(args):
    if not args.interval > 0:
        raise MergePipeError("--interval must be a positive number of seconds")
    res = api.watch(open_catalog(args, write=True), args.dirs, args.recipe, interval=args.interval, once=args.once,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    emit(args, {"snapshots": [r["snapshot_id"] for r in res["runs"]], "stopped_by": res["stopped_by"]},
         lambda d: print(f"{len(d['snapshots'])} snapshot(s) published"))
