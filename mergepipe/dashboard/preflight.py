"""The Plan page's preflight: what merging a loaded mergekit config will meet, from every model's index, headers
and config.json only (api.preflight), as a table of the models plus the lines below it and the problems.

Local paths are vetted against the allowed folders (dashboard/paths.py), as everywhere on the dashboard; Hub repo
ids and remote URIs are read by range requests (a snapshot in the Hugging Face cache is a local folder, read when
it lies under an allowed folder)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from mergepipe import api
from mergepipe.dashboard.paths import check_path
from mergepipe.units import human_bytes

COLUMNS = ["model", "role", "from", "tensors", "params", "dtype", "vocab", "lm_head", "vs base", "bytes", "fetched"]


def config_preflight(cat, data: bytes | str, source: str, roots: list[Path]) -> dict:
    """A loaded config's preflight as plain data: ``rows`` (one per model), ``summary`` lines, ``problems`` (one
    line each), ``notes``, ``ok`` and ``transferred`` (bytes preflight moved). A config that does not parse
    raises its MergePipeError (the page shows it once, as the loader does)."""
    result = api.preflight(data if isinstance(data, bytes) else data.encode(), cat, source=source,
                           check_path=lambda t: check_path(t, roots))
    return {"source": source, "ok": result.ok, "rows": api.preflight_table(result),
            "summary": api.preflight_summary(result), "problems": list(result.problems), "notes": list(result.notes),
            "transferred": result.transferred}


def preflight_frame(pf: dict) -> pd.DataFrame:
    """The preflight table as the page shows it (bytes in binary units)."""
    rows = [{**r, "bytes": human_bytes(r["bytes"]) if r["bytes"] is not None else None,
             "fetched": human_bytes(r["fetched"])} for r in pf["rows"]]
    return pd.DataFrame(rows, columns=COLUMNS)


def preflight_verdict(pf: dict) -> str:
    n = len(pf["problems"])
    if not n:
        return f"Preflight of {pf['source']}: the merge will run (read {pf['transferred']:,} bytes of headers)."
    return (f"Preflight of {pf['source']}: {n} problem{'s' if n > 1 else ''}, the merge would not run (read "
            f"{pf['transferred']:,} bytes of headers).")
