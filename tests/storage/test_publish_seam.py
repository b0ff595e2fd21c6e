"""The write side of the storage seam: a merge to ``scheme://...`` is published by the Publisher registered
for that scheme (mergepipe.storage.publish), as a read is served by the Storage registered for it.

A small real publisher, ``folder://`` (a local directory written through the Publisher protocol: staged
under ``.mergepipe-staging-<txn>/``, moved to the final names, the manifest last), and a read backend for
the same scheme (so the merged model can be registered) are registered next to the built-in ones.
Asserted: a merge to ``folder://`` through mergepipe.api publishes files bit-identical to the same merge
to a local directory, the manifest written last and no staging object left; a failure while staging or
just before the manifest makes ``abort`` remove every object written (staged ones included) and leaves the
catalog without the model; a crashed publish is found by ``recovery_findings`` and removed by ``recover``
through the publisher's ``leftovers`` and ``remove``; a scheme with no publisher (never registered, or
unregistered) is refused with the exact read-only error and the catalog unchanged.
"""

from __future__ import annotations

import os
import shutil
from contextlib import closing
from pathlib import Path

import pytest

from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register, register_many
from mergepipe.engine import txn as txn_module
from mergepipe.errors import StorageError
from mergepipe.research.family import make_family
from mergepipe.storage import publish, registry
from mergepipe.storage.base import MANIFEST_NAME, STAGING_PREFIX
from mergepipe.storage.local import LocalStorage

from merge_helpers import dir_hashes, dump_db, rows, sha256_file

SCHEME = "folder"
SHARD_BYTES = 48 << 10  # output shards of the tiny family: several of them


def local_path(uri) -> Path:
    return Path(os.fspath(uri)[len(SCHEME) + 3:])


class FolderStorage(LocalStorage):
    """Reads ``folder:///abs/path`` as the local path (the merged model is registered through it)."""

    def open(self, uri):
        return super().open(local_path(uri))

    def stamp(self, uri):
        return super().stamp(local_path(uri))


class FolderPublisher:
    """Publishes into the local directory ``folder:///abs/path`` through the Publisher protocol, recording
    every object it writes in ``log`` (in order); ``fail_at`` names a step that fails, for abort tests."""

    def __init__(self, uri: str, txn_id: str, log: list[str], fail_at: str | None = None):
        self.uri = uri
        self.root = local_path(uri)
        self.staging = f"{STAGING_PREFIX}{txn_id}"
        self.log = log
        self.fail_at = fail_at
        self.written: list[str] = []  # every object this publish created, for abort
        self.staged: list[str] = []  # names relative to the snapshot folder

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def check(self) -> None:
        if not self.root.parent.is_dir():
            raise StorageError(f"{self.uri}: parent directory does not exist")
        if self.names():
            raise StorageError(f"{self.uri}: output already holds objects")

    def _write(self, name: str, source: Path, move: bool = False) -> None:
        dest = self.root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.written.append(name)
        os.replace(source, dest) if move else shutil.copyfile(source, dest)
        self.log.append(name)

    def _stage_one(self, local: Path, path: Path) -> None:
        rel = path.relative_to(local).as_posix()
        if rel not in self.staged:
            if self.fail_at == "stage" and len(self.staged) == 2:
                raise StorageError(f"{self.uri}/{rel}: injected failure while staging")
            self._write(f"{self.staging}/{rel}", path)
            self.staged.append(rel)

    def upload_soon(self, local: Path, path: Path) -> None:
        if path.name != MANIFEST_NAME:
            self._stage_one(local, path)

    def stage(self, local: Path) -> None:
        for path in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
            self._stage_one(local, path)

    def publish(self, local: Path) -> None:
        for rel in self.staged:
            self._write(rel, self.root / self.staging / rel, move=True)
        if self.fail_at == "publish":
            raise StorageError(f"{self.uri}: injected failure before the manifest")
        self._write(MANIFEST_NAME, local / MANIFEST_NAME)
        shutil.rmtree(self.root / self.staging)

    def abort(self) -> None:
        self.remove(list(self.written))

    def leftovers(self, committed: bool) -> list[str]:
        names = self.names()
        return names if not committed else [n for n in names if n.startswith(self.staging + "/")]

    def remove(self, names: list[str]) -> None:
        for name in sorted(names, key=lambda n: n != MANIFEST_NAME):
            (self.root / name).unlink(missing_ok=True)
        staging = self.root / self.staging
        if staging.is_dir() and not any(p.is_file() for p in staging.rglob("*")):
            shutil.rmtree(staging)


@pytest.fixture()
def seam():
    """The ``folder://`` scheme registered on both sides; ``seam["fail_at"]`` injects a failure."""
    state = {"log": [], "fail_at": None}
    publish.register_publisher(SCHEME, lambda uri, txn_id: FolderPublisher(uri, txn_id, state["log"],
                                                                           state["fail_at"]))
    registry.register_backend(SCHEME, FolderStorage())
    yield state
    publish.unregister_publisher(SCHEME)
    registry.unregister_backend(SCHEME)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish-seam")
    return make_family(root / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=5)


