"""What every command shares: the command registry, opening the catalog, JSON or table output, progress bars.

A command is declared beside its function: ``@command(name, help, arguments=add_flags)`` registers the
function and the function that adds its flags to its parser (``group=`` makes it a sub-command of a
``command_group``, e.g. ``mergepipe recipe save``); cli/app.py builds the parser from this registry.
The parser is argparse's, not click's or typer's: no new dependency, and ``mergepipe --help`` stays
fast (argparse is in the standard library; click alone would add tens of milliseconds to every start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable

from mergepipe import api


@dataclass
class Command:
    """One ``mergepipe`` command (or a group of sub-commands, ``func`` None) in the order registered."""
    name: str
    help: str
    func: Callable | None = None
    arguments: Callable | None = None  # adds the command's flags to its parser
    children: dict[str, "Command"] = field(default_factory=dict)


# name -> Command; importing a command module registers its commands
COMMANDS: dict[str, Command] = {}


def command(name: str, help_text: str, arguments: Callable | None = None, group: str | None = None):
    """Register the decorated function as ``mergepipe NAME`` (``mergepipe GROUP NAME`` with ``group``);
    ``arguments(parser)`` adds its flags."""
    def deco(fn):
        where = COMMANDS if group is None else COMMANDS[group].children
        where[name] = Command(name, help_text, fn, arguments)
        return fn
    return deco


def command_group(name: str, help_text: str) -> None:
    """Register ``mergepipe NAME ACTION ...``: its actions are the commands registered with ``group=NAME``."""
    COMMANDS[name] = Command(name, help_text)


def add_commands(parser: argparse.ArgumentParser, commands: dict[str, Command], parents: list,
                 dest: str = "command", metavar: str | None = "COMMAND") -> None:
    """A sub-parser per command (and per action of a group), each with ``parents``' flags and its own."""
    sub = parser.add_subparsers(dest=dest, metavar=metavar, required=dest != "command")
    for c in commands.values():
        p = sub.add_parser(c.name, help=c.help, parents=parents, description=c.help)
        if c.func is not None:
            p.set_defaults(func=c.func)
        if c.arguments is not None:
            c.arguments(p)
        if c.children:
            add_commands(p, c.children, parents, dest="action", metavar=None)


def default_db() -> str:
    return os.environ.get("MERGEPIPE_DB", "mergepipe.sqlite")


def open_catalog(args, create: bool = False, write: bool = False):
    """The catalog at --db; ``write``: the command writes to it, so a read-only one is an error now."""
    cat = api.Catalog(args.db, create=create)
    if write:
        cat.require_writable()
    return cat


def emit(args, data, render=None) -> None:
    """Print ``data`` as JSON with --json, else through ``render`` (or as indented JSON)."""
    if getattr(args, "json", False) or render is None:
        print(json.dumps(data, indent=2, default=str))
    else:
        render(data)


def table(rows: list[dict], columns: list[str], title: str | None = None, headers: dict | None = None,
          wide: tuple = (), wide_width: int = 120, keep: tuple = ("id", "name"),
          show_all: bool = False) -> None:
    """A table that fits the terminal (COLUMNS, else its width, else 80) and whose ``keep`` columns (ids)
    are never wrapped or cut, so that they can be copied: the other columns are narrowed (their cells cut
    with an ellipsis), and the rightmost of them left out (and named below the table) when even that is too
    wide. One line per row. ``headers`` renames columns
    for display; ``wide`` columns are shown only at least ``wide_width`` columns wide (they stay in --json);
    ``show_all`` (--wide) shows every column at its full width, however wide the lines."""
    from rich import box  # rich on first use: `mergepipe --help` does not load it
    from rich.console import Console
    from rich.table import Table
    width = terminal_width()
    if not show_all and width < wide_width:
        columns = [c for c in columns if c not in wide]
    heads = [(headers or {}).get(c, c) for c in columns]
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    natural = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    kept = [c in keep for c in columns]
    whole = [c in keep or _numeric([row[i] for row in cells]) for i, c in enumerate(columns)]  # never cut
    widths = natural if show_all else fit_widths(natural, kept, width, whole)
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    shown = [i for i, w in enumerate(widths) if w]
    for i in shown:
        t.add_column(heads[i], width=widths[i], no_wrap=True, overflow="ignore" if whole[i] else "ellipsis")
    for row in cells:
        t.add_row(*[row[i] for i in shown])
    console = Console(width=max(width, table_width([widths[i] for i in shown])))
    with console.capture() as captured:
        console.print(t)
    sys.stdout.write("".join(_rstrip(line) for line in captured.get().splitlines(keepends=True)))
    left_out = [heads[i] for i, w in enumerate(widths) if not w]
    if left_out:
        print(textwrap.fill(f"(left out at {width} columns: {', '.join(left_out)}; --wide shows them)", width))


