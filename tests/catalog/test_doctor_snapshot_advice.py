"""`doctor` on a published snapshot whose files were tampered with: the advice is `verify`, then `delete` and
merge again (or restore the files), never "re-register it with --replace" (that would accept the corrupted
output as the snapshot). A plain registered model keeps its --replace advice."""

from __future__ import annotations

import shutil
from pathlib import Path

from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog

from doctor_helpers import doctor_family, make_catalog
from merge_helpers import run_cli


def test_a_tampered_snapshot_is_verified_and_deleted_not_replaced(tmp_path_factory, tmp_path):
    family = doctor_family(tmp_path_factory)
    db = make_catalog(family, tmp_path, copy_models=True)
    cat = Catalog(db)
    try:
        analyze(cat, block_bytes=16 << 10, densities=(0.5,))
        api.merge(cat, "base", ["e1", "e2"], tmp_path / "out", "ties", budget="100%", density=0.5,
                  model_id="merged")
        snap = cat.conn.execute("SELECT snapshot_id FROM models WHERE id = 'merged'").fetchone()[0]
    finally:
        cat.close()
    assert snap and api.doctor(db)["healthy"]

    shard = sorted((tmp_path / "out").glob("*.safetensors"))[0]
    with open(shard, "ab") as fh:  # tampered: one byte more (size and mtime change, so doctor looks)
        fh.write(b"\x01")
    e1 = sorted((tmp_path / "models" / family[1][0].name).glob("*.safetensors"))[0]
    with open(e1, "ab") as fh:  # a plain registered model changed too: its advice stays --replace
        fh.write(b"\x01")

    report = api.doctor(db)
    assert not report["healthy"]
    by_model = {f.split(":", 1)[0]: f for f in report["findings"]}
    finding = by_model["model merged"]
    assert "\n" not in finding
    assert "--replace" not in finding, finding
    assert f"mergepipe verify --db {db} merged" in finding and f"mergepipe delete --db {db} merged" in finding
    assert "merge again" in finding and "restore" in finding and snap in finding
    assert "--replace" in by_model["model e1"]

    res = run_cli(["doctor", "--db", db])  # the CLI prints the same advice
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert f"mergepipe verify --db {db} merged" in out and "re-register it with --replace" in out  # (e1's)
    assert out.count("--replace") == 1, out

    # the advice is runnable: verify names the tampered file, delete removes the snapshot, doctor is clean
    # but for e1
    res = run_cli(["verify", "--db", db, "merged"])
    assert res.returncode != 0
    res = run_cli(["delete", "--db", db, "merged"])
    assert res.returncode == 0, res.stderr
    assert [f.split(":", 1)[0] for f in api.doctor(db)["findings"]] == ["model e1"]
    shutil.rmtree(tmp_path / "models", ignore_errors=True)
