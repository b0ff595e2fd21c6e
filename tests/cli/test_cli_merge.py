"""The plan / merge / execute / explain / verify / snapshots / lineage / recover commands, bad input
(one line `error: ...`, exit 2, nothing changed), the original quick start, and the Python API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from merge_helpers import (STAGING_MARK, copy_catalog, dir_hashes, dump_db, load_dir, run_cli, run_cli_proc,
                           shared_family)


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


@pytest.fixture
def db(fam, tmp_path) -> Path:
    return copy_catalog(fam, tmp_path / "c.sqlite")


def merge_args(db, out, *extra, experts=("e1", "e2", "e3")):
    return ["--db", db, "merge", "--base", "base", "--experts", *experts, "--out", out, *extra]


def assert_one_line_error(res, *words):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in res.stderr


# --- bad input ------------------------------------------------------------------------------------
BAD = [
    ("unknown base", lambda o: ["--base", "nope", "--experts", "e1"], ["unknown model id 'nope'"]),
    ("unknown expert", lambda o: ["--base", "base", "--experts", "e1", "ghost"], ["unknown model id 'ghost'"]),
    ("budget abc", lambda o: ["--base", "base", "--experts", "e1", "--budget", "abc"], ["bad budget 'abc'"]),
    ("budget negative", lambda o: ["--base", "base", "--experts", "e1", "--budget=-5%"], ["bad budget '-5%'"]),
    ("budget zero", lambda o: ["--base", "base", "--experts", "e1", "--budget", "0"], ["positive"]),
    ("budget 150%", lambda o: ["--base", "base", "--experts", "e1", "--budget", "150%"], ["at most 100%"]),
    ("budget bare 2", lambda o: ["--base", "base", "--experts", "e1", "--budget", "2"], ["bare number"]),
    ("budget unit", lambda o: ["--base", "base", "--experts", "e1", "--budget", "3XB"], ["unknown unit"]),
    ("io budget negative", lambda o: ["--base", "base", "--experts", "e1", "--io-budget-mb", "-1"], ["positive"]),
    ("density 0", lambda o: ["--base", "base", "--experts", "e1", "--op", "ties", "--density", "0"],
     ["density 0 of", "outside (0, 1]"]),
    ("density 1.5", lambda o: ["--base", "base", "--experts", "e1", "--op", "ties", "--density", "1.5"],
     ["density 1.5", "outside (0, 1]"]),
    ("density negative", lambda o: ["--base", "base", "--experts", "e1", "--op", "dare_ties", "--density=-0.5"],
     ["outside (0, 1]"]),
    ("unknown op", lambda o: ["--base", "base", "--experts", "e1", "--op", "task_adapter"], ["unknown operator"]),
    ("weights count", lambda o: ["--base", "base", "--experts", "e1", "e2", "--weights", "1"], ["1 weights"]),
    ("duplicate expert", lambda o: ["--base", "base", "--experts", "e1", "e1"], ["twice"]),
    ("target bound non-additive", lambda o: ["--base", "base", "--experts", "e1", "--op", "ties", "--density",
                                             "0.3", "--target-bound", "0.1"], ["additive"]),
    ("base as its own expert", lambda o: ["--base", "base", "--experts", "base"], ["registered with base"]),
]


@pytest.mark.parametrize("name, args, words", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("cmd", ["merge", "plan"])
def test_bad_input_exit_2_nothing_changed(fam, db, tmp_path, name, args, words, cmd):
    out = tmp_path / "out"
    before = dump_db(db)
    argv = ["--db", db, cmd, *args(out)] + (["--out", out] if cmd == "merge" else [])
    res = run_cli(argv)
    assert_one_line_error(res, *words)
    assert dump_db(db) == before
    assert all(p.name.startswith("c.sqlite") for p in tmp_path.iterdir())  # no output, no staging


def test_bad_input_output_path_exists(db, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = dump_db(db)
    res = run_cli(merge_args(db, out))
    assert_one_line_error(res, "already exists")
    assert dump_db(db) == before
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if STAGING_MARK in p.name]
    # A file (not a directory) in the way, and a missing parent directory.
    (tmp_path / "afile").write_text("x")
    assert_one_line_error(run_cli(merge_args(db, tmp_path / "afile")), "already exists")
    assert_one_line_error(run_cli(merge_args(db, tmp_path / "no" / "such")), "does not exist")
    assert dump_db(db) == before
    assert not (tmp_path / "no").exists()


def test_bad_input_model_id_exists(db, tmp_path):
    first = run_cli(merge_args(db, tmp_path / "one", "--model-id", "merged"))
    assert first.returncode == 0, first.stderr
    before = dump_db(db)
    for mid in ("merged", "e1", "base"):
        res = run_cli(merge_args(db, tmp_path / f"two-{mid}", "--model-id", mid))
        assert_one_line_error(res, f"model id {mid!r} is already registered")
        assert not (tmp_path / f"two-{mid}").exists()
    # Without --model-id the output directory's name is the id.
    (tmp_path / "sub").mkdir()
    res = run_cli(merge_args(db, tmp_path / "sub" / "merged"))
    assert_one_line_error(res, "already registered")
    assert dump_db(db) == before
    assert not [p for p in tmp_path.iterdir() if STAGING_MARK in p.name]


def test_bad_input_through_the_real_executable(db, tmp_path):
    before = dump_db(db)
    res = run_cli_proc(merge_args(db, tmp_path / "out", "--budget=-5%"))
    assert_one_line_error(res, "bad budget")
    res = run_cli_proc(["--db", db, "execute", "plan-0123456789abcdef", "--out", tmp_path / "out"])
    assert_one_line_error(res, "unknown plan id")
    assert dump_db(db) == before and not (tmp_path / "out").exists()


def test_missing_catalog_is_an_error(tmp_path):
    res = run_cli(["--db", tmp_path / "none.sqlite", "plan", "--base", "b", "--experts", "e"])
    assert_one_line_error(res, "no catalog")
    assert not (tmp_path / "none.sqlite").exists()


# --- plan / merge / execute / explain --------------------------------------------------------------
def test_plan_json_fields(db):
    res = run_cli(["--db", db, "plan", "--json", "--base", "base", "--experts", "e1", "e2", "e3", "--op",
                   "task_arithmetic", "--weights", "0.5", "1", "-0.25", "--lambda", "0.8", "--budget", "30%"])
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert set(d) >= {"plan_id", "digest", "operator", "budget_bytes", "full_expert_bytes", "estimated",
                      "blocks_selected", "expert_read_by_expert", "error_bound"}
    assert d["operator"] == "task_arithmetic" and d["plan_id"].startswith("plan-")
    assert d["budget_bytes"] == int(0.3 * d["full_expert_bytes"])
    assert set(d["estimated"]) == {"base_read", "expert_read", "compact_read", "output_write"}
    assert d["estimated"]["compact_read"] == 0 and d["tiers"]["compact"]["blocks"] == 0  # no compacts stored
    assert d["estimated"]["expert_read"] == sum(d["expert_read_by_expert"].values()) <= d["budget_bytes"]
    assert set(d["blocks_selected"]) == {"e1", "e2", "e3"} and all(v > 0 for v in d["blocks_selected"].values())
    b = d["error_bound"]
    assert b["absolute"] > 0 and b["relative"] == pytest.approx(b["absolute"] / b["full_delta_norm"])
    # Stored: explain --json gives the full plan.
    full = json.loads(run_cli(["--db", db, "explain", "--json", d["plan_id"]]).stdout)
    assert full["id"] == d["plan_id"] and full["digest"] == d["digest"]
    assert full["params"] == {"normalize": False, "rescale": False, "lambda": 0.8}
    assert [e["weight"] for e in full["experts"]] == [0.5, 1.0, -0.25]


def test_explain_plan_per_expert_and_per_tensor(db):
    d = json.loads(run_cli(["--db", db, "plan", "--json", "--base", "base", "--experts", "e1", "e2",
                            "--op", "ties", "--density", "0.3", "--budget", "25%"]).stdout)
    res = run_cli(["--db", db, "explain", d["plan_id"]])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"PLAN {d['plan_id']}")
    i_exp = lines.index("  experts")
    i_ten = lines.index("  tensors (blocks read per expert)")
    expert_lines = lines[i_exp + 1:i_ten]
    assert [l.split()[0] for l in expert_lines] == ["e1", "e2"]
    for l, eid in zip(expert_lines, ("e1", "e2")):
        assert f"blocks {d['blocks_selected'][eid]}/" in l and "weight 1" in l and "density 0.3" in l
    full = json.loads(run_cli(["--db", db, "explain", "--json", d["plan_id"]]).stdout)
    tensor_lines = lines[i_ten + 1:]
    tensors = sorted({t for ts in full["access"].values() for t in ts})
    assert [l.split()[0] for l in tensor_lines] == tensors
    for l in tensor_lines:
        t = l.split()[0]
        for eid in ("e1", "e2"):
            if t in full["access"][eid]:
                assert f"{eid}:" in l
    # The short id works too, and an unknown id is a clean error.
    assert run_cli(["--db", db, "explain", d["plan_id"][len("plan-"):]]).stdout == res.stdout
    assert_one_line_error(run_cli(["--db", db, "explain", "plan-ffffffffffffffff"]), "unknown plan or snapshot")


def test_merge_json_fields_and_execute(fam, db, tmp_path):
    res = run_cli(["--json"] + merge_args(db, tmp_path / "m", "--op", "dare_ties", "--density", "0.3",
                                          "--budget", "40%", "--seed", "4", "--model-id", "m-1"))
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert set(s) >= {"snapshot_id", "out", "manifest_hash", "budget_bytes", "full_expert_bytes", "estimated",
                      "realized", "error_bound", "plan_id", "model_id"}
    assert s["out"] == str(tmp_path / "m") and s["model_id"] == "m-1"
    assert s["snapshot_id"].startswith("snap-") and s["manifest_hash"].startswith("sha256:")
    for part in ("estimated", "realized"):
        assert set(s[part]) == {"base_read", "expert_read", "compact_read", "output_write"}
    assert s["realized"]["expert_read"] == s["estimated"]["expert_read"] <= s["budget_bytes"]
    assert s["budget_bytes"] == int(0.4 * s["full_expert_bytes"])
    assert s["realized"]["base_read"] == s["estimated"]["base_read"] > 0
    assert s["error_bound"]["kind"] == "sparsified"  # dare_ties: not additive, a sound but loose bound
    on_disk = json.loads((tmp_path / "m" / "mergepipe_manifest.json").read_text())
    assert on_disk["manifest_hash"] == s["manifest_hash"]
    # execute PLAN_ID reproduces it byte for byte.
    res2 = run_cli(["--db", db, "--json", "execute", s["plan_id"], "--out", tmp_path / "m2"])
    assert res2.returncode == 0, res2.stderr
    s2 = json.loads(res2.stdout)
    assert s2["manifest_hash"] == s["manifest_hash"] and s2["snapshot_id"] != s["snapshot_id"]
    assert dir_hashes(tmp_path / "m") == dir_hashes(tmp_path / "m2")
    # snapshots, verify, explain of a snapshot.
    snaps = json.loads(run_cli(["--db", db, "snapshots", "--json"]).stdout)
    assert {x["id"] for x in snaps} == {s["snapshot_id"], s2["snapshot_id"]}
    v = run_cli(["--db", db, "verify", "--json", s["snapshot_id"]])
    assert v.returncode == 0 and json.loads(v.stdout)["ok"] is True
    ex = run_cli(["--db", db, "explain", "m-1"])
    assert ex.stdout.startswith(f"SNAPSHOT {s['snapshot_id']}") and f"PLAN {s['plan_id']}" in ex.stdout
    # Human-readable merge output.
    res3 = run_cli(merge_args(db, tmp_path / "m3", "--budget", "10%"))
    assert res3.returncode == 0 and res3.stdout.startswith("published snap-") and "error bound" in res3.stdout


def test_verify_exit_1_names_the_tampered_file(db, tmp_path):
    out = tmp_path / "pub"
    res = run_cli(["--json"] + merge_args(db, out, "--out-shard-size", "120000"))
    sid = json.loads(res.stdout)["snapshot_id"]
    assert run_cli(["--db", db, "verify", sid]).returncode == 0
    shard = sorted(out.glob("*.safetensors"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    for ref in (sid, str(out)):
        v = run_cli(["--db", db, "verify", ref])
        assert v.returncode == 1
        assert shard.name in v.stderr and v.stderr.startswith("error: ")
        assert "MISMATCH" in v.stdout and shard.name in v.stdout
    vj = run_cli(["--db", db, "verify", "--json", sid])
    d = json.loads(vj.stdout)
    assert vj.returncode == 1 and d["ok"] is False and d["problems"][0].startswith(shard.name)
    # Without a catalog, by directory.
    v = run_cli(["--db", tmp_path / "absent.sqlite", "verify", str(out)])
    assert v.returncode == 1 and shard.name in v.stderr
    assert not (tmp_path / "absent.sqlite").exists()


def test_target_bound_cli(db):
    res = run_cli(["--db", db, "plan", "--json", "--base", "base", "--experts", "e1", "e2", "e3",
                   "--target-bound", "0.1"])
    d = json.loads(res.stdout)
    assert d["error_bound"]["relative"] <= 0.1
    smaller = run_cli(["--db", db, "plan", "--json", "--base", "base", "--experts", "e1", "e2", "e3",
                       "--budget", f"{d['budget_bytes'] - 1}B"])
    assert json.loads(smaller.stdout)["error_bound"]["relative"] > 0.1


def test_original_quick_start_spelling(fam, db, tmp_path):
    out = tmp_path / "qs"
    res = run_cli_proc(["--db", db, "--base", "base", "--experts", "e1", "e2", "--out", out, "--model-id", "qs"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("published snap-") and "as model qs" in res.stdout
    from mergepipe.catalog.db import Catalog
    cat = Catalog(db)
    row = cat.model("qs")
    snap = cat.query("SELECT * FROM snapshots WHERE model_id = 'qs'")[0]
    plan = json.loads(cat.query("SELECT json FROM plans WHERE id = ?", [snap["plan_id"]])[0]["json"])
    cat.close()
    assert row["snapshot_id"] == snap["id"] and plan["operator"] == "linear"
    assert plan["estimate"]["expert_read"] == plan["full_expert_bytes"]  # default budget 100%
    # Also with --io-budget-mb (the original CLI's budget flag), in-process.
    res = run_cli(["--db", db, "--json", "--base", "base", "--experts", "e1", "e2", "--out", tmp_path / "qs2",
                   "--model-id", "qs2", "--io-budget-mb", "0.125"])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["budget_bytes"] == 2**17


def test_recover_and_snapshots_on_a_clean_catalog(db):
    res = run_cli(["--db", db, "recover", "--json"])
    assert res.returncode == 0 and json.loads(res.stdout) == {"rolled_back": [], "removed": [], "failed_runs": []}
    assert json.loads(run_cli(["--db", db, "snapshots", "--json"]).stdout) == []
    res = run_cli(["--db", db, "lineage"])
    assert res.returncode == 0 and "(no merges yet)" in res.stdout


# --- the Python API -------------------------------------------------------------------------------
def test_python_api(fam, tmp_path):
    import mergepipe
    from mergepipe import Catalog
    from mergepipe.api import Engine, Planner

    # The spelling works too and names the same classes.
    from mergepipe import Engine as Engine2, Planner as Planner2
    assert Planner2 is Planner and Engine2 is Engine and "Planner" in mergepipe.__all__

    catalog = Catalog(copy_catalog(fam, tmp_path / "c.sqlite"))
    plan = Planner(catalog).plan(base_model="base", experts=["e1", "e2", "e3"], operator="TIES", budget_mb=0.25,
                                 density=0.5)
    assert plan["operator"] == "ties" and plan["budget"]["bytes"] == 2**18
    assert plan["estimate"]["expert_read"] <= 2**18
    snapshot_id, manifest = Engine(catalog).execute(plan, out=tmp_path / "api-out")
    assert snapshot_id == manifest.snapshot_id and manifest.manifest_hash.startswith("sha256:")
    assert catalog.query("SELECT manifest_hash FROM snapshots WHERE id = ?", [snapshot_id])[0][
        "manifest_hash"] == manifest.manifest_hash
    assert catalog.model("api-out")["snapshot_id"] == snapshot_id
    assert manifest.core["realized"]["expert_read"] == plan["estimate"]["expert_read"]
    merged = load_dir(tmp_path / "api-out")
    assert set(merged) == set(load_dir(fam.base))
    # budget_mb larger than the full read caps at 100%.
    full = Planner(catalog).plan(base_model="base", experts=["e1"], operator="TIES", budget_mb=8192, density=0.5)
    assert full["budget"]["bytes"] == full["full_expert_bytes"] == full["estimate"]["expert_read"]
    catalog.close()


def test_api_merge_helper_leaves_nothing_on_failure(fam, tmp_path):
    from mergepipe.api import merge
    from mergepipe.catalog.db import Catalog
    from mergepipe.errors import MergePipeError
    db = copy_catalog(fam, tmp_path / "c.sqlite")
    cat = Catalog(db)
    (tmp_path / "busy").mkdir()
    before = dump_db(db)
    with pytest.raises(MergePipeError, match="already exists"):
        merge(cat, "base", ["e1", "e2"], tmp_path / "busy", operator="linear", budget="50%")
    assert dump_db(db) == before
    plan, sid, manifest = merge(cat, "base", ["e1", "e2"], tmp_path / "ok", operator="linear", budget="50%")
    assert cat.query("SELECT 1 FROM plans WHERE id = ?", [plan.id])
    cat.close()


def test_mergekit_config_through_the_real_executable(fam, db, tmp_path):
    cfg = tmp_path / "merge.yml"
    cfg.write_text(f"merge_method: task_arithmetic\nbase_model: {fam.base}\nmodels:\n"
                   f"  - model: {fam.experts[0]}\n    parameters: {{weight: 0.5}}\n"
                   f"  - model: e2\n    parameters: {{weight: 1.0}}\n"
                   f"parameters: {{lambda: 0.9}}\ndtype: float32\nout_dtype: float32\ntokenizer_source: base\n")
    res = run_cli_proc(["--db", db, "--json", "merge", "--config", cfg, "--budget", "50%", "--out", tmp_path / "y"])
    assert res.returncode == 0, res.stderr
    flags = run_cli(["--db", db, "--json"] + merge_args(db, tmp_path / "f", "--op", "task_arithmetic", "--weights",
                                                        "0.5", "1", "--lambda", "0.9", "--budget", "50%",
                                                        experts=("e1", "e2"))[2:])
    assert flags.returncode == 0, flags.stderr
    assert json.loads(res.stdout)["manifest_hash"] == json.loads(flags.stdout)["manifest_hash"]
    assert dir_hashes(tmp_path / "y") == dir_hashes(tmp_path / "f")
    # The quick-start spelling (no subcommand) takes --config too; a refused config is one line, exit 2.
    cfg.write_text(cfg.read_text() + "slices: []\n")
    before = dump_db(db)
    res = run_cli_proc(["--db", db, "--config", cfg, "--out", tmp_path / "z"])
    assert_one_line_error(res, "slices")
    assert dump_db(db) == before and not (tmp_path / "z").exists()
