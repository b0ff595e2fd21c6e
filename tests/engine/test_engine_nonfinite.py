"""A merge never publishes NaN/Inf (issue 14): an expert holding NaN/Inf is refused by a first merge as
its analysis on the way finds it, a merge whose outputs overflow their dtype (fp16: torch path; bf16 and
fp32: fused kernels) is refused naming the tensor, and each refusal publishes nothing, leaves no
staging directory and no statistics (the catalog's tables as before, but for the aborted txn's row and
the plan, which every failed merge records)."""

from __future__ import annotations

import numpy as np
import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.engine.engine import Engine
from mergepipe.errors import ExecutionError, PlanError
from mergepipe.ops import kernels
from mergepipe.planner.context import Planner

from merge_helpers import STAGING_MARK, dump_db, run_cli
from numeric_helpers import BLOCK, INF, NAN, TENSOR, block_of, plant, registered, small_family

# what a failed merge leaves behind on purpose: the aborted txn (audit) and the plan it executed
AUDIT = ("txns", "plans", "meta")


def assert_nothing_published(tmp_path, out, before, db):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if STAGING_MARK in p.name]
    after = dump_db(db)
    for table in before:
        if table not in AUDIT:
            assert after[table] == before[table], table


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_first_merge_refuses_an_expert_with_nonfinite_values(tmp_path, dtype):
    fam = small_family(tmp_path / "fam", dtype)
    plant(fam["experts"][1], TENSOR, {3: NAN, 4: INF})
    db = tmp_path / "c.sqlite"
    cat = registered(db, fam)  # not analyzed: the merge analyzes on the way
    before = dump_db(db)
    out = tmp_path / "outs" / "m"
    out.parent.mkdir()
    plan = Planner(cat).plan("base", ["e1", "e2"], "ties", density=0.3, save=False)
    assert all(e.get("analyze") for e in plan["experts"])
    with pytest.raises(ExecutionError) as exc:
        Engine(cat).execute(plan, out=out)
    b = block_of(fam["base"], TENSOR, 3)
    assert str(exc.value).startswith(f"expert 'e2' holds non-finite values (NaN/Inf): 2 NaN/Inf delta entries, "
                                     f"by tensor: {TENSOR}: 2 (block {b})")
    cat.close()
    assert_nothing_published(tmp_path, out, before, db)
    assert not dump_db(db)["analyses"] and not dump_db(db)["blocks"]


def test_cli_merge_of_an_analyzed_nonfinite_expert_is_refused_before_anything(tmp_path):
    fam = small_family(tmp_path / "fam", "bf16")
    plant(fam["experts"][0], TENSOR, {100: -INF})
    db = tmp_path / "c.sqlite"
    cat = registered(db, fam)
    analyze(cat, block_bytes=BLOCK)
    cat.close()
    before = dump_db(db)
    out = tmp_path / "m"
    r = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--out", out])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: expert 'e1' holds non-finite values"), r.stderr
    assert TENSOR in lines[0]
    assert not out.exists() and dump_db(db) == before  # refused by the planner: nothing written at all


@pytest.mark.parametrize("dtype, op, kw", [
    # fp16 (torch path): float32 results are finite, rounding them to fp16 (max 65504) gives Inf
    ("fp16", "task_arithmetic", {"lam": 1e7}),
    # bf16 / fp32 (fused kernels): the float32 arithmetic itself overflows
    ("bf16", "task_arithmetic", {"lam": 3e38, "weights": [1e3, 1e3]}),
    ("fp32", "linear", {"weights": [3e38, 3e38], "normalize": False}),
])
def test_overflowing_merge_is_refused_and_publishes_nothing(tmp_path, dtype, op, kw):
    fam = small_family(tmp_path / "fam", dtype)
    db = tmp_path / "c.sqlite"
    cat = registered(db, fam)
    analyze(cat, block_bytes=BLOCK)
    before = dump_db(db)
    out = tmp_path / "outs" / "m"
    out.parent.mkdir()
    with pytest.raises(ExecutionError) as exc:
        merge(cat, "base", ["e1", "e2"], out, operator=op, **kw)
    msg = str(exc.value)
    assert msg.startswith("the merge of tensor ") and "non-finite values" in msg, msg
    assert f"in {dtype}" in msg and "Inf" in msg and msg.endswith("nothing was published")
    if dtype == "fp16":
        assert "beyond the largest fp16 number (65504) overflow to Inf" in msg
    cat.close()
    assert_nothing_published(tmp_path, out, before, db)


def test_cli_overflow_is_one_error_line_exit_2(tmp_path):
    fam = small_family(tmp_path / "fam", "fp16")
    db = tmp_path / "c.sqlite"
    cat = registered(db, fam)
    analyze(cat, block_bytes=BLOCK)
    cat.close()
    before = dump_db(db)
    out = tmp_path / "outs" / "m"
    out.parent.mkdir()
    r = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "task_arithmetic",
                 "--lambda", "1e7", "--out", out])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the merge of tensor "), r.stderr
    assert_nothing_published(tmp_path, out, before, db)
    # a sane lambda on the same catalog publishes
    r = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "task_arithmetic",
                 "--lambda", "0.5", "--out", out])
    assert r.returncode == 0, r.stderr
    assert out.is_dir()


@pytest.mark.parametrize("dtype, bits, finite", [
    ("BF16", [0x3F80, 0x7F80, 0xFF80, 0x7FC0, 0x7F7F], [True, False, False, False, True]),
    ("F16", [0x3C00, 0x7C00, 0xFC00, 0x7E00, 0x7BFF], [True, False, False, False, True]),
    ("F32", [0x3F800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F7FFFFF], [True, False, False, False, True]),
])
def test_output_guard_counts_nan_and_inf_per_dtype(dtype, bits, finite):
    view = np.uint16 if dtype != "F32" else np.uint32
    raw = np.array(bits, dtype=view).tobytes()
    assert kernels.nonfinite_count(raw, dtype) == finite.count(False)
    nan, inf, _ = kernels.nonfinite_kinds(raw, dtype)
    assert (nan, inf) == (1, 2)
    assert kernels.nonfinite_count(b"\x00" * 8, "I64") == 0  # not a float: nothing to check


def test_fp16_rounding_overflow_is_seen_in_the_output_bytes():
    """65519 rounds to 65504 in fp16, 65520 to Inf: the guard reads the bytes after the rounding."""
    import torch
    ok = torch.tensor([65519.0, -65519.0]).to(torch.float16).numpy().tobytes()
    bad = torch.tensor([65520.0, 1.0]).to(torch.float16).numpy().tobytes()
    assert kernels.nonfinite_count(ok, "F16") == 0
    assert kernels.nonfinite_count(bad, "F16") == 1
