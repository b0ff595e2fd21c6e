"""Catalog commands: init-db, register, analyze, models, blocks, make-family, serve, demo."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mergepipe import api
from mergepipe.cli.common import command, emit, open_catalog, progress_bar, short_tensor, table
from mergepipe.errors import MergePipeError


# --- catalog commands ----------------------------------------------------------------------------
@command("init-db", "create (or migrate) a catalog")
def cmd_init_db(args):
    cat = open_catalog(args, create=True, write=True)
    print(f"catalog ready: {cat.path} (schema v{api.schema_version(cat)})")


def _add_register(p):
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="checkpoint directories or .safetensors files, each named after its directory "
                        "(or file); all are registered in one transaction, or none")
    p.add_argument("--model-id", help="id of the one checkpoint given by --uri (or by one PATH)")
    p.add_argument("--uri", help="checkpoint directory or .safetensors file; or a remote checkpoint: "
                   "s3://bucket/prefix, https://host/path, hf://org/model[@revision]")
    p.add_argument("--base", dest="base_id", help="id of the base model (for experts)")
    p.add_argument("--kind", default="full", choices=["full", "delta", "lora"],
                   help="full checkpoint (default), delta (expert - base) or a PEFT LoRA adapter")
    p.add_argument("--content-hash", action="store_true", help="also hash every byte (slow)")
    p.add_argument("--replace", action="store_true", help="replace an id registered with other content")
    p.add_argument("--verbose", action="store_true",
                   help="when an expert does not match its base, list every difference (on standard error)")


def _register_items(args) -> list[tuple[str, str]]:
    """(model id, path) pairs from `--model-id ID --uri PATH` or from positional paths."""
    paths = ([args.uri] if args.uri is not None else []) + list(args.paths)
    if not paths:
        raise MergePipeError("give the checkpoints to register: PATH [PATH ...] or --model-id ID --uri PATH")
    if args.uri is not None and args.paths:
        raise MergePipeError("give either --uri PATH or positional paths, not both")
    if args.model_id is None:
        return api.named_by_path(paths)
    if len(paths) > 1:
        raise MergePipeError("--model-id names one checkpoint; with several paths each is named after "
                             "its directory")
    return [(args.model_id, paths[0])]


@command("register", "register checkpoints (reads headers only)", arguments=_add_register)
def cmd_register(args):
    items = _register_items(args)
    cat = open_catalog(args, create=True, write=True)
    try:
        results = api.register_many(cat, items, base_id=args.base_id, kind=args.kind,
                                with_content_hash=args.content_hash, replace=args.replace)
    except MergePipeError as exc:
        if args.verbose:
            _print_details(exc)
        raise
    out = results[0] if args.uri is not None else results  # the single --uri form prints one object
    emit(args, out, lambda _: [print(f"{r['status']}: {r['model_id']} ({r['fingerprint'][:19]}...)")
                               for r in results])


def _print_details(exc: MergePipeError) -> None:
    """Every difference a refusal summarized, one per line on standard error, before its `error:` line."""
    for line in getattr(exc, "details", None) or ():
        print(f"  {line}", file=sys.stderr)


def _add_analyze(p):
    p.add_argument("ids", nargs="*", metavar="ID", help="experts to analyze (default: all)")
    p.add_argument("--model-id", nargs="*", dest="model_ids", help="experts to analyze, as the IDs")
    p.add_argument("--block-bytes", type=int, default=None, help="block size target (default 1 MiB)")
    p.add_argument("--sketch-size", type=int, default=None, help="sketch samples per block (default 2048)")
    p.add_argument("--densities", type=float, nargs="*", help="extra top-k densities to store thresholds for")
    p.add_argument("--force", action="store_true", help="re-analyze even if unchanged")
    p.add_argument("--gram", action="store_true",
                   help="also the pairwise statistics of these experts, analyzed together, that slerp, model_stock "
                        "and the other interpolation methods need (implies --force)")
    p.add_argument("--arcee", action="store_true",
                   help="also the per-tensor importance thresholds arcee_fusion needs (implies --gram)")
    p.add_argument("--sce-topk", type=float, action="append", metavar="X",
                   help="also the per-tensor top-k of the variance across these experts that sce needs for "
                        "select_topk X < 1 (repeatable; implies --gram)")
    p.add_argument("--compact", nargs="?", const="progressive", default=None, metavar="CODEC",
                   help="also store each block's compact delta, in the same read, for three-way plans: "
                        + "; ".join(f"{c}: {h}" for c, h in api.compact_codecs()) + " (default with the flag: progressive)")
    p.add_argument("--compact-group", type=int, default=None, metavar="N",
                   help="entries per scale of the compact deltas (a multiple of 8 in [16, 4096]; default 128)")
    p.add_argument("--run-id", type=int, help=argparse.SUPPRESS)


def _analyze_progress(cb, run, total_models: int):
    """analyze's progress callback: the bar and, with ``--run-id``, the run's row (blocks_* columns carry
    bytes for analyze runs: models done + fraction of the current one)."""
    finished = []

    def progress(label, done, total):
        cb(label, done, total)
        if run:
            if done >= total:
                finished.append(label)
            run(int((len(finished) + (0 if done >= total else done / max(total, 1))) * 1000), total_models * 1000,
                done)
    return progress


@command("analyze", "compute per-block delta statistics of experts against their base", arguments=_add_analyze)
def cmd_analyze(args):
    cat = open_catalog(args, write=True)
    if args.ids:
        args.model_ids = [*(args.model_ids or []), *args.ids]
    kw = {"force": args.force, "gram": args.gram, "arcee": args.arcee, "sce_topk": tuple(args.sce_topk or ()),
          "sketch_size": api.DEFAULT_SKETCH_SIZE if args.sketch_size is None else args.sketch_size,
          "densities": tuple(api.DEFAULT_DENSITIES) + tuple(args.densities or ())}
    if args.block_bytes is not None:
        kw["block_bytes"] = args.block_bytes
    if args.compact is not None:
        kw["compact"] = args.compact
    if args.compact_group is not None:
        kw["compact_group"] = args.compact_group
    prog, cb = progress_bar("analyze")
    total_models = max(1, len(args.model_ids or [m for m in cat.models() if m["base_id"]]))
    with api.recorded_run(cat, args.run_id) as run, prog:
        results = api.analyze(cat, args.model_ids, progress=_analyze_progress(cb, run, total_models), **kw)
    out = [r.__dict__ for r in results]

    def render(rows):
        for r in rows:
            if r["skipped"]:
                print(f"{r['model_id']}: unchanged, skipped")
            else:
                rate = r["bytes_read"] / r["seconds"] if r["seconds"] else 0
                print(f"{r['model_id']}: {r['n_blocks']} blocks, read {api.human_bytes(r['bytes_read'])} "
                      f"in {r['seconds']:.2f} s ({api.human_bytes(rate)}/s)"
                      + (f"; compact {api.human_bytes(r['compact']['bytes'])}" if r.get("compact") else ""))
        stored = [r["compact"] for r in rows if r.get("compact")]
        if stored:
            print(f"compact deltas ({stored[0]['codec']}, groups of {stored[0]['group']}): "
                  f"{api.compact_growth_text(sum(c['bytes'] for c in stored), sum(c['expert_bytes'] for c in stored))}")
    emit(args, out, render)
    done = {r["model_id"] for r in out}
    for base in sorted({m["base_id"] for m in cat.models() if m["id"] in done and m["base_id"]}):
        for w in api.outlier_warnings(cat, base, sorted(done)):
            print(f"warning: {w}", file=sys.stderr)


def _add_wide(p):
    p.add_argument("--wide", action="store_true",
                   help="show every column in full, however wide the lines (ids are never cut or wrapped)")


@command("models", "list registered models", arguments=_add_wide)
def cmd_models(args):
    cat = open_catalog(args)
    rows = [{k: v for k, v in m.items() if k != "config"} for m in cat.models()]
    for r in rows:
        r["analyzed"] = bool(r["base_id"]) and cat.is_analyzed(r["id"])
    emit(args, rows, lambda rs: table(
        [{**r, "bytes": api.human_bytes(r["bytes"]), "fingerprint": r["fingerprint"][7:19],
          "analyzed": "yes" if r["analyzed"] else ("no" if r["base_id"] and not r["snapshot_id"] else "-")} for r in rs],
        ["id", "kind", "base_id", "architecture", "dtype", "params", "bytes", "fingerprint", "analyzed"],
        headers={"base_id": "base", "bytes": "size", "fingerprint": "fp"}, wide=("architecture", "params"),
        show_all=args.wide))


def _add_blocks(p):
    p.add_argument("--model-id", required=True, help="the analyzed expert")
    p.add_argument("--tensor", help="only this tensor's blocks")


@command("blocks", "per-block statistics of an analyzed expert", arguments=_add_blocks)
def cmd_blocks(args):
    cat = open_catalog(args)
    cat.model(args.model_id)
    if args.tensor is not None and not api.has_tensor(cat, args.model_id, args.tensor):
        raise MergePipeError(f"model {args.model_id!r} has no tensor {args.tensor!r}")
    rows = cat.blocks(args.model_id, args.tensor)
    if not rows:
        raise MergePipeError(f"{args.model_id!r} has no block statistics yet (run `mergepipe analyze`)")
    emit(args, rows, lambda rs: table(
        [{**r, "tensor": short_tensor(r["tensor"]), "rows": f"{r['row_start']}-{r['row_end']}",
          "nbytes": api.human_bytes(r["nbytes"])} for r in rs],
        ["tensor", "block", "rows", "offset", "nbytes", "delta_l2", "delta_max_abs", "delta_nnz"],
        headers={"delta_l2": "|d|_2", "delta_max_abs": "max|d|", "delta_nnz": "nnz", "nbytes": "size"},
        wide=("offset",), keep=("tensor",)))


def _add_make_family(p):
    p.add_argument("out", help="directory to write base/ and expert_1/ ... into")
    p.add_argument("--experts", type=int, default=4, help="number of experts (default 4)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium", "qwen3-0.6b"],
                   help="tensor shapes (default small)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="dtype (default bf16)")
    p.add_argument("--shard-bytes", type=int, default=256 << 20, help="bytes per shard (default 256 MiB)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


@command("make-family", "write a synthetic base + K experts family", arguments=_add_make_family)
def cmd_make_family(args):
    from mergepipe.research.family import make_family  # imports torch: only when called
    paths = make_family(args.out, experts=args.experts, size=args.size, dtype=args.dtype,
                        shard_bytes=args.shard_bytes, seed=args.seed)
    emit(args, paths, lambda p: print(f"wrote base {p['base']} and {len(p['experts'])} experts"))


def _add_serve(p):
    p.add_argument("dir", metavar="DIR",
                   help="the folder whose files are served (e.g. a family: base/, expert_1/ ...)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed)")
    p.add_argument("--host", default=None,
                   help="address to listen on (default 127.0.0.1, this machine only); another address serves "
                        "every file under DIR to anyone who can reach it")


@command("serve", "serve a folder's checkpoints read-only over HTTP with byte ranges, for remote reads "
                  "(http://HOST:PORT/PATH)", arguments=_add_serve)
def cmd_serve(args):
    def ready(url, loopback):
        print(f"serving {Path(args.dir).resolve()} at {url}/ (read-only; Ctrl-C stops)", flush=True)
        if not loopback:
            print(f"warning: {args.host} is not loopback: anyone who can reach {url} can read every file "
                  f"under {args.dir}", file=sys.stderr, flush=True)
    api.serve_files(args.dir, port=args.port, host=args.host or "127.0.0.1", allow_remote=args.host is not None,
                on_ready=ready)


def _add_demo(p):
    p.add_argument("--dir", default="mergepipe-demo", help="where the demo family and catalog go")
    p.add_argument("--no-dashboard", action="store_true", help="stop after the merge")
    p.add_argument("--port", type=int, default=8501, help="dashboard port on 127.0.0.1 (default 8501)")


@command("demo", "build a small family, register, analyze and merge it, then open the dashboard",
         arguments=_add_demo)
def cmd_demo(args):
    from mergepipe.cli.demo import run_demo  # imports torch (the family's tensors): only when called
    run_demo(Path(args.dir), dashboard=not args.no_dashboard, port=args.port)
