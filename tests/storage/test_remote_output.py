"""Merge output to an s3:// prefix, against moto's S3 in server mode on 127.0.0.1 (a free port).

Asserted: a merge to ``s3://bucket/prefix`` publishes objects bit-identical to the local-disk merge,
no staging object remains, the manifest object is the last object written (order of requests seen by a
loopback proxy in front of moto), the catalog records the remote URI; ``verify`` re-hashes the objects
by range reads and fails after tampering; the remote snapshot is usable as a merge input; a server that
answers 500 to the copies to the final keys (after some succeeded) or a missing bucket ends in one
``error:`` line, no manifest object, no leftover objects and an unchanged catalog; http:// output is refused.
Parallel publish (each PUT held 0.3 s by the proxy, a slow link): several staging uploads and several
copies are in flight at once, the manifest PUT still arrives after every copy was answered and is the last
write; a shard's upload starts while the merge still writes the last shard, and a merge that fails then
removes that object once its upload is done; a 500 on one of the parallel uploads removes the others'
objects (after they finish) and leaves the prefix empty and the catalog unchanged.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from mergepipe.api import merge, verify
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register, register_many
from mergepipe.research.family import make_family
from mergepipe.storage import registry

from merge_helpers import cli_cmd, dir_hashes, dump_db, rows, run_cli_proc
from remote_helpers import S3Proxy, moto_s3

MANIFEST = "mergepipe_manifest.json"
STAGING = ".mergepipe-staging-txn-"
SHARD_BYTES = 48 << 10  # output shards of the tiny family: five of them


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-out")
    fam = make_family(root / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=5)
    with moto_s3() as endpoint:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("out")
        registry._BACKENDS.pop("s3", None)
        yield {"fam": fam, "endpoint": endpoint}
        registry._BACKENDS.pop("s3", None)


def fs():
    import s3fs
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def objects(prefix: str) -> dict[str, str]:
    """sha256 of every object under ``prefix`` (downloaded whole), by name relative to it."""
    f = fs()
    return {p[len(prefix) + 1:]: "sha256:" + hashlib.sha256(f.cat_file(p)).hexdigest() for p in f.find(prefix)}


def catalog(path: Path, fam) -> Catalog:
    cat = Catalog(path)
    register(cat, "base", str(fam["base"]))
    register_many(cat, [(f"e{i}", str(e)) for i, e in enumerate(fam["experts"], start=1)], base_id="base")
    return cat


def test_merge_to_s3_equals_local_and_manifest_is_last(s3, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", s3["fam"])
    merge(cat, "base", ["e1", "e2"], tmp_path / "local", "linear", model_id="local")
    with S3Proxy(s3["endpoint"]) as proxy:
        _, snap, manifest = merge(cat, "base", ["e1", "e2"], "s3://out/snap1/", "linear")
    remote = objects("out/snap1")
    local = dir_hashes(tmp_path / "local")
    assert sorted(remote) == sorted([*local, MANIFEST])  # no staging object left, nothing else
    same = {n for n in local if n not in (MANIFEST, "README.md")}  # these name the snapshot and its output
    assert {n: remote[n] for n in same} == {n: local[n] for n in same}
    assert any(n.endswith(".safetensors") for n in same)
    writes = [(m, p.split("?")[0]) for m, p, _ in proxy.log if m in ("PUT", "POST")]
    put_paths = [p for m, p in writes if m == "PUT"]
    assert put_paths[-1] == f"/out/snap1/{MANIFEST}"
    assert sum(p.endswith(MANIFEST) for p in put_paths) == 1
    copies = [p for m, p, c in proxy.log if c]
    assert sorted(copies) == sorted(f"/out/snap1/{n}" for n in local)
    assert put_paths.index(f"/out/snap1/{MANIFEST}") > max(put_paths.index(c) for c in copies)
    assert manifest.run["out"] == "s3://out/snap1"
    assert cat.model("snap1")["uri"] == "s3://out/snap1"
    row = cat.conn.execute("SELECT out FROM snapshots WHERE id = ?", [snap]).fetchone()
    assert row[0] == "s3://out/snap1"
    res = verify(cat, snap)
    assert res["ok"], res["problems"]
    assert res["files_checked"] == len(local)


def test_verify_detects_a_tampered_object_and_a_missing_manifest(s3, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", s3["fam"])
    _, snap, manifest = merge(cat, "base", ["e1", "e2"], "s3://out/snap2", "linear")
    assert verify(cat, snap)["ok"]
    shard = sorted(n for n in manifest.core["outputs"] if n.endswith(".safetensors"))[0]
    f = fs()
    data = bytearray(f.cat_file(f"out/snap2/{shard}"))
    data[-1] ^= 0xFF
    f.pipe_file(f"out/snap2/{shard}", bytes(data))
    res = verify(cat, snap)
    assert not res["ok"]
    assert [p.split(":")[0] for p in res["problems"]] == [shard]
    assert res["problems"][0].startswith(f"{shard}: sha256 sha256:") and "!= manifest" in res["problems"][0]
    f.rm_file(f"out/snap2/{MANIFEST}")
    res = verify(cat, snap)
    assert f"{MANIFEST} is missing (the snapshot at s3://out/snap2 is not visible)" in res["problems"]


def test_remote_snapshot_is_a_merge_input(s3, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", s3["fam"])
    merge(cat, "base", ["e1", "e2"], "s3://out/snap3", "linear")
    merge(cat, "base", ["e1", "e2"], tmp_path / "loc3", "linear", model_id="loc3")
    merge(cat, "base", ["e1", "snap3"], tmp_path / "from-remote", "linear", model_id="r")
    merge(cat, "base", ["e1", "loc3"], tmp_path / "from-local", "linear", model_id="l")
    assert dir_hashes(tmp_path / "from-remote", "*.safetensors") == dir_hashes(tmp_path / "from-local", "*.safetensors")


def cli(db: Path, *args) -> subprocess.CompletedProcess:
    return run_cli_proc(["--db", db, *args], timeout=300)


def test_server_500_mid_upload_leaves_no_manifest_and_catalog_unchanged(s3, tmp_path):
    db = tmp_path / "c.sqlite"
    catalog(db, s3["fam"]).close()
    before = dump_db(db)
    with S3Proxy(s3["endpoint"]) as proxy:
        proxy.fail_copies_after = 2  # two objects reach their final keys, then the server fails
        r = cli(db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "linear", "--out", "s3://out/snap4")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: s3://out/snap4/") and "Traceback" not in r.stderr, r.stderr
    assert sum(c for _, _, c in proxy.log) >= 3  # the failure came after two copies succeeded
    assert objects("out/snap4") == {}
    assert not any(p.endswith(MANIFEST) and m == "PUT" for m, p, _ in proxy.log)
    after = dump_db(db)
    # as for a local merge that fails while executing: the plan and an aborted txn row are recorded,
    # nothing else (no model, snapshot, manifest, lineage)
    kept = ("txns", "plans", "meta")
    assert {k: v for k, v in after.items() if k not in kept} == {k: v for k, v in before.items() if k not in kept}
    assert before["txns"] == [] and len(after["plans"]) == 1
    assert [t[3] for t in after["txns"]] == ["aborted"] and after["txns"][0][2] == "s3://out/snap4"


def test_missing_bucket_and_http_output_are_refused(s3, tmp_path):
    db = tmp_path / "c.sqlite"
    catalog(db, s3["fam"]).close()
    before = dump_db(db)
    r = cli(db, "merge", "--base", "base", "--experts", "e1", "e2", "--out", "s3://nobucket/x")
    assert r.returncode != 0
    assert r.stderr.strip() == "error: s3://nobucket/x: the bucket 'nobucket' does not exist"
    r = cli(db, "merge", "--base", "base", "--experts", "e1", "e2", "--out", "http://127.0.0.1:1/x")
    assert r.stderr.strip() == ("error: http://127.0.0.1:1/x: http:// is read-only for MergePipe; merge output "
                                "goes to a local directory or an s3:// prefix")
    assert dump_db(db) == before
    assert not fs().exists("nobucket")


def test_killed_mid_upload_is_invisible_and_recover_removes_it(s3, tmp_path):
    db = tmp_path / "c.sqlite"
    catalog(db, s3["fam"]).close()
    with S3Proxy(s3["endpoint"]) as proxy:
        proxy.hold_copies_after = 2  # the process dies while copying the third object to its final key
        proc = subprocess.Popen(cli_cmd() + ["--db", str(db), "merge", "--base", "base", "--experts", "e1", "e2",
                                             "--out", "s3://out/snap5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proxy.held.wait(240)
        during = sorted(objects("out/snap5"))
        proc.kill()
        proc.communicate(timeout=60)
    staged = [n for n in during if n.startswith(".mergepipe-staging-txn-")]
    final = [n for n in during if n not in staged]
    assert len(final) == 2 and MANIFEST not in final and staged  # a reader finds no manifest: no snapshot
    txn = rows(db, "SELECT id, status FROM txns")
    assert [t["status"] for t in txn] == ["renamed"]
    assert rows(db, "SELECT * FROM snapshots") == []
    doctor = run_cli_proc(["--db", db, "doctor", "--json"])
    assert (f"transaction {txn[0]['id']} (renamed, writing s3://out/snap5) was never committed: `mergepipe "
            f"recover` rolls it back (remove s3://out/snap5/{during[0]}") in doctor.stdout, doctor.stdout
    res = run_cli_proc(["--db", db, "recover", "--json"])
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["rolled_back"] == [txn[0]["id"]]
    assert sorted(report["removed"]) == sorted(f"s3://out/snap5/{n}" for n in during)
    assert objects("out/snap5") == {}
    assert rows(db, "SELECT status FROM txns") == [{"status": "rolled_back"}]


def test_cli_merge_to_s3_then_verify(s3, tmp_path):
    db = tmp_path / "c.sqlite"
    catalog(db, s3["fam"]).close()
    r = cli(db, "merge", "--base", "base", "--experts", "e1", "e2", "--out", "s3://out/snap6", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["out"] == "s3://out/snap6"
    r = cli(db, "verify", "snap6", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["ok"] and res["out"] == "s3://out/snap6"
    assert res["files_checked"] == len(objects("out/snap6")) - 1
    fs().pipe_file("out/snap6/config.json", b"{}")
    r = cli(db, "verify", "snap6", "--json")
    assert r.returncode == 1 and [p.split(":")[0] for p in json.loads(r.stdout)["problems"]] == ["config.json"]


def max_in_flight(spans) -> int:
    """The most requests of ``spans`` ((method, path, arrival, answer)) in flight at one instant."""
    events = sorted([(start, 1) for _, _, start, _ in spans] + [(end, -1) for _, _, _, end in spans],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def staging_puts(proxy, prefix: str) -> list[tuple]:
    return [s for s in proxy.spans if s[0] == "PUT" and s[1].startswith(f"/{prefix}/{STAGING}")]


def test_parallel_uploads_and_copies_overlap_and_the_manifest_comes_after_every_copy(s3, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", s3["fam"])
    merge(cat, "base", ["e1", "e2"], tmp_path / "local", "linear", model_id="local", out_shard_bytes=SHARD_BYTES)
    with S3Proxy(s3["endpoint"]) as proxy:
        proxy.put_delay = 0.3
        merge(cat, "base", ["e1", "e2"], "s3://out/par1", "linear", out_shard_bytes=SHARD_BYTES)
    local = dir_hashes(tmp_path / "local")
    assert sum(n.endswith(".safetensors") for n in local) == 5
    remote = objects("out/par1")
    assert sorted(remote) == sorted([*local, MANIFEST])
    same = {n for n in local if n != "README.md"}  # the card names the snapshot
    assert {n: remote[n] for n in same} == {n: local[n] for n in same}
    uploads = staging_puts(proxy, "out/par1")
    copies = [s for s in proxy.spans if s[0] == "PUT" and s[1].split("?")[0] in
              {f"/out/par1/{n}" for n in local}]
    assert len(uploads) == len(local) and len(copies) == len(local)
    assert max_in_flight(uploads) >= 2 and max_in_flight(copies) >= 2
    manifest = [s for s in proxy.spans if s[1].split("?")[0] == f"/out/par1/{MANIFEST}"]
    assert [m[0] for m in manifest] == ["PUT"]
    assert manifest[0][2] > max(end for *_, end in copies)  # sent once every copy was answered
    writes = [(m, p.split("?")[0]) for m, p, _ in proxy.log if m in ("PUT", "POST")]
    assert writes[-1] == ("PUT", f"/out/par1/{MANIFEST}")


def test_a_shard_upload_starts_while_the_merge_writes_the_last_shard(s3, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", s3["fam"])
    first = "model-00001-of-00005.safetensors"
    seen = []

    def arrived() -> bool:  # the proxy logs a request as it arrives
        return any(m == "PUT" and STAGING in p and p.endswith(f"/{first}") for m, p, _ in proxy.log)

    def progress(done, total, _):
        if done == total:  # the last block is written: wait (up to 60 s) for shard 1's upload to arrive
            deadline = time.monotonic() + 60
            while not arrived() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen.append(arrived())

    with S3Proxy(s3["endpoint"]) as proxy:
        merge(cat, "base", ["e1", "e2"], "s3://out/early", "linear", out_shard_bytes=SHARD_BYTES, progress=progress)
    assert seen == [True]  # arrived while the merge was held before finishing its files
    order = [p.rsplit("/", 1)[1] for m, p, _ in proxy.log if m == "PUT" and STAGING in p]
    assert order.index(first) < order.index("model.safetensors.index.json")
    assert first in objects("out/early")


def test_a_merge_failing_after_a_shard_was_uploaded_removes_it(s3, tmp_path):
    cat = catalog(tmp_path / "c.sqlite", s3["fam"])
    first = "model-00001-of-00005.safetensors"

    def arrived() -> bool:
        return any(m == "PUT" and STAGING in p and p.endswith(f"/{first}") for m, p, _ in proxy.log)

    def progress(done, total, _):
        if done == total:
            deadline = time.monotonic() + 60
            while not arrived() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("the merge fails after its first shard's upload started")

    with S3Proxy(s3["endpoint"]) as proxy:
        proxy.put_delay = 0.5  # the upload is still in flight when the merge fails
        with pytest.raises(RuntimeError, match="first shard's upload started"):
            merge(cat, "base", ["e1", "e2"], "s3://out/fails", "linear", out_shard_bytes=SHARD_BYTES,
                  progress=progress)
    assert arrived()
    uploaded = {p.split("?")[0] for m, p, _ in proxy.log if m == "PUT" and STAGING in p}
    deleted = {p.split("?")[0] for m, p, _ in proxy.log if m == "DELETE"}
    assert any(p.endswith(f"/{first}") for p in uploaded) and uploaded <= deleted
    assert objects("out/fails") == {}
    assert cat.conn.execute("SELECT count(*) FROM snapshots").fetchone()[0] == 0
    assert [r[0] for r in cat.conn.execute("SELECT status FROM txns")] == ["aborted"]


def test_500_on_one_parallel_upload_removes_every_object_and_keeps_the_catalog(s3, tmp_path):
    db = tmp_path / "c.sqlite"
    catalog(db, s3["fam"]).close()
    before = dump_db(db)
    with S3Proxy(s3["endpoint"]) as proxy:
        proxy.put_delay = 0.3
        proxy.fail_puts_matching = "/model-00002-of-00005.safetensors"
        r = cli(db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "linear", "--out", "s3://out/snap7",
                "--out-shard-size", str(SHARD_BYTES))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"error: s3://out/snap7/{STAGING}") and "model-00002-of-00005" in lines[0], lines[0]
    assert objects("out/snap7") == {}
    uploads = staging_puts(proxy, "out/snap7")
    assert max_in_flight(uploads) >= 2
    sent = {p.split("?")[0] for _, p, _, _ in uploads if "model-00002-of" not in p}
    assert sent  # other uploads were in flight or done; each of them was removed
    deleted = {p.split("?")[0] for m, p, _ in proxy.log if m == "DELETE"}
    assert sent <= deleted
    assert not any(p.endswith(MANIFEST) for _, p, _, _ in proxy.spans)
    assert not any(c for _, _, c in proxy.log)  # nothing reached a final key
    after = dump_db(db)
    kept = ("txns", "plans", "meta")
    assert {k: v for k, v in after.items() if k not in kept} == {k: v for k, v in before.items() if k not in kept}
    assert [t[3] for t in after["txns"]] == ["aborted"] and after["txns"][0][2] == "s3://out/snap7"