# A rendered table is its columns' widths, TABLE_GAP between two columns and TABLE_EDGE at its two edges.
TABLE_GAP, TABLE_EDGE, CUT_MIN = 3, 2, 8


def terminal_width() -> int:
    return shutil.get_terminal_size((80, 24)).columns


def table_width(widths: list[int]) -> int:
    return sum(widths) + TABLE_GAP * max(len(widths) - 1, 0) + TABLE_EDGE


def fit_widths(natural: list[int], kept: list[bool], width: int, whole: list[bool] | None = None) -> list[int]:
    """Column widths within ``width``: kept columns at their natural width; the rightmost other columns
    left out (width 0) while the table would not fit even with the rest narrowed (to CUT_MIN, or not at all
    if ``whole``: kept columns too); then the widest of the rest narrowed, one character at a time, until
    it fits."""
    whole = whole or kept
    floor = [n if w else min(CUT_MIN, n) for n, w in zip(natural, whole)]
    shown = list(range(len(natural)))
    while table_width([floor[i] for i in shown]) > width and not all(kept[i] for i in shown):
        shown.remove([i for i in shown if not kept[i]][-1])
    widths = [natural[i] if i in shown else 0 for i in range(len(natural))]
    while table_width([widths[i] for i in shown]) > width:
        narrowable = [i for i in shown if widths[i] > floor[i]]
        if not narrowable:
            break
        widths[max(narrowable, key=lambda i: widths[i])] -= 1
    return widths


def _rstrip(line: str) -> str:
    """A rendered line without its trailing padding (kept: the style codes and the newline)."""
    return re.sub(r"[ ]+((?:\x1b\[[0-9;]*m)*)(\n?)$", r"\1\2", line)


def _numeric(cells: list[str]) -> bool:
    """Whether a column holds numbers only (a cut number would mislead: such columns are kept whole)."""
    def number(text):
        try:
            float(text)
            return True
        except ValueError:
            return text == "-"
    return bool(cells) and all(number(c) for c in cells)


def short_tensor(name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'L3.self_attn.q_proj' (tables at 80 columns; --json
    keeps the full name)."""
    n = re.sub(r"^model\.", "", name)
    n = re.sub(r"(^|\.)layers\.(\d+)\.", r"\1L\2.", n)
    return n.removesuffix(".weight")


def short_date(ts: str | None) -> str:
    """'2026-12-03T14:30:34Z' -> '2026-12-03 14:30'."""
    return "-" if not ts else ts.replace("T", " ")[:16]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def progress_bar(description: str):
    """A rich progress bar usable as an analyze/engine progress callback: cb(label, done, total); on a stderr
    that is not a terminal, a bar that shows nothing (and rich is not imported)."""
    if not sys.stderr.isatty():
        import contextlib
        return contextlib.nullcontext(), lambda label, done, total: None
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    prog = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
    tasks = {}

    def cb(label, done, total):
        if label not in tasks:
            tasks[label] = prog.add_task(f"{description} {label}", total=total)
        prog.update(tasks[label], completed=done)

    return prog, cb
