"""A new user's friction (issue 28), through the real command line: an expert registered against the wrong
base is refused in one short line that says how the two models differ (every difference with --verbose);
`models`/`snapshots` at 80 columns keep every id whole on one line (--wide shows every column); `explain`
gives a snapshot's realized bytes in binary units; `plan --help` says what a target bound is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import dump_catalog_file
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.cli.app import main
from mergepipe.research.family import make_family
from mergepipe.units import human_bytes

from merge_helpers import run_cli_proc


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# --- registering an expert against the wrong base ---------------------------------------------------------
def layout(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor, read with the safetensors library."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                s = fh.get_slice(name)
                out[name] = (s.get_dtype(), list(s.get_shape()))
    return out


@pytest.fixture(scope="module")
def wrong_base(tmp_path_factory):
    """A catalog holding a 2-layer, vocab-256 fp32 base; an expert of a 4-layer, vocab-4096 bf16 model."""
    root = tmp_path_factory.mktemp("wrong-base")
    base = make_family(root / "tiny", experts=1, size="tiny", dtype="fp32")["base"]
    expert = make_family(root / "small", experts=1, size="small", dtype="bf16")["experts"][0]
    db = root / "cat.sqlite"
    cat = Catalog(db)
    register(cat, "base", str(base))
    cat.close()
    return db, Path(base), Path(expert)


def expected_problems(base: Path, expert: Path) -> list[str]:
    b, e = layout(base), layout(expert)
    extra = [f"extra tensor {n}" for n in sorted(set(e) - set(b))]
    both = []
    for n in sorted(set(b) & set(e)):
        if e[n][1] != b[n][1]:
            both.append(f"{n}: shape {e[n][1]} != base {b[n][1]}")
        if e[n][0] != b[n][0]:
            both.append(f"{n}: dtype {e[n][0]} != base {b[n][0]}")
    assert not set(b) - set(e)
    return extra + both


def test_wrong_base_is_one_short_line_that_says_how_they_differ(wrong_base):
    db, base, expert = wrong_base
    before = dump_catalog_file(db)
    problems = expected_problems(base, expert)
    assert len(problems) == 18 + 2 * 21  # layers 2 and 3 (9 tensors each); 21 shared tensors, shape and dtype
    res = run_cli_proc(["register", "--db", db, "--base", "base", "--model-id", "wrong", "--uri", expert])
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == ("error: wrong does not match base base: expert has 4 layers, vocab 4096, BF16; base has "
                          "2 layers, vocab 256, F32; first difference: lm_head.weight: shape [4096, 256] != base "
                          f"[256, 64]; {len(problems)} differences in all (`mergepipe register --verbose` lists "
                          "them)\n")
    assert len(res.stderr) < 300
    assert dump_catalog_file(db) == before


def test_verbose_lists_every_difference(wrong_base):
    db, base, expert = wrong_base
    before = dump_catalog_file(db)
    res = run_cli_proc(["register", "--db", db, "--base", "base", "--verbose", expert])
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert lines[:-1] == [f"  {p}" for p in expected_problems(base, expert)]
    assert lines[-1].startswith("error: expert_1 does not match base base: expert has 4 layers")
    assert dump_catalog_file(db) == before


def test_a_few_differences_are_still_listed_whole(wrong_base, tmp_path):
    """One missing tensor: the message names it (no summary), as before."""
    from safetensors.torch import load_file, save_file
    db, base, _ = wrong_base
    tensors = {}
    for f in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(tmp_path / "short.safetensors"))
    res = run_cli_proc(["register", "--db", db, "--base", "base", "--model-id", "short", "--uri",
                        tmp_path / "short.safetensors"])
    assert (res.returncode, res.stderr) == (2, "error: short does not match base base: missing tensor "
                                               "model.norm.weight\n")


# --- listings at 80 columns -------------------------------------------------------------------------------
BASE = "base-model-with-a-rather-long-identifier-v1"
EXPERT = "expert-math-finetune-with-a-long-id-2026-01-15-run7"
MERGED = "merged-math-model-with-a-long-name-from-january-v3"
HUGE = "an-id-that-alone-is-longer-than-the-terminal-" + "x" * 50


@pytest.fixture(scope="module")
def long_ids(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-ids")
    fam = make_family(root / "fam", experts=1, size="tiny", dtype="fp32")
    db = root / "cat.sqlite"
    cat = Catalog(db)
    register(cat, BASE, fam["base"])
    register(cat, HUGE, fam["base"])
    register(cat, EXPERT, fam["experts"][0], base_id=BASE)
    _, snapshot_id, _ = merge(cat, BASE, [EXPERT], root / "out-with-a-long-folder-name", "linear", model_id=MERGED)
    cat.close()
    return db, snapshot_id, root / "out-with-a-long-folder-name"


def lines_of(out: str) -> list[str]:
    return out.splitlines()


def test_ids_stay_whole_at_80_columns(long_ids, capsys, monkeypatch):
    db, snapshot_id, _ = long_ids
    monkeypatch.setenv("COLUMNS", "80")
    for command, ids in ((["models"], [BASE, EXPERT, MERGED, HUGE]), (["snapshots"], [snapshot_id, MERGED])):
        rc, out, err = cli(capsys, *command, "--db", db)
        assert (rc, err) == (0, "")
        lines = lines_of(out)
        for i in ids:
            assert any(re.search(rf"(^|\s){re.escape(i)}(\s|$)", line) for line in lines), (command, i, out)
        too_long = [line for line in lines if len(line) > 80]  # the row of an id longer than 80, and the rule
        assert all(HUGE in line or set(line.strip()) == {"─"} for line in too_long), (command, too_long)
        assert len(too_long) == (2 if command == ["models"] else 0)
        note = " ".join(out.split("\n\n")[-1].split())
        assert note.startswith("(left out at 80 columns: ") and note.endswith("; --wide shows them)"), note


def test_wide_shows_every_column(long_ids, capsys, monkeypatch):
    db, snapshot_id, out_dir = long_ids
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = cli(capsys, "snapshots", "--db", db, "--wide")
    row = next(line for line in lines_of(out) if snapshot_id in line)
    assert rc == 0 and MERGED in row and "linear" in row and str(out_dir) in row and "…" not in out
    rc, out, _ = cli(capsys, "models", "--db", db, "--wide")
    head = lines_of(out)[1].split()
    assert head == ["id", "kind", "base", "architecture", "dtype", "params", "size", "fp", "analyzed"]
    assert rc == 0 and "…" not in out and "left out" not in out


# --- explain in binary units ------------------------------------------------------------------------------
def test_realized_line_uses_binary_units():
    from mergepipe.planner.explain import realized_line
    est = {"base_read": 9998848, "expert_read": 3 << 20, "output_write": 9998848}
    assert realized_line(dict(est, output_write=9999872), est) == (
        "  realized   base read 9.54 MiB (as estimated), expert read 3.00 MiB (as estimated), "
        "write 9.54 MiB (+1024 B vs the estimate)")
    assert realized_line({"base_read": 1 << 30, "expert_read": 512, "compact_read": 1536, "output_write": 2 << 20},
                         {"base_read": 1 << 30, "expert_read": 1024, "compact_read": 1536, "output_write": 1 << 20}) \
        == ("  realized   base read 1.00 GiB (as estimated), expert read 512 B (est. 1.00 KiB), compact read "
            "1.50 KiB (as estimated), write 2.00 MiB (est. 1.00 MiB)")


def test_explain_of_a_snapshot_prints_units_and_json_keeps_bytes(long_ids, capsys):
    db, snapshot_id, _ = long_ids
    rc, out, _ = cli(capsys, "explain", "--db", db, snapshot_id)
    realized = next(line for line in lines_of(out) if line.startswith("  realized"))
    rc2, js, _ = cli(capsys, "explain", "--db", db, snapshot_id, "--json")
    r = json.loads(js)["core"]["realized"]
    assert rc == rc2 == 0 and isinstance(r["base_read"], int) and r["base_read"] > 1024
    assert realized.startswith(f"  realized   base read {human_bytes(r['base_read'])} (")
    assert f" {r['base_read']} B" not in out and not re.search(r"\d{4,} B\b", realized)
    assert re.search(r"base read \d+\.\d\d KiB", realized), realized


# --- what a target bound is -------------------------------------------------------------------------------
def test_plan_help_explains_the_target_bound(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--target-bound EPS" in text
    assert "as a fraction of ||M_full - base||, is at most EPS" in text and "0.05" in text and "typical" in text
