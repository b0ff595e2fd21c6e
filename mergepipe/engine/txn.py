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
import tempfile
import uuid
from pathlib import Path

from mergepipe.catalog import runs as runs_table
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.snapshots import snapshot_at
from mergepipe.errors import ExecutionError, StorageError
from mergepipe.storage.publish import is_remote, publisher_for
from mergepipe.storage.writers import write_failure
from mergepipe.storage.procs import pid_alive  # noqa: F401  (re-exported: recovery and the dashboard use it here)

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


def fsync_or_fail(fn, path: Path) -> None:
    """``fn(path)``; a failing fsync (a full disk, an I/O error) is a one-line ExecutionError."""
    try:
        fn(path)
    except OSError as exc:
        raise write_failure(exc, "flushing (fsync)", exc.filename or path) from exc


def check_output_path(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise ExecutionError(f"{out}: output path already exists; published snapshots are never overwritten")
    if not out.parent.is_dir():
        raise ExecutionError(f"{out.parent}: parent directory does not exist")
    if not os.access(out.parent, os.W_OK):  # a read-only filesystem (even for root), or no permission
        raise ExecutionError(f"{out.parent}: cannot write there (read-only directory or filesystem); "
                             "choose another --out")


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
        ACTIVE.add(self.id)
        self.state = "recorded"
        try:
            self.staging.mkdir()
        except OSError as exc:
            raise write_failure(exc, "creating the staging directory", self.staging) from exc
        self.state = "staging"
        return self.staging

    def publish(self) -> None:
        """fsync everything staged, then rename it onto the output path."""
        fsync_or_fail(fsync_tree, self.staging)
        check_output_path(self.out)
        with self.catalog.transaction():
            runs_table.set_txn_status(self.catalog, self.id, "renamed", finished=False)
        try:
            os.rename(self.staging, self.out)
        except OSError as exc:
            raise write_failure(exc, f"publishing {self.staging} as", self.out) from exc
        self.state = "renamed"  # from here on an abort removes the output
        fsync_or_fail(fsync_path, self.out.parent)

    def commit(self, register_fn) -> None:
        """Run ``register_fn`` and mark the txn committed in one catalog transaction."""
        with self.catalog.transaction():
            register_fn()
            runs_table.set_txn_status(self.catalog, self.id, "committed")
        ACTIVE.discard(self.id)
        self.state = "committed"

    def abort(self) -> None:
        """Remove what was staged or renamed and mark the txn aborted. Runs while an error propagates, so
        it never raises: a catalog that cannot be written now (full, read-only) keeps the txn row
        unfinished, and `recover` (or `doctor`) finds it once this process is gone."""
        if self.state == "staging":
            shutil.rmtree(self.staging, ignore_errors=True)
        elif self.state == "renamed":
            shutil.rmtree(self.out, ignore_errors=True)
        if self.state in ("recorded", "staging", "renamed"):
            try:
                with self.catalog.transaction():
                    runs_table.set_txn_status(self.catalog, self.id, "aborted")
            except Exception:  # noqa: BLE001  (the error being propagated is the one to report)
                pass
        ACTIVE.discard(self.id)
        self.state = "aborted"


def _stale_txns(catalog: Catalog) -> list[dict]:
    """Unfinished transactions whose process is gone (a live one, here or elsewhere, is still running)."""
    return [t for t in runs_table.unfinished_txns(catalog)
            if not (t["id"] in ACTIVE or (t["pid"] != os.getpid() and pid_alive(t["pid"])))]


def _leftovers(catalog: Catalog, t: dict) -> list:
    """What recovering txn ``t`` removes: its staging directory, or its renamed but uncommitted output
    (for a remote output: the URIs of its publisher's leftovers -- its staging objects, and every object at
    the output when no snapshot there is in the catalog; a manifest object without a catalog record goes too)."""
    if is_remote(t["out"]):
        names = publisher_for(t["out"], t["id"]).leftovers(committed=bool(snapshot_at(catalog, t["out"])))
        return [f"{t['out']}/{n}" for n in names]
    staging, out = Path(t["staging"]), Path(t["out"])
    paths = [staging] if staging.exists() else []
    if t["status"] == "renamed" and out.exists() and not snapshot_at(catalog, str(out)):
        paths.append(out)
    return paths


def recover(catalog: Catalog) -> dict:
    """Roll back every unfinished transaction whose process is gone; fail runs that died."""
    removed, rolled_back = [], []
    for t in _stale_txns(catalog):
        paths = _leftovers(catalog, t)
        if is_remote(t["out"]):
            publisher_for(t["out"], t["id"]).remove([p[len(t["out"]) + 1:] for p in paths])
        else:
            for path in paths:
                shutil.rmtree(path)
        removed += map(str, paths)
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


def recovery_findings(catalog: Catalog) -> list[str]:
    """What `recover` would do now, and staging directories nobody will clean up, one line each; changes
    nothing. Transactions and runs of live processes are not findings (they are in progress)."""
    findings = []
    for t in _stale_txns(catalog):
        try:
            what = ", ".join(f"remove {p}" for p in _leftovers(catalog, t)) or "nothing left on disk"
        except StorageError as exc:  # a remote output that cannot be listed now
            what = f"cannot list its objects now: {exc}"
        findings.append(f"transaction {t['id']} ({t['status']}, writing {t['out']}) was never committed: "
                        f"`mergepipe recover` rolls it back ({what})")
    for r in runs_table.unfinished_runs(catalog):
        if not pid_alive(r["pid"]):
            findings.append(f"run {r['id']} is recorded as running but its process is gone: "
                            "`mergepipe recover` marks it failed")
    txns = runs_table.txn_rows(catalog)
    unfinished = {t["staging"] for t in txns if t["status"] in ("staging", "renamed")}
    parents = {Path(t["out"]).parent for t in txns if not is_remote(t["out"])}
    for parent in sorted(p for p in parents if p.is_dir()):
        for entry in sorted(parent.iterdir()):
            if STAGING_MARK in entry.name and str(entry) not in unfinished:
                findings.append(f"stale staging directory {entry} belongs to no unfinished transaction: "
                                "nothing will publish it; delete it")
    return findings


class RemoteTransaction(Transaction):
    """A snapshot published to a remote URI by the publisher registered for its scheme
    (mergepipe.storage.publish; for ``s3://``: storage/s3_publisher.py): files are written to a local
    temporary directory as for a local merge, staged (each shard as soon as it is complete), moved to
    their final names, and the manifest is written last; the catalog commit follows. An abort removes
    the local files and every object this publish created (the manifest first)."""

    def __init__(self, catalog: Catalog, out: str):
        self.catalog = catalog
        self.id = "txn-" + uuid.uuid4().hex[:16]
        self.remote = publisher_for(out, self.id)
        self.out = self.remote.uri
        self.tmp = self.staging = None
        self.state = "new"

    def check(self) -> None:
        """The output can be written and nothing is published there yet (before anything is recorded)."""
        self.remote.check()

    def begin(self) -> Path:
        self.check()
        self.tmp = Path(tempfile.mkdtemp(prefix="mergepipe-out-"))
        self.staging = self.tmp / "snapshot"
        with self.catalog.transaction():
            runs_table.insert_txn(self.catalog, self.id, f"{self.out}/{self.remote.staging}", self.out, os.getpid())
        ACTIVE.add(self.id)
        self.state = "recorded"
        self.staging.mkdir()
        self.state = "staging"
        return self.staging

    def file_ready(self, path: Path) -> None:
        """Start uploading a finished output shard while the merge writes the next ones."""
        self.remote.upload_soon(self.staging, path)

    def publish(self) -> None:
        self.remote.stage(self.staging)
        with self.catalog.transaction():
            runs_table.set_txn_status(self.catalog, self.id, "renamed", finished=False)
        self.state = "renamed"
        self.remote.publish(self.staging)

    def commit(self, register_fn) -> None:
        super().commit(register_fn)
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def abort(self) -> None:
        if self.state in ("staging", "renamed"):
            self.remote.abort()
        self._remove_tmp()
        self.state = "staging" if self.state == "renamed" else self.state
        super().abort()
