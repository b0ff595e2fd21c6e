"""Hugging Face Hub commands: preflight (a merge config checked from headers only, before any weight byte moves).

``mergepipe preflight --config merge.yml`` prints one table (a row per model) and what the merge will meet:
the output's contents, the tokenizer, bytes to read and transfer, peak memory and time; then one
``problem:`` line per problem. Exit 0 when the merge will run, 1 otherwise. `plan --config` and
`merge --config` run the same checks first (:func:`preflight_gate`) and refuse with the same lines."""

from __future__ import annotations

import sys
from pathlib import Path

from mergepipe import api
from mergepipe.cli.common import command, emit, table
from mergepipe.errors import MergePipeError

COLUMNS = ["model", "role", "from", "tensors", "params", "dtype", "vocab", "lm_head", "vs base", "bytes", "fetched"]


def _add_preflight(p):
    p.add_argument("--config", required=True, help="a mergekit YAML config (models as catalog ids, paths, remote "
                                                   "URIs or Hugging Face repo ids: org/name[@revision])")
    p.add_argument("--budget", help="expert-read budget to estimate with (default: the config's, else 100%%)")
    p.add_argument("--wide", action="store_true", help="show every column at its full width")


def _seconds(s: float) -> str:
    return f"~{s:.3g} s" if s < 100 else f"~{s / 60:.3g} min"


def summary_lines(result) -> list[str]:
    """What the merge will meet, below the table (the CLI's and the dashboard's caption)."""
    o, e = result.output, result.estimate
    lines = []
    if o:
        grow = f", +{o['growth']:,} over the base's" if o["growth"] else " (the base's)"
        lines.append(f"output     {o['tensors']} tensors, {o['params']:,} parameters{grow}; head: {o['head']}")
        lines.append(f"tokenizer  {o['tokenizer']}")
    if e:
        full = e["full"]
        lines.append(f"read       full merge {api.human_bytes(full['read'])} (base + experts "
                     f"{api.human_bytes(full['expert'])}), transfer {api.human_bytes(full['transfer'])}, "
                     f"{_seconds(full['seconds'])}")
        if e.get("budgeted"):
            b = e["budgeted"]
            lines.append(f"budget     {e['budget']}: read <= {api.human_bytes(b['read'])} (experts "
                         f"{api.human_bytes(b['expert'])}), transfer <= {api.human_bytes(b['transfer'])}, "
                         f"{_seconds(b['seconds'])}")
        elif e.get("budget") is None:
            lines.append("budget     a target bound: the bytes it reads depend on the statistics ANALYZE stores")
        lines.append(f"memory     peak ~{api.human_bytes(e['peak_memory'])} of merge buffers (plus the process)")
    lines.append(f"preflight transferred {result.transferred:,} bytes (indexes, headers and configs only)")
    return lines


def print_problems(problems: list[str], stream=None) -> None:
    for p in problems:
        print(f"problem: {p}", file=stream or sys.stdout)


@command("preflight", "check a merge config from headers only, before any weight byte moves (exit 1 on problems)",
         arguments=_add_preflight)
def cmd_preflight(args):
    db = Path(args.db)
    result = api.preflight(args.config, db if db.exists() else None, budget=args.budget)
    if args.json:
        emit(args, api.preflight_dict(result))
        return 0 if result.ok else 1
    print(f"preflight of {result.source}: {result.method}")
    table(api.preflight_table(result), COLUMNS, keep=("model",), show_all=args.wide)
    for line in summary_lines(result):
        print(line)
    for note in result.notes:
        print(f"note: {note}")
    print_problems(result.problems)
    print("the merge will run" if result.ok else
          f"{len(result.problems)} problem{'s' if len(result.problems) > 1 else ''}: the merge would not run")
    return 0 if result.ok else 1


def preflight_gate(cfg, db: str | Path) -> None:
    """The preflight at the start of `plan`/`merge --config`: its problem lines on standard error, then the
    refusal (one ``error:`` line) before anything is registered."""
    try:
        api.preflight_gate(cfg, db)
    except MergePipeError as exc:
        print_problems(getattr(exc, "details", None) or (), sys.stderr)
        raise
