"""The Storage seam: every checkpoint byte the product reads goes through the Storage that opened it.

A second backend, ``counted://`` (local files under another scheme, counting every request), is
registered next to the local one; a catalog whose models live at ``counted://`` URIs registers,
analyzes and merges through it alone, and gives the same output as the same merge of local paths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged, register
from mergepipe.errors import CatalogError, StorageError
from mergepipe.research.family import make_family
from mergepipe.storage import registry
from mergepipe.storage.base import Storage
from mergepipe.storage.local import RangeReader, fingerprint
from mergepipe.storage.safetensors import open_checkpoint as parse_checkpoint

from merge_helpers import dir_hashes

SCHEME = "counted"
BLOCK = 16 << 10


class CountedStorage(Storage):
    """Local files addressed as ``counted:///abs/path``; counts readers, bytes and fingerprints."""

    def __init__(self):
        self.readers: list[RangeReader] = []
        self.opened: list[str] = []
        self.fingerprints = 0

    @staticmethod
    def path(uri) -> str:
        return os.fspath(uri)[len(SCHEME) + 3:]

    def open(self, uri):
        self.opened.append(os.fspath(uri))
        checkpoint = parse_checkpoint(self.path(uri))
        checkpoint.storage = self
        return checkpoint

    def size(self, checkpoint, fname):
        return os.stat(checkpoint.root / fname if checkpoint.root.is_dir() else checkpoint.root).st_size

    def reader(self, checkpoint, sequential=False):
        reader = RangeReader(checkpoint, sequential)
        self.readers.append(reader)
        return reader

    def fingerprint(self, checkpoint):
        self.fingerprints += 1
        return fingerprint(checkpoint)

    def stamp(self, uri):
        return None  # no cheap stamp: every re-check fingerprints through the backend

    def bytes_read(self, root: Path) -> int:
        return sum(r.bytes_read for r in self.readers if Path(r.checkpoint.root) == root)


@pytest.fixture()
def counted():
    storage = CountedStorage()
    registry.register_backend(SCHEME, storage)
    yield storage
    registry.unregister_backend(SCHEME)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("seam")
    return make_family(root / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=3)


def _catalog(path: Path, fam: dict, uri) -> Catalog:
    cat = Catalog(path)
    register(cat, "base", uri(fam["base"]))
    for i, e in enumerate(fam["experts"], start=1):
        register(cat, f"e{i}", uri(e), base_id="base")
    analyze(cat, block_bytes=BLOCK, densities=(0.5,))
    return cat


def counted_uri(p) -> str:
    return f"{SCHEME}://{Path(p).resolve()}"


@pytest.mark.parametrize("operator", ["ties", "task_arithmetic"])
def test_a_merge_reads_only_through_the_registered_storage(tmp_path, family, counted, operator):
    local = _catalog(tmp_path / "local.sqlite", family, str)
    remote = _catalog(tmp_path / "counted.sqlite", family, counted_uri)
    assert [m["uri"] for m in remote.query("SELECT uri FROM models ORDER BY id")] == \
        [counted_uri(p) for p in (family["base"], *family["experts"])]
    assert set(counted.opened) == {counted_uri(p) for p in (family["base"], *family["experts"])}
    analyzed = sum(r.bytes_read for r in counted.readers)
    assert analyzed > 0

    counted.readers.clear()
    settings = dict(budget="50%", density=0.5)
    plan_l, _, _ = merge(local, "base", ["e1", "e2"], tmp_path / "out-local", operator, **settings)
    plan_r, _, _ = merge(remote, "base", ["e1", "e2"], tmp_path / "out-counted", operator, **settings)

    assert plan_r["access"] == plan_l["access"]
    # the weights are identical; the model cards differ only in the inputs' URIs
    assert dir_hashes(tmp_path / "out-counted", "*.safetensors") == dir_hashes(tmp_path / "out-local", "*.safetensors")
    expert_read = sum(counted.bytes_read(Path(e).resolve()) for e in family["experts"])
    assert expert_read == plan_r["estimate"]["expert_read"]
    assert 0 < expert_read < plan_r["full_expert_bytes"]
    base_bytes = parse_checkpoint(family["base"]).nbytes
    assert counted.bytes_read(Path(family["base"]).resolve()) == base_bytes
    local.close()
    remote.close()


def test_unknown_scheme_is_one_clear_error(tmp_path):
    cat = Catalog(tmp_path / "c.sqlite")
    before = cat.query("SELECT count(*) AS n FROM models")[0]["n"]
    with pytest.raises(StorageError, match=r"^gs://bucket/model: no storage backend for gs:// \(local paths are "
                                           r"supported; remote backends: hf://, http://, https://, s3://\)$"):
        register(cat, "m", "gs://bucket/model")
    assert cat.query("SELECT count(*) AS n FROM models")[0]["n"] == before


def test_change_checks_go_through_the_backend(tmp_path, family, counted):
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", counted_uri(family["base"]))
    row = cat.model("base")
    assert row["file_stats"] is None  # this backend has no cheap stamp
    before = counted.fingerprints
    check_unchanged(row)
    assert counted.fingerprints == before + 1
    cat.conn.execute("UPDATE models SET fingerprint = 'sha256:old' WHERE id = 'base'")
    with pytest.raises(CatalogError, match="changed since registration"):
        check_unchanged(cat.model("base"))


def test_local_paths_and_file_uris_are_served_locally(tmp_path, family):
    base = Path(family["base"]).resolve()
    assert registry.storage_for(base) is registry.LOCAL
    assert registry.storage_for(f"file://{base}") is registry.LOCAL
    ck = registry.open_checkpoint(f"file://{base}")
    assert ck.storage is registry.LOCAL and ck.nbytes == parse_checkpoint(base).nbytes
    assert registry.canonical_uri(f"file://{base}/../base") == str(base)
    assert registry.canonical_uri("s3://b/k/") == "s3://b/k"
    with pytest.raises(StorageError, match="opened without a storage backend"):
        parse_checkpoint(base).reader()
