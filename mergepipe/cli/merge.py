"""Plan and merge commands: plan, merge, execute, explain (also from mergekit YAML configs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mergepipe import api
from mergepipe.cli.common import command, emit, open_catalog, progress_bar
from mergepipe.cli.hub import preflight_gate, spelled_config
from mergepipe.errors import MergePipeError


# --- plan / merge / execute ---------------------------------------------------------------------
def _operator_help() -> str:
    names = ", ".join(s.name + (f" ({', '.join(a.upper() for a in s.aliases)})" if s.aliases else "")
                      for s in api.operators())
    return f"{names} (default linear, or the config's merge_method)"


def _param_help(p) -> str:
    """A declared parameter's help: what it does, its range and default, and which operators take it."""
    takers = [s.name for s in api.operators() if any(q.name == p.name for q in s.parameters)]
    every = len(takers) == len(api.operators())
    parts = [p.help]
    if p.range_text():
        parts.append(f"range {p.range_text()}")
    defaults = {next(q for q in s.parameters if q.name == p.name).default for s in api.operators() if s.name in takers}
    if getattr(p, "required", False):
        parts.append("required")
    elif len(defaults) == 1:
        parts.append(f"default {defaults.pop():g}" if p.kind is float else f"default {'on' if defaults.pop() else 'off'}")
    elif p.kind is bool:
        parts.append("default on for " + ", ".join(s.name for s in api.operators() if s.name in takers and
                                                    next(q for q in s.parameters if q.name == p.name).default))
    else:
        parts.append("default per operator")
    if not every:
        parts.append("operators: " + ", ".join(takers))
    return "; ".join(parts).replace("%", "%%")


def add_param(p, param) -> None:
    """The flags of one declared operator parameter (ops/spec.py)."""
    text = _param_help(param)
    if param.kind is bool:
        p.add_argument(param.option, dest=param.key, action="store_true", default=None, help=text)
        p.add_argument(f"--no-{param.name}", dest=param.key, action="store_false", help=f"turn {param.name} off")
    else:
        p.add_argument(param.option, dest=param.key, type=float, nargs=param.nargs, help=text)


def _add_plan_args(p, with_out: bool):
    p.add_argument("--config", help="a mergekit YAML config (models, base_model, merge_method, parameters); "
                                    "paths in it are registered and analyzed on the fly; flags given here "
                                    "override its values")
    p.add_argument("--base", help="base model id (required without --config)")
    p.add_argument("--experts", nargs="+", help="expert model ids (required without --config)")
    p.add_argument("--op", "--operator", dest="op", default=None, help=_operator_help())
    for param in api.parameters():  # generated from the operators' declarations
        add_param(p, param)
    p.add_argument("--budget", help="expert-read budget: 10%%, 0.1, 512MiB, 8GB (default 100%%)")
    p.add_argument("--io-budget-mb", type=float, help="expert-read budget in MiB")
    p.add_argument("--target-bound", type=float, metavar="EPS",
                   help="a relative error bound to meet instead of a budget (wins over --budget): the smallest "
                        "budget whose guaranteed ||M_full - M_budget||, as a fraction of ||M_full - base||, is at "
                        "most EPS; 0 reads every changed block; 0.05 (within 5%% of the full merge's change) is a "
                        "typical value")
    p.add_argument("--strategy", default=None,
                   help="how blocks are ranked: norm (default), conflict, kept, random, uniform")
    p.add_argument("--seed", type=int, default=None, help="seed of the random operators and strategy (default 0)")
    tier = p.add_mutually_exclusive_group()
    tier.add_argument("--compact", default=None, metavar="CODEC", choices=[m for m in api.compact_modes() if m != "off"],
                      help="read blocks the budget cannot read exactly from the catalog's compact deltas (analyze "
                           "--compact): auto (default: the levels stored), or sign1, q2, q4, progressive to restrict "
                           "the bits per entry read")
    tier.add_argument("--no-compact", dest="compact", action="store_const", const="off",
                      help="exact or omitted blocks only (plans as without compacts)")
    p.add_argument("--coalesce", choices=("auto", "on", "off"), default=None,
                   help="prefer fewer, larger ranges at (nearly) equal bytes: auto (default: when an expert is "
                        "remote), on, off")
    p.add_argument("--coalesce-tolerance", type=float, default=None,
                   help="coalescing re-chooses blocks within this fraction of the cut-off score per byte "
                        "(default 0.1)")
    p.add_argument("--moe-layout", choices=("fused", "per-expert"), default=None,
                   help="a Mixtral/Qwen3-MoE base's experts: fused (default, as transformers v5 and mergekit write "
                        "them: mlp.experts.gate_up_proj/down_proj) or per expert (the base's names)")
    if with_out:
        _add_out_args(p)


