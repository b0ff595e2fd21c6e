"""Deleting a published snapshot: its folder and its catalog rows, all or nothing.

Refused while another model's lineage needs it (a merge that took it as an input, a model registered
on it as its base) unless forced. The folder is first renamed aside, then the rows go in one
transaction, then the renamed folder is removed: a failure before the commit renames it back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.compacts import prune_files
from mergepipe.catalog.snapshots import delete_snapshot_rows, snapshot_dependents, snapshot_row
from mergepipe.errors import CatalogError
from mergepipe.manifest.build import MANIFEST_NAME


def _owns(out: Path, snapshot_id: str) -> bool:
    """True when ``out`` is the snapshot's folder (its manifest names the snapshot)."""
    try:
        data = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (data.get("run") or {}).get("snapshot_id") == snapshot_id


def delete_snapshot(catalog: Catalog, ref: str, force: bool = False) -> dict:
    """Delete snapshot ``ref`` (id or merged model id): its output folder and its catalog rows. Returns
    {'snapshot_id', 'model_id', 'out', 'removed_files', 'dependents'}."""
    row = snapshot_row(catalog, ref)
    if row is None:
        raise CatalogError(f"unknown snapshot {ref!r}")
    sid, model_id, out = row["id"], row["model_id"], Path(row["out"])
    needed = snapshot_dependents(catalog, model_id)
    if needed and not force:
        raise CatalogError(f"{sid} ({model_id}) is needed by {', '.join(needed)} (lineage); delete those first, "
                           f"or force it")
    aside = None
    if out.is_dir() and _owns(out, sid):
        aside = out.with_name(f".{out.name}.deleting-{os.getpid()}")
        os.replace(out, aside)
    try:
        with catalog.transaction():
            delete_snapshot_rows(catalog, sid, model_id)
    except BaseException:
        if aside is not None:
            os.replace(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    prune_files(catalog)  # the compact file of the deleted model, if it was analyzed as an expert
    return {"snapshot_id": sid, "model_id": model_id, "out": str(out), "removed_files": aside is not None,
            "dependents": needed}
