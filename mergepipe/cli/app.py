"""The ``mergepipe`` command line: a thin layer over the Python API.

User errors print one line (``error: ...``) and exit 2; nothing in the catalog changes.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import sys

from mergepipe.errors import MergePipeError
# Importing a command module registers its commands (in this order: catalog, merge, snapshots).
from mergepipe.cli import catalog, merge, snapshots  # noqa: F401
from mergepipe.cli.catalog import _add_analyze, _add_register
from mergepipe.cli.common import ARGUMENTS, SUBCOMMANDS, default_db
from mergepipe.cli.merge import _add_extend_args, _add_out_args, _add_plan_args, _add_sweep_args


def _add_recipe_args(p) -> None:
    from mergepipe import api
    from mergepipe.cli.merge import _add_param
    p.add_argument("action", choices=["save", "show", "list", "explain", "run"], help="what to do")
    p.add_argument("name", nargs="?", help="the recipe's name")
    p.add_argument("--base", help="save: the base model id")
    p.add_argument("--experts", nargs="+", help="save: expert ids or name patterns ('math-*')")
    p.add_argument("--op", "--operator", dest="op", help="save: the operator (default linear)")
    p.add_argument("--weight", action="append", metavar="PATTERN=W", help="save: weight of matching experts (default 1)")
    p.add_argument("--budget", help="save: expert-read budget (default 100%%)")
    p.add_argument("--out", help="save: output folder pattern with {name}, {n}, {version}, {date} (default {name}-{n})")
    p.add_argument("--version", type=int, help="show: this version (default the latest)")
    for param in api.parameters():
        if param.key != "weights":
            _add_param(p, api, param)


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
        if name in ARGUMENTS:  # a command that declares its own arguments (cli/common.py: command)
            ARGUMENTS[name](parsers[name])
    _add_register(parsers["register"])
    _add_analyze(parsers["analyze"])
    parsers["blocks"].add_argument("--model-id", required=True, help="the analyzed expert")
    parsers["blocks"].add_argument("--tensor", help="only this tensor's blocks")
    mf = parsers["make-family"]
    mf.add_argument("out", help="directory to write base/ and expert_1/ ... into")
    mf.add_argument("--experts", type=int, default=4, help="number of experts (default 4)")
    mf.add_argument("--size", default="small", choices=["tiny", "small", "medium", "qwen3-0.6b"],
                    help="tensor shapes (default small)")
    mf.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="dtype (default bf16)")
    mf.add_argument("--shard-bytes", type=int, default=256 << 20, help="bytes per shard (default 256 MiB)")
    mf.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo = parsers["demo"]
    demo.add_argument("--dir", default="mergepipe-demo", help="where the demo family and catalog go")
    demo.add_argument("--no-dashboard", action="store_true", help="stop after the merge")
    demo.add_argument("--port", type=int, default=8501, help="dashboard port on 127.0.0.1 (default 8501)")
    _add_plan_args(parsers["plan"], with_out=False)
    _add_plan_args(parsers["merge"], with_out=True)
    _add_extend_args(parsers["merge"])
    parsers["execute"].add_argument("plan_id", help="a stored plan (see `mergepipe plan`)")
    _add_out_args(parsers["execute"])
    _add_sweep_args(parsers["sweep"])
    parsers["execute"].add_argument("--run-id", type=int, help=argparse.SUPPRESS)
    for name in ("explain", "verify"):
        parsers[name].add_argument("ref", help="plan id, snapshot id, merged model id or snapshot directory")
    parsers["verify"].add_argument("--outputs-only", action="store_true",
                                   help="check the snapshot's files only, not whether its inputs are unchanged")
    parsers["explain"].add_argument("--as-mergekit", action="store_true",
                                    help="print the equivalent mergekit YAML config instead")
    parsers["explain"].add_argument("--out", help="with --as-mergekit: write the YAML to this file")
    ev = parsers["evaluate"]
    ev.add_argument("model_ids", nargs="+", metavar="MODEL", help="registered full checkpoints (snapshots too)")
    ev.add_argument("--text", help="a held-out UTF-8 text file: perplexity")
    ev.add_argument("--tasks", metavar="SUITE.jsonl",
                    help="a task suite: accuracy per task and their mean; one JSON object per line, "
                         '{"task", "prompt", "answer"} (exact match of the greedy answer) or '
                         '{"task", "prompt", "choices": [...], "answer": index} (multiple choice by log-likelihood)')
    ev.add_argument("--reference", metavar="MODEL",
                    help="a registered full checkpoint: the realized weight-space deviation ||M - R|| (and relative "
                         "to ||R||) of each model from it, e.g. from the full-budget merge")
    ev.add_argument("--window", type=int, default=256, help="tokens per scored window (default 256)")
    ev.add_argument("--max-tokens", type=int, default=8192, help="score at most this many tokens (default 8192)")
    ev.add_argument("--force", action="store_true", help="score again even when a stored result applies")
    ev.add_argument("--run-id", type=int, help=argparse.SUPPRESS)
    _add_recipe_args(parsers["recipe"])
    w = parsers["watch"]
    w.add_argument("dirs", nargs="+", metavar="DIR",
                   help="folders whose checkpoint sub-folders are watched; a checkpoint is taken once its files are "
                        "unchanged over two scans and, for a full checkpoint, sampled windows of its tensors hold data "
                        "(not zeros where the base has data: a writer that preallocated its files and stalled waits)")
    w.add_argument("--recipe", required=True, help="the recipe to run on every new or changed checkpoint")
    w.add_argument("--interval", type=float, default=5.0, help="seconds between scans (default 5)")
    w.add_argument("--once", action="store_true", help="scan until nothing is pending, run the recipe, exit")
    parsers["diff"].add_argument("a", help="the earlier snapshot (id or merged model id)")
    parsers["diff"].add_argument("b", help="the later snapshot")
    parsers["delete"].add_argument("ref", help="snapshot id or merged model id")
    parsers["delete"].add_argument("--force", action="store_true",
                                   help="delete even when another model's lineage needs it")
    parsers["lineage"].add_argument("model_id", nargs="?", help="a model id (default: the whole DAG)")
    parsers["lineage"].add_argument("--dot", action="store_true", help="print Graphviz DOT")
    parsers["dashboard"].add_argument("--port", type=int, default=8501,
                                      help="port on 127.0.0.1 (default 8501; refused when taken)")
    parsers["dashboard"].add_argument(
        "--allow-root", action="append", metavar="DIR",
        help="also let the dashboard read checkpoints from and write merges into DIR (repeatable); added to "
             "$MERGEPIPE_ALLOWED_ROOTS when set, else to the working directory and the catalog's folder")
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


# Options taking one value that may be written with a leading minus (`--budget -5%`, `--target-bound
# -1e-3`): argparse takes such a value for an option and prints its usage; joined as `--budget=-5%`,
# the value reaches its own parser, which refuses it in one error line.
VALUE_OPTIONS = ("--budget", "--io-budget-mb", "--target-bound")
_LOOKS_NEGATIVE = re.compile(r"^-[0-9.]")


def _join_negative_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return out + argv[i:]
        if tok in VALUE_OPTIONS and i + 1 < len(argv) and _LOOKS_NEGATIVE.match(argv[i + 1]):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def _one_line(message: str) -> str:
    """An error message on one line, whatever names it quotes."""
    return " ".join(message.splitlines()) or "(no message)"


# The exit status of a command whose output went into a closed pipe (`mergepipe explain ID | head`): a
# process ended by SIGPIPE, 128 + 13, as the shell reports one; nothing is printed.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Output into a closed pipe ends quietly (EXIT_BROKEN_PIPE)."""
    try:
        try:
            return _main(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe or socket broke: not the reader of our output going away
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _stdout_closed() -> bool:
    """Whether standard output is a pipe (or socket) whose reader has gone."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real descriptor (redirected in-process), no poll
        return False


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that what is left in its buffer is dropped at exit (Python
    flushes it then and would report the broken pipe again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _main(argv: list[str] | None = None) -> int:
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
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
        code = args.func(args)  # a command may return its exit status (doctor: 1 on findings)
    except MergePipeError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
