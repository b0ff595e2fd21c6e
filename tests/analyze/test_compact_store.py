"""Compact deltas in the catalog: stored records and error norms against an independent recomputation, the
catalog rows, re-analysis, re-registration and delete, doctor's checks, and crashes around the write (a crash
leaves no half compact: the old rows and file, or the new ones, plus at most a file the next prune removes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.catalog import compacts
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.errors import CatalogError
from mergepipe.research.family import make_family
from mergepipe.storage import compact as C

from merge_helpers import cli_cmd, load_dir

BLOCK = 8192


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfam")
    return make_family(root / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=32 << 10, seed=3)


def fresh(tmp_path, fam, compact="progressive", group=128) -> Catalog:
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", fam["base"])
    for i, e in enumerate(fam["experts"], start=1):
        register(cat, f"e{i}", e, base_id="base")
    if compact:
        analyze(cat, block_bytes=BLOCK, compact=compact, compact_group=group)
    return cat


def files(cat) -> list[str]:
    folder = compacts.compact_dir(cat)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("group", [32, 128])
def test_stored_records_and_errors_match_a_recomputation(tmp_path, fam, group):
    """Every stored record equals the numpy encoder's on the block's delta (expert - base in float32, from
    safetensors), its error norms equal ||d - decode(d)|| recomputed, and the catalog sizes the file."""
    cat = fresh(tmp_path, fam, group=group)
    base, expert = load_dir(Path(fam["base"])), load_dir(Path(fam["experts"][0]))
    row = compacts.compact_row(cat, "e1")
    assert (row["codec"], row["group_size"], row["block_bytes"]) == ("progressive", group, BLOCK)
    path = compacts.compact_dir(cat) / row["file"]
    data = path.read_bytes()
    assert len(data) == row["nbytes"] and data[:16] == C.MAGIC
    blocks = list(compacts.compact_blocks(cat, "e1"))
    assert len(blocks) == row["n_blocks"] > 5
    stats = {(r["tensor"], r["block"]): r for r in cat.blocks("e1")}
    for tensor, block, offset, n, e1, e2, e4 in blocks:
        s = stats[(tensor, block)]
        d = (expert[tensor].float() - base[tensor].float()).reshape(-1)[s["row_start"] * 0:].numpy()
        rows_per = base[tensor].shape[1] if base[tensor].dim() > 1 else 1
        d = d[s["row_start"] * rows_per:s["row_end"] * rows_per]
        assert n == d.size
        record, errors = C.encode(d, group, 4)
        assert data[offset:offset + len(record)] == record
        assert [e1, e2, e4] == pytest.approx(errors, rel=1e-9, abs=1e-30)
        # each level decodes from a prefix of the record, and its error is what the level leaves out
        for level, err in zip((1, 2, 4), (e1, e2, e4)):
            approx = C.decode(data[offset:offset + C.level_bytes(n, group, level)], n, group, level)
            assert float(np.linalg.norm(d.astype(np.float64) - approx)) == pytest.approx(err, rel=1e-9, abs=1e-30)
        assert e4 < s["delta_l2"] and e1 <= s["delta_l2"] * 1.0001
    assert row["expert_bytes"] == sum(r["nbytes"] for r in cat.blocks("e1"))


def test_codec_bytes_per_entry_and_decode_definition():
    rng = np.random.default_rng(0)
    d = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
    d[::7] = 0
    record, errs = C.encode(d, 64, 4)
    assert len(record) == C.level_bytes(1000, 64, 4) == 4 * 16 + 4 * 125
    one = C.decode(record, 1000, 64, 1)
    groups = np.abs(d[:64]).mean()
    assert one[1] == pytest.approx(np.sign(d[1]) * groups, rel=2 ** -8)  # bf16 of the group mean
    four = C.decode(record, 1000, 64, 4)
    a = np.abs(d[:64]).max()
    # half a step of a/8, plus 15/16 of the bf16 rounding of a (2^-8 of a)
    assert np.all(np.abs(four[:64] - d[:64]) <= a / 16 * (1 + 15 * 2 ** -8))
    two = C.decode(record, 1000, 64, 2)
    a16 = float(C.bf16_bits_to_f32(C.f32_to_bf16_bits(np.array([a], np.float32)))[0])
    assert {float(x) for x in np.unique(np.abs(two[:64]))} == {0.0, 0.75 * a16}  # ternary
    assert np.all((np.abs(two[:64]) > 0) == (np.abs(d[:64]) >= a16 / 2))
    assert errs[2] < errs[0]
    assert C.bits_per_entry(1, 128) == pytest.approx(1.125)


def test_analyze_settings_refused(tmp_path, fam):
    cat = fresh(tmp_path, fam, compact=None)
    with pytest.raises(CatalogError, match="unknown compact codec 'q3'"):
        analyze(cat, compact="q3")
    with pytest.raises(CatalogError, match="--compact-group must be a multiple of 8 in \\[16, 4096\\], not 100"):
        analyze(cat, compact="q4", compact_group=100)
    assert compacts.compact_rows(cat) == [] and files(cat) == []
    assert not cat.is_analyzed("e1")


def test_reanalysis_replaces_the_file_and_grid_change_drops_it(tmp_path, fam):
    cat = fresh(tmp_path, fam)
    before = files(cat)
    assert len(before) == 2
    # current: skipped, nothing rewritten
    assert all(r.skipped for r in analyze(cat, compact="progressive"))
    assert files(cat) == before
    # another codec: re-analyzed, old files pruned
    res = analyze(cat, compact="sign1")
    assert not any(r.skipped for r in res)
    after = files(cat)
    assert len(after) == 2 and not set(after) & set(before)
    assert {r["codec"] for r in compacts.compact_rows(cat)} == {"sign1"}
    # a new grid without --compact: the old compacts no longer fit and go
    analyze(cat, block_bytes=BLOCK * 2, force=True)
    assert compacts.compact_rows(cat) == [] and files(cat) == []


def test_reregistration_and_delete_remove_compacts(tmp_path, fam):
    import shutil
    cat = fresh(tmp_path, fam)
    moved = tmp_path / "e1-copy"
    shutil.copytree(fam["experts"][1], moved)  # e1 re-registered from other files
    register(cat, "e1", str(moved), base_id="base", replace=True)
    assert [r["model_id"] for r in compacts.compact_rows(cat)] == ["e2"]
    assert len(files(cat)) == 1
    # a merged model analyzed as an expert, then deleted: its compact goes with it
    from mergepipe.api import delete_snapshot, merge
    merge(cat, "base", ["e2"], str(tmp_path / "m"), operator="task_arithmetic", model_id="m")
    analyze(cat, ["m"], compact="q2")
    assert {r["model_id"] for r in compacts.compact_rows(cat)} == {"e2", "m"}
    assert len(files(cat)) == 2
    delete_snapshot(cat, "m")
    assert [r["model_id"] for r in compacts.compact_rows(cat)] == ["e2"]
    assert files(cat) == [compacts.compact_row(cat, "e2")["file"]]
    assert list(cat.conn.execute("SELECT COUNT(*) FROM compact_blocks WHERE model_id = 'm'")) == [(0,)]


def test_doctor_checks_compact_files(tmp_path, fam):
    from mergepipe.api import doctor
    cat = fresh(tmp_path, fam)
    db = cat.path
    assert doctor(db)["healthy"] and doctor(db)["checked"]["compacts"] == 2
    row = compacts.compact_row(cat, "e1")
    path = compacts.compact_dir(cat) / row["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    stray = compacts.compact_dir(cat) / "old-000000000000.mpc"
    stray.write_bytes(b"x")
    findings = doctor(db)["findings"]
    assert any("compact deltas of e1" in f and "sha256 differs" in f for f in findings)
    assert any(f"compact file {stray} is referenced by no catalog row" in f for f in findings)
    # the engine refuses a plan whose compact file changed size
    path.write_bytes(bytes(data[:-1]))
    from mergepipe.api import merge
    from mergepipe.errors import ExecutionError
    with pytest.raises(ExecutionError, match="has .* bytes, the catalog recorded"):
        merge(cat, "base", ["e1", "e2"], str(tmp_path / "x"), operator="task_arithmetic", budget="10%")
    assert not (tmp_path / "x").exists()


CHILD = textwrap.dedent("""
    import os, sys
    from mergepipe.catalog.db import Catalog
    from mergepipe.analyze import runner
    from mergepipe.catalog import compacts
    db, point, codec = sys.argv[1], sys.argv[2], sys.argv[3]
    real_replace = os.replace
    if point == "before-rename":
        def replace(src, dst):
            if str(dst).endswith(".mpc"):
                os._exit(9)
            return real_replace(src, dst)
        os.replace = replace
    elif point == "after-rename":
        def replace(src, dst):
            real_replace(src, dst)
            if str(dst).endswith(".mpc"):
                os._exit(9)
        os.replace = replace
    elif point == "after-commit":
        runner.compacts.prune_files = lambda catalog: os._exit(9)
    cat = Catalog(db, create=False)
    runner.analyze(cat, compact=codec, force=True)
    print("done")
