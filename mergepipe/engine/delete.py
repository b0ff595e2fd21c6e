"""Deleting a published snapshot: its folder and its catalog rows, all or nothing.

Refused while another model's lineage needs it (a merge that took it as an input, a model registered
on it as its base) unless forced. The folder is first renamed aside, then the rows go in one
transaction, then the renamed folder is removed: a failure before the commit renames it back.

Exclusive with a `merge --extend` of the snapshot: the extend holds a shared lock on the snapshot's manifest
file while it reads the snapshot and the delete takes it exclusively (without waiting: refused while it is
held); the lineage is checked again inside the transaction that removes the rows, and the extend checks the
snapshot is still registered inside the transaction that registers its child, so whichever commits second
publishes or removes nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.compacts import prune_files
from mergepipe.catalog.snapshots import delete_snapshot_rows, snapshot_dependents, snapshot_row
from mergepipe.errors import CatalogError
from mergepipe.manifest.build import MANIFEST_NAME


def lock_snapshot(out: Path, shared: bool) -> int | None:
    """A lock on a local snapshot's manifest file, without waiting: shared while an extend reads the snapshot,
    exclusive while `delete` removes it. The open descriptor (close it to release), None if the snapshot has no
    manifest there; BlockingIOError while the other kind is held."""
    try:
        fd = os.open(Path(out) / MANIFEST_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owns(out: Path, snapshot_id: str) -> bool:
    """True when ``out`` is the snapshot's folder (its manifest names the snapshot)."""
    try:
        data = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (data.get("run") or {}).get("snapshot_id") == snapshot_id


def delete_snapshot(catalog: Catalog, ref: str, force: bool = False) -> dict:
    """Delete snapshot ``ref`` (id or merged model id): its output folder and its catalog rows. Returns
    {'snapshot_id', 'model_id', 'out', 'removed_files', 'dependents'}.

    Exclusive with an extend of it: refused while a `merge --extend` reads it (its shared lock on the manifest),
    and the dependents are checked again inside the transaction that removes the rows, so an extend that
    registered its child meanwhile makes the delete refuse (the folder is put back); an extend that commits
    after this delete publishes nothing (engine/extend.py)."""
    row = snapshot_row(catalog, ref)
    if row is None:
        raise CatalogError(f"unknown snapshot {ref!r}")
    sid, model_id, out = row["id"], row["model_id"], Path(row["out"])
    needed = _check_needed(catalog, sid, model_id, force)
    lock = _lock(out, sid, model_id) if out.is_dir() and _owns(out, sid) else None
    try:
        aside = _remove_rows(catalog, sid, model_id, out, force, lock is not None)
    finally:
        if lock is not None:
            os.close(lock)
    prune_files(catalog)  # the compact file of the deleted model, if it was analyzed as an expert
    return {"snapshot_id": sid, "model_id": model_id, "out": str(out), "removed_files": aside is not None,
            "dependents": needed}


def _check_needed(catalog: Catalog, sid: str, model_id: str, force: bool) -> list[str]:
    needed = snapshot_dependents(catalog, model_id)
    if needed and not force:
        raise CatalogError(f"{sid} ({model_id}) is needed by {', '.join(needed)} (lineage); delete those first, "
                           f"or force it")
    return needed


def _lock(out: Path, sid: str, model_id: str) -> int | None:
    try:
        return lock_snapshot(out, shared=False)
    except BlockingIOError:
        raise CatalogError(f"{sid} ({model_id}) is being read by a running `merge --extend`; delete it once that "
                           f"merge has ended") from None


def _remove_rows(catalog: Catalog, sid: str, model_id: str, out: Path, force: bool, owned: bool) -> Path | None:
    """Rename the folder aside, remove the rows (dependents checked again in the transaction), remove the
    folder; on any failure before the commit the folder is renamed back. The folder's renamed path, or None."""
    aside = None
    if owned:
        aside = out.with_name(f".{out.name}.deleting-{os.getpid()}")
        os.replace(out, aside)
    try:
        with catalog.transaction():
            _check_needed(catalog, sid, model_id, force)
            delete_snapshot_rows(catalog, sid, model_id)
    except BaseException:
        if aside is not None:
            os.replace(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return aside
