"""Transactions: stage, fsync, publish by atomic rename; the catalog commit is the visibility point.

Sequence of a merge: (1) a ``txns`` row records the staging directory (committed first, so a crash at
any later instant can be cleaned up); (2) every file is written into the staging directory on the
same filesystem and fsynced; (3) the staging directory is renamed onto the output path and the parent
directory fsynced; (4) one catalog transaction registers the snapshot and marks the txn committed.
``recover`` rolls back any txn that did not reach (4): it deletes the staging directory, or the
renamed output when the crash fell between (3) and (4).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from mergepipe.catalog import runs as runs_table
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.snapshots import snapshot_at
from mergepipe.errors import ExecutionError

STAGING_MARK = ".mergepipe-staging-"
ACTIVE: set[str] = set()  # ids of this process's transactions still in flight


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(root)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def check_output_path(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise ExecutionError(f"{out}: output path already exists; published snapshots are never overwritten")
    if not out.parent.is_dir():
        raise ExecutionError(f"{out.parent}: parent directory does not exist")


class Transaction:
    """One staged output directory, published atomically."""

    def __init__(self, catalog: Catalog, out: str | Path):
        self.catalog = catalog
        self.out = Path(out).absolute()
        self.id = "txn-" + uuid.uuid4().hex[:16]
        self.staging = self.out.parent / f".{self.out.name}{STAGING_MARK}{self.id}"
        self.state = "new"

    def begin(self) -> Path:
        check_output_path(self.out)
        with self.catalog.transaction():
            runs_table.insert_txn(self.catalog, self.id, str(self.staging), str(self.out), os.getpid())
        self.staging.mkdir()
        ACTIVE.add(self.id)
        self.state = "staging"
        return self.staging

    def publish(self) -> None:
        """fsync everything staged, then rename it onto the output path."""
        fsync_tree(self.staging)
        check_output_path(self.out)
        with self.catalog.transaction():
            runs_table.set_txn_status(self.catalog, self.id, "renamed", finished=False)
        os.rename(self.staging, self.out)
        fsync_path(self.out.parent)
        self.state = "renamed"

    def commit(self, register_fn) -> None:
        """Run ``register_fn`` and mark the txn committed in one catalog transaction."""
        with self.catalog.transaction():
            register_fn()
            runs_table.set_txn_status(self.catalog, self.id, "committed")
        ACTIVE.discard(self.id)
        self.state = "committed"

    def abort(self) -> None:
        if self.state == "staging":
            shutil.rmtree(self.staging, ignore_errors=True)
        elif self.state == "renamed":
            shutil.rmtree(self.out, ignore_errors=True)
        if self.state in ("staging", "renamed"):
            with self.catalog.transaction():
                runs_table.set_txn_status(self.catalog, self.id, "aborted")
        ACTIVE.discard(self.id)
        self.state = "aborted"


def recover(catalog: Catalog) -> dict:
    """Roll back every unfinished transaction whose process is gone; fail runs that died."""
    removed, rolled_back = [], []
    for t in runs_table.unfinished_txns(catalog):
        if t["id"] in ACTIVE or (t["pid"] != os.getpid() and pid_alive(t["pid"])):
            continue  # still running (here or in another live process)
        staging, out = Path(t["staging"]), Path(t["out"])
        if staging.exists():
            shutil.rmtree(staging)
            removed.append(str(staging))
        if t["status"] == "renamed" and out.exists() and not snapshot_at(catalog, str(out)):
            shutil.rmtree(out)
            removed.append(str(out))
        with catalog.transaction():
            runs_table.set_txn_status(catalog, t["id"], "rolled_back")
        rolled_back.append(t["id"])
    failed_runs = []
    for r in runs_table.unfinished_runs(catalog):
        if not pid_alive(r["pid"]):
            with catalog.transaction():
                runs_table.mark_run_died(catalog, r["id"])
            failed_runs.append(r["id"])
    return {"rolled_back": rolled_back, "removed": removed, "failed_runs": failed_runs}
