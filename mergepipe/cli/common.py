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


def table(rows: list[dict], columns: list[str], title: str | None = None, headers: dict | None = None,
          wide: tuple = (), wide_width: int = 120) -> None:
    """A table that stays readable at 80 columns: light borders, and cells that wrap (fold) instead of
    being cut with an ellipsis; ``headers`` renames columns for display; ``wide`` columns are shown only
    on a terminal at least ``wide_width`` columns wide (they stay in --json)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    console = Console()
    if console.width < wide_width:
        columns = [c for c in columns if c not in wide]
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for c in columns:
        t.add_column((headers or {}).get(c, c), overflow="fold")
    for r in rows:
        t.add_row(*[_fmt(r.get(c)) for c in columns])
    console.print(t)


def short_tensor(name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'L3.self_attn.q_proj' (tables at 80 columns; --json
    keeps the full name)."""
    import re
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
