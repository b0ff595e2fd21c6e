"""The ``mergepipe`` command line: a thin layer over the Python API.

User errors print one line (``error: ...``) and exit 2; nothing in the catalog changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import MergePipeError

SUBCOMMANDS: dict[str, callable] = {}


def command(name, help_text):
    def deco(fn):
        SUBCOMMANDS[name] = (fn, help_text)
        return fn
    return deco


def default_db() -> str:
    return os.environ.get("MERGEPIPE_DB", "mergepipe.sqlite")


def open_catalog(args, create: bool = False):
    from .catalog import Catalog
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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


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
    cat = open_catalog(args, create=True)
    print(f"catalog ready: {cat.path} (schema v{cat.query('SELECT value FROM meta WHERE key=?', ['schema_version'])[0]['value']})")


def _add_register(p):
    p.add_argument("--model-id", required=True)
    p.add_argument("--uri", required=True, help="checkpoint directory or .safetensors file")
    p.add_argument("--base", dest="base_id", help="id of the base model (for experts)")
    p.add_argument("--kind", default="full", choices=["full", "delta", "lora"])
    p.add_argument("--content-hash", action="store_true", help="also hash every byte (slow)")
    p.add_argument("--replace", action="store_true", help="replace an id registered with other content")


@command("register", "register a checkpoint (reads headers only)")
def cmd_register(args):
    from .registry import register
    cat = open_catalog(args, create=True)
    res = register(cat, args.model_id, args.uri, base_id=args.base_id, kind=args.kind,
                   with_content_hash=args.content_hash, replace=args.replace)
    emit(args, res, lambda r: print(f"{r['status']}: {r['model_id']} ({r['fingerprint'][:19]}...)"))


def _add_analyze(p):
    p.add_argument("--model-id", nargs="*", dest="model_ids", help="experts to analyze (default: all)")
    p.add_argument("--block-bytes", type=int, default=None, help="block size target (default 1 MiB)")
    p.add_argument("--sketch-size", type=int, default=None, help="sketch samples per block (default 2048)")
    p.add_argument("--densities", type=float, nargs="*", help="extra top-k densities to store thresholds for")
    p.add_argument("--force", action="store_true", help="re-analyze even if unchanged")


@command("analyze", "compute per-block delta statistics of experts against their base")
def cmd_analyze(args):
    from .analyze import DEFAULT_DENSITIES, analyze
    from .sketch import DEFAULT_SKETCH_SIZE
    cat = open_catalog(args)
    kw = {"force": args.force, "sketch_size": args.sketch_size or DEFAULT_SKETCH_SIZE,
          "densities": tuple(DEFAULT_DENSITIES) + tuple(args.densities or ())}
    if args.block_bytes is not None:
        kw["block_bytes"] = args.block_bytes
    prog, cb = progress_bar("analyze")
    with prog:
        results = analyze(cat, args.model_ids, progress=cb, **kw)
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
    cat = open_catalog(args)
    cat.model(args.model_id)
    if args.tensor is not None and not cat.query(
            "SELECT 1 FROM tensors WHERE model_id=? AND name=?", [args.model_id, args.tensor]):
        raise MergePipeError(f"model {args.model_id!r} has no tensor {args.tensor!r}")
    rows = cat.blocks(args.model_id, args.tensor)
    if not rows:
        raise MergePipeError(f"{args.model_id!r} has no block statistics yet (run `mergepipe analyze`)")
    emit(args, rows, lambda rs: table(rs, ["tensor", "block", "row_start", "row_end", "offset", "nbytes",
                                           "delta_l2", "delta_max_abs", "delta_nnz"]))


@command("make-family", "write a synthetic base + K experts family")
def cmd_make_family(args):
    from .family import make_family
    paths = make_family(args.out, experts=args.experts, size=args.size, dtype=args.dtype,
                        shard_bytes=args.shard_bytes, seed=args.seed)
    emit(args, paths, lambda p: print(f"wrote base {p['base']} and {len(p['experts'])} experts"))


@command("demo", "build a small family, register, analyze and merge it, then open the dashboard")
def cmd_demo(args):
    from .demo import run_demo
    run_demo(Path(args.dir), dashboard=not args.no_dashboard, port=args.port)


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
    mf.add_argument("--size", default="small", choices=["tiny", "small", "qwen3-0.6b"])
    mf.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    mf.add_argument("--shard-bytes", type=int, default=256 << 20)
    mf.add_argument("--seed", type=int, default=0)
    demo = parsers["demo"]
    demo.add_argument("--dir", default="mergepipe-demo", help="where the demo family and catalog go")
    demo.add_argument("--no-dashboard", action="store_true", help="stop after the merge")
    demo.add_argument("--port", type=int, default=8501)
    for extra in EXTRA_PARSERS:
        extra(parsers)
    return parser


EXTRA_PARSERS: list = []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] not in SUBCOMMANDS and "--base" in argv and "merge" in SUBCOMMANDS:
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
