"""What every command shares: the command registry, opening the catalog, JSON or table output, progress bars."""

from __future__ import annotations

import json
import os
import sys


SUBCOMMANDS: dict[str, callable] = {}


def command(name, help_text):
    def deco(fn):
        SUBCOMMANDS[name] = (fn, help_text)
        return fn
    return deco


def default_db() -> str:
    return os.environ.get("MERGEPIPE_DB", "mergepipe.sqlite")


def open_catalog(args, create: bool = False, write: bool = False):
    """The catalog at --db; ``write``: the command writes to it, so a read-only one is an error now."""
    from mergepipe.api import Catalog
    cat = Catalog(args.db, create=create)
    if write:
        cat.require_writable()
    return cat


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
