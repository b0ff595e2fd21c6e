"""ANALYZE of an expert holding NaN, with small blocks (issue 28): enough NaN entries in one tensor that a
top-k threshold (default densities) is itself NaN. Through the real CLI: `analyze --block-bytes 4096`
succeeds (it crashed in the exact-k cuts with IndexError), the non-finite counts are stored per block
and per tensor, and `plan` refuses the expert with the planner's message (one `error:` line, exit 2)."""

from __future__ import annotations

import sqlite3

import pytest

from merge_helpers import run_cli_proc
from numeric_helpers import BLOCK, NAN, TENSOR, block_of, plant, small_family

# One NaN every 97 entries of an 8192-entry tensor: 85 NaN, more than the top 1% (k = 81), so the
# threshold of density 0.01 is NaN; they fall in every 4 KiB block of the tensor.
PLANTED = {i: NAN for i in range(0, 8192, 97)}


def _rows(db, sql, params=()):
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_analyze_nan_small_blocks_counts_and_planner_refuses(tmp_path, dtype):
    fam = small_family(tmp_path / "fam", dtype)
    plant(fam["experts"][0], TENSOR, PLANTED)
    db = tmp_path / "c.sqlite"
    for args in (["--model-id", "base", "--uri", fam["base"]],
                 ["--model-id", "e1", "--uri", fam["experts"][0], "--base", "base"],
                 ["--model-id", "e2", "--uri", fam["experts"][1], "--base", "base"]):
        r = run_cli_proc(["register", "--db", db, *args])
        assert r.returncode == 0, r.stderr

    r = run_cli_proc(["analyze", "--db", db, "--block-bytes", BLOCK])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "IndexError" not in r.stderr, r.stderr

    # counted exactly: per block and per tensor
    expected: dict[int, int] = {}
    for i in PLANTED:
        b = block_of(fam["base"], TENSOR, i)
        expected[b] = expected.get(b, 0) + 1
    assert len(expected) > 1
    got = dict(_rows(db, "SELECT block, nonfinite FROM blocks WHERE model_id = 'e1' AND tensor = ? AND nonfinite > 0",
                     [TENSOR]))
    assert got == expected
    assert _rows(db, "SELECT tensor, nonfinite, base_nonfinite FROM tensor_stats "
                     "WHERE model_id = 'e1' AND nonfinite > 0") == [(TENSOR, len(PLANTED), 0)]
    assert _rows(db, "SELECT SUM(nonfinite) FROM blocks WHERE model_id = 'e2'") == [(0,)]

    # the planner refuses the expert with its message; the healthy expert alone plans
    r = run_cli_proc(["plan", "--db", db, "--base", "base", "--experts", "e1", "e2", "--op", "ties",
                      "--density", "0.3"])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: expert 'e1' holds non-finite values (NaN/Inf): {len(PLANTED)} NaN/Inf delta entries"), r.stderr
    assert f"{TENSOR}: {len(PLANTED)} (blocks " in lines[0] and "refused" in lines[0]
    r = run_cli_proc(["plan", "--db", db, "--base", "base", "--experts", "e2", "--op", "ties", "--density", "0.3"])
    assert r.returncode == 0, r.stderr