""")


@pytest.mark.parametrize("point", ["before-rename", "after-rename", "after-commit"])
def test_crash_around_the_compact_write_leaves_no_half_compact(tmp_path, fam, point):
    """Kill ANALYZE --compact at each step of storing (the rows inserted but the file not yet renamed; renamed
    but not committed; committed but the old files not yet removed): the catalog holds either the old compacts
    with their files or the new ones, every referenced file matches its row, a merge reads them, and the next
    ANALYZE removes what the crash left."""
    from mergepipe.api import doctor, merge
    cat = fresh(tmp_path, fam, compact="q4")
    old = {r["model_id"]: r for r in compacts.compact_rows(cat)}
    cat.close()
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "c.sqlite"), point, "sign1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 9, res.stderr
    cat = Catalog(tmp_path / "c.sqlite")
    rows = {r["model_id"]: r for r in compacts.compact_rows(cat)}
    codecs = {r["codec"] for r in rows.values()}
    assert codecs == ({"sign1"} if point == "after-commit" else {"q4"})
    if point != "after-commit":
        assert rows == old
    report = doctor(cat.path)
    assert not [f for f in report["findings"] if "referenced by no catalog row" not in f], report
    for r in rows.values():  # every referenced file is whole
        assert (compacts.compact_dir(cat) / r["file"]).stat().st_size == r["nbytes"]
    _, _, manifest = merge(cat, "base", ["e1", "e2"], str(tmp_path / "m"), operator="task_arithmetic",
                           budget="10%")
    assert manifest.core["realized"]["compact_read"] > 0
    analyze(cat, ["e1"], compact=next(iter(codecs)))  # current: skipped, but the store's prune runs
    compacts.prune_files(cat)
    assert sorted(files(cat)) == sorted(r["file"] for r in rows.values())
    assert doctor(cat.path)["healthy"]


def test_cli_analyze_compact_reports_growth(tmp_path, fam):
    cat = fresh(tmp_path, fam, compact=None)
    cat.close()
    res = subprocess.run(cli_cmd() + ["--db", str(tmp_path / "c.sqlite"), "analyze",
                          "--block-bytes", str(BLOCK), "--compact", "q2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    cat = Catalog(tmp_path / "c.sqlite")
    stored, expert = compacts.growth(cat)
    pct = 100 * stored / expert
    assert f"compact deltas (q2, groups of 128): +{pct:.1f} % of expert bytes" in res.stdout
    res = subprocess.run(cli_cmd() + ["--db", str(tmp_path / "c.sqlite"), "--json", "analyze",
                          "--force", "--compact", "q5"], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and res.stderr.strip().splitlines() == [
        "error: unknown compact codec 'q5' (choose from sign1, q2, q4, progressive)"]
    assert json.dumps(compacts.compact_rows(cat)) == json.dumps(compacts.compact_rows(cat))


def test_a_v9_catalog_gets_the_compact_tables(tmp_path, fam):
    cat = fresh(tmp_path, fam, compact=None)
    analyze(cat, block_bytes=BLOCK)
    for table in ("compacts", "compact_blocks"):
        cat.conn.execute(f"DROP TABLE {table}")
    cat.conn.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    cat.close()
    cat = Catalog(tmp_path / "c.sqlite")
    assert cat.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == str(SCHEMA_VERSION)
    assert cat.is_analyzed("e1")  # statistics kept
    analyze(cat, compact="sign1")
    assert {r["codec"] for r in compacts.compact_rows(cat)} == {"sign1"}


def test_compiled_decoder_equals_the_definition():
    """The engine's compiled decoder gives the numpy decoder's float32 values (signed zeros included), at every
    level, for odd sizes and partial groups."""
    from mergepipe.analyze.compact import decode_block
    rng = np.random.default_rng(5)
    for n in (1, 7, 129, 1000, 4099):
        d = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        d[::5] = 0
        for group in (16, 128):
            record, _ = C.encode(d, group, 4)
            for level in (1, 2, 4):
                prefix = record[:C.level_bytes(n, group, level)]
                assert decode_block(prefix, n, group, level).tobytes() == C.decode(prefix, n, group, level).tobytes()