def _add_out_args(p):
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--model-id", help="id of the merged model (default: the output directory's name)")
    p.add_argument("--out-shard-size", type=int, default=2 << 30, help="bytes per output shard (default 2 GiB)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where the blocks are merged: local threads (default), or range tasks on a Ray cluster "
                        "(needs `pip install 'mergepipe[ray]'`; inputs and --out on storage every node sees)")
    p.add_argument("--address", help="with --executor ray: the cluster to join (auto, HOST:PORT, ray://HOST:PORT): "
                                     "its exposure (interfaces, token authentication, dashboard) is that cluster's "
                                     "setup, and this process serves a worker endpoint to its nodes; default: a new "
                                     "local cluster on 127.0.0.1 only, with Ray's token authentication")


def _add_extend_args(p):
    g = p.add_argument_group("incremental merge (additive operators: linear, task_arithmetic)")
    g.add_argument("--extend", metavar="SNAPSHOT",
                   help="change one expert of this published snapshot, reading the snapshot and that expert only")
    change = g.add_mutually_exclusive_group()
    change.add_argument("--add", metavar="EXPERT", help="with --extend: add this analyzed expert")
    change.add_argument("--remove", metavar="EXPERT", help="with --extend: take this expert out")
    change.add_argument("--reweight", nargs=2, metavar=("EXPERT", "W"), help="with --extend: give EXPERT weight W")
    g.add_argument("--weight", type=float, help="with --extend --add: the new expert's weight (default 1)")


def _extend_request(args):
    """The incremental request of `merge --extend` (the flags of a from-scratch merge are refused)."""
    if args.config or args.base or args.experts:
        raise MergePipeError("--extend takes its base and experts from the snapshot: drop --config/--base/--experts")
    given = [k for k, v in _settings(args).items() if v is not None] + [
        f for f, v in (("--op", args.op), ("--strategy", args.strategy), ("--seed", args.seed),
                       ("--target-bound", args.target_bound)) if v is not None]
    if given:
        raise MergePipeError(f"--extend keeps the snapshot's operator and parameters; drop {', '.join(given)}")
    if args.add:
        action, expert, weight = "add", args.add, args.weight
    elif args.remove:
        action, expert, weight = "remove", args.remove, args.weight
    elif args.reweight:
        action, expert, weight = "reweight", args.reweight[0], _number(args.reweight[1], "--reweight weight")
        if args.weight is not None:
            raise MergePipeError("give the new weight after --reweight EXPERT, not with --weight")
    else:
        raise MergePipeError("--extend needs one change: --add EXPERT, --remove EXPERT or --reweight EXPERT W")
    return api.extend_request(args.extend, action, expert, weight=weight, budget=_budget(args), out=args.out,
                              model_id=args.model_id)


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise MergePipeError(f"{what} must be a number, not {text!r}") from None


def _extend(args, cat):
    prog, cb = progress_bar("extend")
    with prog:
        plan, _, manifest = api.extend(cat, _extend_request(args), out_shard_bytes=args.out_shard_size,
                                       progress=lambda done, total, nbytes: cb("blocks", done, total))
    summary = api.extend_summary(plan, manifest)
    emit(args, summary, lambda s: print(
        f"published {s['snapshot_id']} as model {s['model_id']} at {s['out']} (extends {s['extends']})\n"
        f"  {s['change']['action']} {s['change']['expert']}: read snapshot "
        f"{api.human_bytes(s['realized']['snapshot_read'])}, expert {api.human_bytes(s['realized']['expert_read'])}, "
        f"base {api.human_bytes(s['realized']['base_read'])} (a from-scratch merge of the same set reads "
        f"{api.human_bytes(s['from_scratch_read'])}) in {s['seconds']:.2f} s\n"
        f"  error bound {s['error_bound']['absolute']:.4g}"))


def _settings(args) -> dict:
    """The operator parameters given on the command line (None: not given), by request keyword."""
    return {p.key: getattr(args, p.key, None) for p in api.parameters()}


def _budget(args):
    if args.budget is not None and args.io_budget_mb is not None:
        raise MergePipeError("give either --budget or --io-budget-mb, not both")
    if args.budget is None and args.io_budget_mb is None and args.target_bound is None:
        return None
    return api.Budget.of(args.budget, mb=args.io_budget_mb, target_bound=args.target_bound)


def _request(args):
    """The MergeRequest of the command line's flags (without --config)."""
    budget = _budget(args)
    if not args.base or not args.experts:
        raise MergePipeError("--base and --experts are required (or give a mergekit YAML with --config)")
    return api.merge_request(args.base, args.experts, args.op or "linear", budget=budget, seed=args.seed,
                             strategy=args.strategy, coalesce=args.coalesce, compact=args.compact,
                             coalesce_tolerance=args.coalesce_tolerance, out=getattr(args, "out", None),
                             moe_layout=args.moe_layout,
                             model_id=getattr(args, "model_id", None), **_settings(args))


def _make_plan(args, cat, save=True, reserved_ids=()):
    if args.config is not None:
        return _config_plan(args, cat, save, reserved_ids)
    return api.plan(cat, _request(args), save=save)


def _load_config(args, spelled=None):
    """The --config file (or the config --base/--experts spell), parsed and validated, with the command line's
    flags applied over it."""
    budget = _budget(args)
    if spelled is None and (args.base or args.experts):
        raise MergePipeError("--base/--experts cannot be combined with --config (the config names the models)")
    if args.coalesce is not None or args.coalesce_tolerance is not None:
        raise MergePipeError("--coalesce and --coalesce-tolerance go with --base/--experts; a config's plan coalesces automatically "
                             "when an expert is remote")
    return (spelled or api.load_config(args.config)).with_overrides(
        operator=args.op, budget=None if budget is None or budget.is_target else budget,
        target_bound=args.target_bound, strategy=args.strategy, seed=args.seed, compact=args.compact,
        moe_layout=args.moe_layout, **_settings(args))


def _config_plan(args, cat, save, reserved_ids):
    plan, resolved = api.plan_from_config(cat, args.config_parsed, save=save, reserved_ids=reserved_ids)
    for kw in resolved.to_register:
        print(f"registered {kw['model_id']} ({kw['kind']}) from {kw['uri']}", file=sys.stderr)
    return plan


def _plan_summary(plan) -> dict:
    return {"plan_id": plan.id, "digest": plan.digest, "operator": plan.operator,
            "budget_bytes": plan.budget_bytes, "full_expert_bytes": plan.full_expert_bytes,
            "estimated": plan.estimated, "blocks_selected": plan.blocks_selected,
            "expert_read_by_expert": plan.estimated_by_expert, "error_bound": plan.error_bound,
            "tiers": plan.tiers, **({"compact_note": plan.compact_note} if plan.compact_note else {}),
            **({"warnings": plan.warnings} if plan.warnings else {})}


def _open_for_plan(args):
    """The catalog for plan/merge; with --config the YAML is read first (a bad file creates nothing), its
    preflight runs (cli/hub.py: problems refuse the merge before anything is registered) and a missing catalog
    is created, since the config's paths get registered into it. --base/--experts naming models that are not
    registered (Hub repo ids, paths, URIs) are merged as the config they spell."""
    spelled = spelled_config(args)
    if spelled is not None:
        args.config = spelled.source
    if args.config is not None:
        args.config_parsed = _load_config(args, spelled)
        preflight_gate(args.config_parsed, args.db)
        return open_catalog(args, create=True, write=True)
    return open_catalog(args, write=True)


@command("plan", "make and store a plan (reads no expert bytes)",
         arguments=lambda p: _add_plan_args(p, with_out=False))
def cmd_plan(args):
    cat = _open_for_plan(args)
    plan = _make_plan(args, cat)
    emit(args, _plan_summary(plan), lambda _: print(plan.explain()))


def _execute(args, cat, plan, run=None):
    """Run the plan; its manifest. ``run``: the RunProgress of `execute --run-id` (else None)."""
    prog, cb = progress_bar("merge")

    def progress(done, total, nbytes):
        cb("blocks", done, total)
        if run:
            run(done, total, nbytes)
    with prog:
        _, manifest = api.execute(cat, plan, out=args.out, model_id=args.model_id, out_shard_bytes=args.out_shard_size,
                                  progress=progress, run_id=run.run_id if run else None, executor=args.executor,
                                  address=args.address)
    return manifest


def _print_merge(args, plan, manifest) -> None:
    summary = api.merge_summary(plan, manifest)
    emit(args, summary, lambda s: print(
        f"published {s['snapshot_id']} as model {s['model_id']} at {s['out']}\n"
        f"  manifest {s['manifest_hash']}\n"
        f"  expert read {api.human_bytes(s['realized']['expert_read'])}"
        + (f" + compact {api.human_bytes(s['realized']['compact_read'])}" if s["realized"].get("compact_read") else "")
        + f" of {api.human_bytes(s['full_expert_bytes'])} "
        + (f"(first merge: read in full, {s['budget_used_pct']:g} %; the {s['budget']} asked for applies from the next "
           f"merge)" if s["first_merge"] else f"(budget {s['budget']} = {api.human_bytes(s['budget_bytes'])}, used "
           f"{s['budget_used_pct']:g} %)") + f", base read {api.human_bytes(s['realized']['base_read'])}, "
        f"wrote {api.human_bytes(s['realized']['output_write'])} in {s['seconds']:.2f} s"
        + (f"\n  error bound {s['error_bound']['absolute']:.4g} (relative {s['error_bound']['relative']:.3e})"
           if s["error_bound"] else "")))


def _add_merge_args(p):
    _add_plan_args(p, with_out=True)
    _add_extend_args(p)


@command("merge", "plan and execute a merge, publishing a snapshot", arguments=_add_merge_args)
def cmd_merge(args):
    if args.extend is not None:
        return _extend(args, open_catalog(args, write=True))
    if args.add or args.remove or args.reweight or args.weight is not None:
        raise MergePipeError("--add, --remove, --reweight and --weight go with --extend SNAPSHOT")
    cat = _open_for_plan(args)
    # Not saved here: the engine stores the plan once the output path and model id are known to be
    # usable, so a refused merge leaves the catalog unchanged.
    reserved = ()
    if args.config is not None:  # refuse a taken output before registering or analyzing anything
        _, model_id = api.check_target(cat, args.out, args.model_id)
        reserved = (model_id,)
    plan = _make_plan(args, cat, save=False, reserved_ids=reserved)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    _print_merge(args, plan, _execute(args, cat, plan))


def _add_execute_args(p):
    p.add_argument("plan_id", help="a stored plan (see `mergepipe plan`)")
    _add_out_args(p)
    p.add_argument("--run-id", type=int, help=argparse.SUPPRESS)


@command("execute", "execute a stored plan", arguments=_add_execute_args)
def cmd_execute(args):
    cat = open_catalog(args, write=True)
    # the engine marks the run succeeded, in the transaction that publishes the snapshot
    with api.recorded_run(cat, args.run_id, finish=False) as run:
        plan = api.load_plan(cat, args.plan_id)
        manifest = _execute(args, cat, plan, run)
    _print_merge(args, plan, manifest)


def _add_explain_args(p):
    p.add_argument("ref", help="plan id, snapshot id, merged model id or snapshot directory")
    p.add_argument("--as-mergekit", action="store_true", help="print the equivalent mergekit YAML config instead")
    p.add_argument("--out", help="with --as-mergekit: write the YAML to this file")
    p.add_argument("--all", action="store_true", help="list every expert (default: the top 16 by bytes read)")
    p.add_argument("--experts-top", type=int, default=16, metavar="N", help="experts listed (top N by bytes read)")
    p.add_argument("--experts", metavar="PATTERN", help="list only the experts whose id matches (fnmatch: 'e1*')")


@command("explain", "print a plan or a snapshot, per expert and per tensor", arguments=_add_explain_args)
def cmd_explain(args):
    if args.as_mergekit:
        return _explain_mergekit(args)
    if args.out is not None:
        raise MergePipeError("--out goes with --as-mergekit")
    cat = open_catalog(args)
    if args.json:
        if api.find_plan_id(cat, args.ref) is not None:
            print(api.load_plan(cat, args.ref).to_json(indent=2))
        else:
            print(api.load_manifest(cat, args.ref).to_json())
        return
    if args.experts_top < 1:
        raise MergePipeError(f"--experts-top takes a count of at least 1, not {args.experts_top}")
    print(api.explain(cat, args.ref, None if args.all else args.experts_top, args.experts))


def _explain_mergekit(args):
    cat = open_catalog(args) if (Path(args.db).exists() or not Path(args.ref).is_dir()) else None
    text = api.export_mergekit(cat, args.ref)
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


def _add_sweep_args(p):
    p.add_argument("--config", required=True, help="the sweep's YAML: base, experts, out, grid and/or points, "
                                                   "executor, concurrency, evaluate (see README, Ray)")
    p.add_argument("--executor", choices=("local", "ray"), help="override the config's executor")
    p.add_argument("--address", help="with --executor ray: the cluster to join, exposed as that cluster is set up "
                                     "(default: a new local one on 127.0.0.1 only, with token authentication)")
    p.add_argument("--concurrency", type=int, help="with ray: merges in flight at once (override)")


def _evaluator(spec: dict):
    """(metric, value) of an output directory: perplexity on the config's held-out text."""
    from mergepipe.research.evaluate import check_scoring, perplexity, read_eval_file  # imports torch
    text = read_eval_file(spec["text"], "evaluate.text: ").decode("utf-8", errors="replace")
    window, max_tokens = int(spec.get("window", 256)), int(spec.get("max_tokens", 2048))
    check_scoring(window, max_tokens, ("evaluate.window", "evaluate.max_tokens"))
    return lambda out: ("perplexity", perplexity(str(out), text, window=window, max_tokens=max_tokens)["perplexity"])


def _point_line(row: dict) -> str:
    s = row["settings"]
    what = " ".join(f"{k}={v}" for k, v in s.items())
    if row["status"] != "published":
        return f"  [{row['point']}] {what}: {row['status']}: {row['error']}"
    quality = f", {row['metric']} {row['quality']:.4g}" if row.get("quality") is not None else ""
    return (f"  [{row['point']}] {what}: {row['snapshot_id']}, expert read {api.human_bytes(row['expert_read'])}, "
            f"{row['seconds']:.2f} s{quality}")


@command("sweep", "plan and run a grid or list of merges (locally or on Ray), recorded as a sweep table",
         arguments=_add_sweep_args)
def cmd_sweep(args):
    cat = open_catalog(args, write=True)
    cfg = api.load_sweep(args.config).with_overrides(args.executor, args.address, args.concurrency)
    evaluate = _evaluator(cfg.evaluate) if cfg.evaluate else None
    res = api.run_sweep(cat, cfg, evaluate)
    failed = [r for r in res["points"] if r["status"] != "published"]
    emit(args, res, lambda r: print(f"sweep {r['sweep_id']} ({r['name']}): {len(r['points']) - len(failed)} of "
                                    f"{len(r['points'])} points published\n"
                                    + "\n".join(_point_line(p) for p in r["points"])))
    if failed:
        raise MergePipeError(f"{len(failed)} of {len(res['points'])} sweep points failed (sweep {res['sweep_id']})")