def catalog(path: Path, fam) -> Catalog:
    cat = Catalog(path)
    register(cat, "base", str(fam["base"]))
    register_many(cat, [(f"e{i}", str(e)) for i, e in enumerate(fam["experts"], start=1)], base_id="base")
    return cat


def folder_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in root.rglob("*") if p.is_file()}


def test_merge_to_a_registered_scheme_equals_local_and_manifest_is_last(seam, family, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", family)
    merge(cat, "base", ["e1", "e2"], tmp_path / "local", "linear", model_id="local", out_shard_bytes=SHARD_BYTES)
    out = tmp_path / "published" / "snap1"
    out.parent.mkdir()
    _, snap, manifest = merge(cat, "base", ["e1", "e2"], f"{SCHEME}://{out}/", "linear",
                              out_shard_bytes=SHARD_BYTES)
    published, local = folder_hashes(out), dir_hashes(tmp_path / "local")
    assert sorted(published) == sorted([*local, MANIFEST_NAME])  # no staging object left, nothing else
    same = {n for n in local if n != "README.md"}  # the README names the snapshot and its output
    assert sum(n.endswith(".safetensors") for n in same) >= 3
    assert {n: published[n] for n in same} == {n: local[n] for n in same}
    assert seam["log"][-1] == MANIFEST_NAME and seam["log"].count(MANIFEST_NAME) == 1
    staged = [n for n in seam["log"] if n.startswith(STAGING_PREFIX)]
    assert sorted(n.split("/", 1)[1] for n in staged) == sorted(local)  # every file staged before it moved
    assert manifest.run["out"] == f"{SCHEME}://{out}"
    assert cat.model("snap1")["uri"] == f"{SCHEME}://{out}"
    assert rows(tmp_path / "c.sqlite", "SELECT out FROM snapshots WHERE id = ?", [snap]) == [{"out": f"{SCHEME}://{out}"}]


@pytest.mark.parametrize("fail_at", ["stage", "publish"])
def test_a_failed_publish_is_aborted_and_leaves_nothing(seam, family, tmp_path, fail_at):
    db = tmp_path / "c.sqlite"
    catalog(db, family).close()
    before = dump_db(db)
    out = tmp_path / "snapfail"
    seam["fail_at"] = fail_at
    with closing(Catalog(db)) as cat, pytest.raises(StorageError, match="injected failure"):
        merge(cat, "base", ["e1", "e2"], f"{SCHEME}://{out}", "linear", out_shard_bytes=SHARD_BYTES)
    assert any(n.startswith(STAGING_PREFIX) for n in seam["log"])  # objects were staged, then removed
    assert MANIFEST_NAME not in seam["log"]
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]
    after = dump_db(db)
    kept = ("txns", "plans", "meta")  # as for any failed merge: the plan and an aborted txn row
    assert {k: v for k, v in after.items() if k not in kept} == {k: v for k, v in before.items() if k not in kept}
    assert [t[3] for t in after["txns"]] == ["aborted"] and after["txns"][0][2] == f"{SCHEME}://{out}"


def test_a_crashed_publish_is_recovered_through_the_publisher(seam, family, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", family)
    out = tmp_path / "snapcrash"
    txn = txn_module.RemoteTransaction(cat, f"{SCHEME}://{out}")
    staging = txn.begin()
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    (staging / "model-00002-of-00002.safetensors").write_bytes(b"y" * 100)
    txn.remote.stage(staging)
    txn_module.ACTIVE.discard(txn.id)  # as if its process had died mid-publish
    staged = sorted(f"{SCHEME}://{out}/{txn.remote.staging}/{n}" for n in
                    ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    (finding,) = txn_module.recovery_findings(cat)
    assert finding.startswith(f"transaction {txn.id} (staging, writing {SCHEME}://{out}) was never committed")
    assert all(f"remove {uri}" in finding for uri in staged)
    report = txn_module.recover(cat)
    assert report["rolled_back"] == [txn.id] and sorted(report["removed"]) == staged
    assert not [p for p in out.rglob("*") if p.is_file()]
    shutil.rmtree(txn.tmp)


@pytest.mark.parametrize("scheme", ["nowrite", SCHEME])
def test_a_scheme_without_a_publisher_is_read_only(seam, family, tmp_path, scheme):
    db = tmp_path / "c.sqlite"
    catalog(db, family).close()
    before = dump_db(db)
    if scheme == SCHEME:
        publish.unregister_publisher(SCHEME)  # readable through its backend, but no longer writable
    uri = f"{scheme}://{tmp_path}/out"
    with closing(Catalog(db)) as cat, pytest.raises(StorageError) as exc:
        merge(cat, "base", ["e1", "e2"], uri + "/", "linear")
    assert str(exc.value) == (f"{uri}: {scheme}:// is read-only for MergePipe; merge output goes to a local "
                              "directory or an s3:// prefix")
    assert dump_db(db) == before
    assert not (tmp_path / "out").exists()
