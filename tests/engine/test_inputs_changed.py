"""Inputs stay what was planned: an input rewritten while a merge reads it is not published; inputs
registered with a content hash are re-hashed by the merge; ``verify`` checks the inputs too; ANALYZE
stores statistics only if the grid and fingerprints they were computed from are still current."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mergepipe.analyze import runner
from mergepipe.api import merge, verify
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.errors import CatalogError, ExecutionError
from mergepipe.research.family import make_family
from mergepipe.storage.safetensors import open_checkpoint

from merge_helpers import STAGING_MARK, dump_db, run_cli

KEPT = ("models", "analyses", "blocks", "tensor_stats", "grids", "snapshots", "manifests", "lineage")


@pytest.fixture()
def fam(tmp_path):
    paths = make_family(tmp_path / "fam", experts=2, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=11)
    db = tmp_path / "c.sqlite"
    cat = Catalog(db)
    register(cat, "base", paths["base"])
    register(cat, "e1", paths["experts"][0], base_id="base", with_content_hash=False)
    register(cat, "e2", paths["experts"][1], base_id="base")
    runner.analyze(cat, block_bytes=4096, densities=(0.5,))
    return {"cat": cat, "db": db, "root": tmp_path, **paths}


def flip_last_tensor_byte(ckpt_dir, keep_times: bool = False) -> None:
    """Rewrite one byte of tensor data in place (same size); optionally keep the file's times."""
    f = sorted(Path(ckpt_dir).glob("*.safetensors"))[-1]
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x40]))
    if keep_times:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_expert_rewritten_during_the_merge_is_not_published(fam):
    cat, out = fam["cat"], fam["root"] / "merged"
    before = dump_db(fam["db"])
    calls = []

    def rewrite_on_first_block(done, total, nbytes):
        if not calls:
            flip_last_tensor_byte(fam["experts"][1])
        calls.append(done)

    with pytest.raises(ExecutionError) as err:
        merge(cat, "base", ["e1", "e2"], out, "ties", density=0.5, budget="100%", progress=rewrite_on_first_block)
    assert str(err.value) == (f"e2 ({Path(fam['experts'][1]).resolve()}) changed: its files were rewritten while the "
                              f"merge ran; nothing was published (merge again)")
    assert calls and not out.exists() and not [p for p in fam["root"].iterdir() if STAGING_MARK in p.name]
    after = dump_db(fam["db"])
    for table in KEPT:
        assert after[table] == before[table], table


def test_verify_checks_the_inputs(fam):
    cat, out = fam["cat"], fam["root"] / "merged"
    _, snap, _ = merge(cat, "base", ["e1", "e2"], out, "task_arithmetic", budget="50%")
    res = verify(cat, snap)
    assert res["ok"] and res["inputs_checked"] == 3 and res["files_checked"] >= 1
    flip_last_tensor_byte(fam["experts"][0])
    res = verify(cat, snap)
    assert not res["ok"]
    assert res["problems"] == [f"input e1 ({Path(fam['experts'][0]).resolve()}) changed: its files were rewritten "
                               f"since the merge (the snapshot cannot be reproduced from it)"]
    assert verify(cat, snap, check_inputs=False)["ok"]
    cli = run_cli(["--db", fam["db"], "verify", snap])
    assert cli.returncode == 1 and cli.stderr.startswith("error: ") and "input e1" in cli.stderr
    cli = run_cli(["--db", fam["db"], "verify", snap, "--outputs-only"])
    assert cli.returncode == 0 and cli.stdout.startswith(f"OK {snap} (")


def test_content_hashes_registered_are_checked_by_the_merge(fam):
    cat = fam["cat"]
    res = register(cat, "e1", fam["experts"][0], base_id="base", with_content_hash=True)
    # the hash is added to the unchanged registration; its statistics stay
    assert res["status"] == "unchanged" and cat.model("e1")["content_hash"].startswith("sha256:")
    assert cat.is_analyzed("e1")
    _, snap, manifest = merge(cat, "base", ["e1", "e2"], fam["root"] / "m1", "linear", budget="10%")
    size = sum(f.stat().st_size for f in Path(fam["experts"][0]).glob("*.safetensors"))
    assert manifest.core["content_verified"] == {"e1": {"bytes_hashed": size}}
    # rewritten with its times kept: sizes, mtimes and headers are as registered, only the hash knows
    flip_last_tensor_byte(fam["experts"][0], keep_times=True)
    before = dump_db(fam["db"])
    with pytest.raises(CatalogError, match=r"the content of 'e1' \(.*\) no longer matches the hash registered "
                                           r"with --content-hash; re-register it with --replace"):
        merge(cat, "base", ["e1", "e2"], fam["root"] / "m2", "linear", budget="10%")
    assert not (fam["root"] / "m2").exists()
    after = dump_db(fam["db"])
    for table in KEPT:
        assert after[table] == before[table], table


def _racing_analyze(monkeypatch, fam, other):
    """Run ``other(catalog)`` on a second connection while the next ANALYZE computes its statistics."""
    real = runner.run_analyses

    def run_then_race(jobs, progress=None):
        real(jobs, progress)
        monkeypatch.setattr(runner, "run_analyses", real)
        second = Catalog(fam["db"])
        try:
            other(second)
        finally:
            second.close()

    monkeypatch.setattr(runner, "run_analyses", run_then_race)


def test_concurrent_analyze_with_another_grid_stores_nothing(fam, monkeypatch):
    cat = fam["cat"]
    _racing_analyze(monkeypatch, fam, lambda c: runner.analyze(c, block_bytes=16384, densities=(0.5,), force=True))
    with pytest.raises(CatalogError, match=r"the block grid of base changed to 16384 bytes while e1 was being "
                                           r"analyzed with 8192-byte blocks \(another analyze stored it\); nothing "
                                           r"was stored \(run analyze again\)"):
        runner.analyze(cat, block_bytes=8192, densities=(0.5,), force=True)
    # the run that stored first is intact: every expert analyzed on its grid
    assert cat.grid_block_bytes("base") == 16384
    assert all(cat.is_analyzed(e) and cat.analysis(e)["block_bytes"] == 16384 for e in ("e1", "e2"))
    cli = run_cli(["--db", fam["db"], "analyze", "--block-bytes", "16384"])
    assert cli.returncode == 0


def test_analyze_of_a_model_re_registered_meanwhile_stores_nothing(fam, monkeypatch):
    cat = fam["cat"]
    before = dump_db(fam["db"])

    def re_register(c):
        with c.transaction():
            c.conn.execute("UPDATE models SET fingerprint = 'sha256:other' WHERE id = 'e2'")

    _racing_analyze(monkeypatch, fam, re_register)
    with pytest.raises(CatalogError, match="e2 was re-registered or removed while e2 was being analyzed; "
                                           "nothing was stored"):
        runner.analyze(cat, block_bytes=8192, densities=(0.5,), force=True)
    after = dump_db(fam["db"])
    for table in ("analyses", "blocks", "tensor_stats", "grids"):
        assert after[table] == before[table], table
