"""Remote checkpoints on S3: moto's S3 in server mode on 127.0.0.1 (a free port), s3fs pointed at it
through AWS_ENDPOINT_URL and dummy credentials (tests/remote_helpers.py).

Asserted: registering an ``s3://bucket/prefix`` transfers exactly the headers, the shard index and
config.json; ANALYZE and a 10 % merge read through exact ranges (the transfer is the plan's bytes plus
8-byte change probes and the output's small side files) and the output equals the local-disk merge bit
for bit; the fingerprint is built from the objects' ETags; an object overwritten during a merge (after the
merge checked its inputs, before it read the object's blocks) is caught by the conditional read (If-Match
the opened ETag): one ``error:`` line, nothing published, the catalog's models and snapshots unchanged.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family
from mergepipe.storage import registry
from mergepipe.storage.safetensors import INDEX_NAME

from merge_helpers import dir_hashes, dump_db, run_cli
from remote_helpers import S3Proxy, family_catalog, moto_s3, upload_tree

BLOCK = 16 << 10
SIDE = ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json")


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-s3")
    fam = make_family(root / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=9)
    with moto_s3() as endpoint:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("models")
        upload_tree(root / "fam", "models/fam")
        registry._BACKENDS.pop("s3", None)
        yield dict(fam, endpoint=endpoint)
        registry._BACKENDS.pop("s3", None)


def s3_uri(p) -> str:
    return f"s3://models/fam/{Path(p).name}"


def registration_bytes(folder) -> int:
    shards = sorted(Path(folder).glob("*.safetensors"))
    return (sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in shards)
            + sum((Path(folder) / n).stat().st_size for n in (INDEX_NAME, "config.json")))


def catalog(path: Path, fam, uri) -> Catalog:
    return family_catalog(path, fam, uri, BLOCK)


def test_register_from_s3_transfers_headers_index_and_config_only(bucket, tmp_path):
    stats = registry.storage_for("s3://models").stats
    before = stats.snapshot()["bytes"]
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", "s3://models/fam/base/")
    assert stats.snapshot()["bytes"] - before == registration_bytes(bucket["base"])
    row = cat.model("base")
    assert row["uri"] == "s3://models/fam/base"
    ck = registry.open_checkpoint("s3://models/fam/base")
    assert ck.fingerprint() == row["fingerprint"]
    assert all(etag and etag.startswith('"') for etag in ck.remote["etags"].values())
    assert ck.tensors == registry.open_checkpoint(bucket["base"]).tensors  # same layout as the local files


def test_s3_merge_reads_the_plan_and_equals_the_local_merge(bucket, tmp_path):
    local = catalog(tmp_path / "local.sqlite", bucket, str)
    remote = catalog(tmp_path / "s3.sqlite", bucket, s3_uri)
    plan_l, _, _ = merge(local, "base", ["e1", "e2"], tmp_path / "out-local", "ties", budget="10%", density=0.5)
    stats = registry.storage_for("s3://models").stats
    before = stats.snapshot()["bytes"]
    plan_r, _, _ = merge(remote, "base", ["e1", "e2"], tmp_path / "out-s3", "ties", budget="10%", density=0.5)
    moved = stats.snapshot()["bytes"] - before
    assert plan_r["access"] == plan_l["access"]
    assert dir_hashes(tmp_path / "out-s3", "*.safetensors") == dir_hashes(tmp_path / "out-local", "*.safetensors")
    est = plan_r["estimate"]
    side = sum((Path(bucket["base"]) / n).stat().st_size for n in SIDE)
    n_shards = sum(len(list(Path(p).glob("*.safetensors"))) for p in (bucket["base"], *bucket["experts"]))
    assert est["expert_read"] <= 0.11 * plan_r["full_expert_bytes"]
    assert est["base_read"] + est["expert_read"] <= moved  # config.json: cached by ETag since registration
    assert moved <= est["base_read"] + est["expert_read"] * 1.01 + side + 8 * 8 * n_shards
    for name in SIDE:
        assert (tmp_path / "out-s3" / name).read_bytes() == (Path(bucket["base"]) / name).read_bytes()


def test_an_object_overwritten_during_the_merge_is_one_error(bucket, tmp_path):
    import s3fs

    db = tmp_path / "s3.sqlite"
    catalog(db, bucket, s3_uri).close()
    before = dump_db(db)
    expert = Path(bucket["experts"][1])
    prefix = f"models/fam/{expert.name}/"
    shards = {f.name: f.read_bytes() for f in expert.glob("*.safetensors")}
    starts = {n: 8 + int.from_bytes(b[:8], "little") for n, b in shards.items()}
    direct = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": bucket["endpoint"]})
    overwritten, lock = [], threading.Lock()

    def overwrite_once(path: str, rng: str) -> None:
        """Before the first read of one of the expert's tensors: the same header and size, other values."""
        name = path.rsplit("/", 1)[-1]
        with lock:  # the proxy serves requests on several threads
            if overwritten or prefix not in path or name not in shards:
                return
            if int(rng.split("=")[1].split("-")[0]) >= starts[name]:
                raw = shards[name]
                direct.pipe_file(prefix + name, raw[:starts[name]] + bytes(b ^ 0xFF for b in raw[starts[name]:]))
                overwritten.append(name)

    try:
        with S3Proxy(bucket["endpoint"]) as proxy:
            proxy.before_range_get = overwrite_once
            registry._BACKENDS.pop("s3", None)  # a backend whose clients go through the proxy
            res = run_cli(["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--op", "ties",
                           "--density", "0.5", "--budget", "10%", "--out", tmp_path / "out"])
    finally:
        for name in overwritten:
            direct.pipe_file(prefix + name, shards[name])  # the same bytes give the same ETag back
        registry._BACKENDS.pop("s3", None)
    assert overwritten, "the merge never read the expert's data through the proxy"
    assert res.returncode != 0
    key = prefix + overwritten[0]
    assert res.stderr == (f"error: s3://{key}: the object changed since it was opened (its ETag is no longer "
                          f"{registry.open_checkpoint(s3_uri(expert)).remote['etags'][overwritten[0]]}); "
                          "re-register the model\n")
    assert not (tmp_path / "out").exists()
    after = dump_db(db)
    assert after["models"] == before["models"] and after.get("snapshots") == before.get("snapshots")


def test_bin_checkpoints_on_s3_have_the_local_layout_and_bytes(bucket, tmp_path):
    from test_bin_checkpoints import to_bin

    local = to_bin(Path(bucket["experts"][0]), tmp_path / "bin_e1", 2)
    upload_tree(local, "models/bin/e1")
    registry._BACKENDS.pop("s3", None)
    ck = registry.open_checkpoint("s3://models/bin/e1")
    ref = registry.open_checkpoint(local)
    assert ck.tensors == ref.tensors and ck.file_sizes == ref.file_sizes
    name = max(ref.tensors, key=lambda n: ref.tensors[n].nbytes)
    t = ref.tensors[name]
    with ck.reader() as r:
        data = bytes(r.read(t.file, t.offset, t.nbytes))
    assert data == (local / t.file).read_bytes()[t.offset:t.offset + t.nbytes]
