"""The benchmark runner end to end on its CI profile: real processes, cold cache, bytes from rusage.

Speed is never asserted here (that is what docs/benchmarks/ records); bytes are: a budgeted merge
reads about its budget of expert bytes, the naive baseline reads every byte of every input.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE_SLACK = 64 << 10  # per file: its safetensors header page, page rounding


def test_ci_profile_bytes_are_sane(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--profile", "ci", "--repeats", "1", "--no-mergekit",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "ci.json").read_text())
    assert (out / "ci.md").read_text().startswith("# Benchmark: ci profile")
    assert list(out.glob("ci-*-vs-K.html"))
    fam = res["families"][0]
    runs = fam["runs"]
    family_bytes = fam["family_bytes"]
    base_dir = tmp_path / "work" / fam["family"] / "base"
    copied = sum(p.stat().st_size for p in base_dir.iterdir() if p.suffix != ".safetensors")  # config, tokenizer
    n_files = sum(1 for _ in (tmp_path / "work" / fam["family"]).rglob("*.safetensors"))
    slack = copied + PAGE_SLACK * n_files
    for op in ("linear", "ties"):
        mp10 = next(r for r in runs if r["op"] == op and r["contender"] == "mergepipe 10%")
        mp100 = next(r for r in runs if r["op"] == op and r["contender"] == "mergepipe 100%")
        naive = next(r for r in runs if r["op"] == op and r["contender"] == "naive")
        full, base = mp10["full_expert_bytes"], mp10["base_bytes"]
        assert mp10["planned_expert_bytes"] <= 0.10 * full
        # What the budgeted merge read from the family's files (page-cache residency after a cold run)...
        assert base <= mp10["input_bytes_read"] <= 0.10 * full + base + slack, (op, mp10["input_bytes_read"], slack)
        # ...and from the disk in all, through the process's own counters (libraries, catalog: small noise).
        assert base <= mp10["read_bytes"] <= 0.10 * full + base + slack + (4 << 20), (op, mp10["read_bytes"])
        assert mp100["read_bytes"] >= mp100["input_bytes_read"] >= full + base
        assert mp100["input_bytes_read"] > 3 * (mp10["input_bytes_read"] - base)
        assert naive["read_bytes"] >= family_bytes  # every byte of the base and of every expert
        check = fam["checks"][f"{op}: mergepipe-100% vs naive"]
        assert check["same_names"] and check["differing"] == 0
    targets = {t["target"][:2]: t for t in json.loads((out / "ci.json").read_text())["targets"]}
    assert {"P3", "P4", "P5", "P6"} <= set(targets)


def test_first_merge_ci_profile(tmp_path):
    """benchmarks/first_merge.py on its CI profile: the new first merge (batch register, merge over
    unanalyzed experts) ran, read bytes, equals the second merge at 100 %, and every target has a row."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "first_merge.py"), "--profile", "ci",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "first-merge-ci.json").read_text())
    assert (out / "first-merge-ci.md").read_text().startswith("# First merge")
    fam = res["families"][0]
    for op in ("linear", "ties"):
        runs = {r["contender"]: r for r in fam["runs"] if r["op"] == op}
        first = runs["mergepipe first merge"]
        assert "failed" not in first, first["failed"]
        assert first["register_path"] == "batch"
        assert [s["step"] for s in first["steps"]] == ["init-db", "register base", "register 2 experts", "merge"]
        assert first["read_bytes"] >= fam["family_bytes"] > 0  # cold: every byte of base and experts
        for b in ("10%", "100%"):
            assert runs[f"mergepipe second merge {b}"]["read_bytes"] > 0
        check = fam["checks"][f"{op}: mergepipe first merge vs mergepipe second merge 100%"]
        assert check["same_dtypes"] and check["total"] > 0 and check["differing"] == 0
    assert all(r["read_bytes"] > 0 and r["wall_s"] > 0 for r in fam["analyze"])
    assert len(fam["register_s"]) == 2 and all(t > 0 for t in fam["register_s"])
    assert len(res["cli_startup"]) == 3 and all(t > 0 for t in res["cli_startup"].values())
    rows = [t["target"] for t in res["targets"]]
    for prefix in ("linear first merge", "ties first merge", "ANALYZE", "register", "CLI start-up"):
        assert any(t.startswith(prefix) for t in rows), (prefix, rows)
    assert all(t["met"] in (True, False, None) and t["measured"] for t in res["targets"])


def test_remote_ci_profile(tmp_path):
    """benchmarks/remote.py on its CI profile (no mergekit): bytes counted by the HTTP server. Register
    moves headers only, a 10 % merge moves about its plan, 100 % over HTTP equals the local merge."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "remote.py"), "--profile", "ci", "--no-mergekit", "--mbps", "1000",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "remote-ci.json").read_text())
    rows = {r["contender"]: r for r in res["rows"]}
    assert rows["register base"]["transferred_bytes"] < 64 << 10
    mp10, mp100 = rows["mergepipe merge 10%"], rows["mergepipe merge 100%"]
    side = 64 << 10  # config and tokenizer files the output carries, 8-byte re-check probes
    assert mp10["planned_bytes"] <= mp10["transferred_bytes"] <= mp10["planned_bytes"] * 1.01 + side
    assert mp100["planned_bytes"] <= mp100["transferred_bytes"] <= mp100["planned_bytes"] * 1.01 + side
    assert rows["download everything"]["transferred_bytes"] == res["family_bytes"]
    assert mp10["transferred_bytes"] < 0.6 * mp100["transferred_bytes"]
    (check,) = res["checks"].values()
    assert check["same_names"] and check["differing"] == 0
    assert (out / "remote-ci.md").read_text().startswith("# Remote checkpoints")


def test_remote_coalesce_small_run(tmp_path):
    """benchmarks/remote_coalesce.py on a small family: the coalescing plan issues fewer requests (counted by
    the server) for at most the budget's bytes, and its HTTP merge equals the local merge of its access set."""
    out = tmp_path / "report"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "remote_coalesce.py"), "--family", "small-bf16-K2", "--k", "2",
         "--family-root", str(tmp_path / "fam"), "--work", str(tmp_path / "work"), "--out", str(out),
         "--mbps", "1000", "--latency-ms", "5", "--block-bytes", str(64 << 10), "--budgets", "10%",
         "--tolerances", "0.25", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "remote-coalesce.json").read_text())
    greedy, coalesced = sorted(res["rows"], key=lambda r: r["tolerance"] is not None)
    assert greedy["tolerance"] is None and coalesced["tolerance"] == 0.25
    assert coalesced["expert_requests"] < greedy["expert_requests"]
    assert coalesced["planned_expert_bytes"] <= coalesced["budget_bytes"] == greedy["budget_bytes"]
    for row in (greedy, coalesced):
        assert row["planned_expert_bytes"] <= row["expert_bytes"] <= row["planned_expert_bytes"] * 1.01 + (16 << 10)
    same, compared = res["checks"].values()
    assert same is True and compared["same_names"] and compared["differing"] == 0
    assert (out / "remote-coalesce.md").read_text().startswith("# Coalescing-aware plans")


def test_compact_smoke(tmp_path):
    """benchmarks/compact.py --smoke: ANALYZE with and without compacts ran cold in their own processes, the
    compact catalog grew by a fraction of the expert bytes, a tiered 10 % merge read compact blocks within its
    budget, and at 100 % tiered and exact-only outputs are byte-identical."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compact", "--smoke", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "compact-smoke.json").read_text())
    assert (out / "compact-smoke.md").read_text().startswith("# Compact delta tier")
    assert {r["config"] for r in res["analyze_runs"]} >= {"none", "progressive", "cold-read"}
    assert all(r["wall_s"] > 0 for r in res["analyze_runs"])
    cat = res["catalogs"]["progressive"]
    assert 0 < cat["compact_bytes"] < 0.5 * cat["expert_bytes"]
    assert 0 <= cat["rel_error"]["4"] <= cat["rel_error"]["1"]
    runs = {(r["budget"], r["mode"]): r for r in res["merge_runs"]}
    tiered = runs[("10%", "progressive")]
    real = tiered["realized"]
    assert real["compact_read"] > 0
    assert real["expert_read"] + real["compact_read"] <= 0.10 * tiered["full_expert_bytes"]
    assert runs[("10%", "off")]["realized"]["compact_read"] == 0
    assert res["checks"]["linear 100%: progressive vs off"]["byte_identical"]
    assert runs[("100%", "progressive")]["plan_id"] == runs[("100%", "off")]["plan_id"]
    dev = res["deviations"]["linear|10%|progressive"]
    assert dev["same_names"] and dev["deviation"] >= 0
    assert not (tmp_path / "work" / "compact-smoke").exists()  # the run cleans up after itself


def test_search_report_judges_each_goal_from_the_numbers():
    from benchmarks.search_report import goals, render
    k = {"k": 4, "tasks": ["a", "b", "c", "d"], "expert_bytes": 4 << 30,
         "defaults": {"linear": {"validation": 70.0, "heldout": 69.0},
                      "ties": {"validation": 72.0, "heldout": 68.0}},  # picked on validation, not held-out
         "cmaes": {"trials": 20, "expert_read": 80 << 30, "seconds": 400.0, "best_validation": 80.0,
                   "best_heldout": 78.0, "best_params": {}},
         "mergepipe_same_trials": {"trials": 20, "pruned": 12, "expert_read": 19 << 30, "seconds": 150.0,
                                   "best_validation": 79.0, "best_heldout": 77.6, "best_params": {}, "steps": [
                                       {"budget": "10%", "score": 70.0, "expert_read": 1, "bound": 0.5}]},
         "mergepipe_same_time": {"trials": 50, "pruned": 30, "expert_read": 45 << 30, "seconds": 399.0,
                                 "best_validation": 81.0, "best_heldout": 77.0, "best_params": {}, "steps": []}}
    judged = goals(k)
    assert [ok for _, _, ok in judged] == [True, True, True, False, True, True]
    assert judged[0][1] == "77.6 vs 68.0 (+9.6 points)"  # the default chosen on validation (ties)
    assert judged[3][1] == "77.0 vs 78.0 (-1.0)"
    assert judged[4][1].endswith("(0.24x)")
    text = render({"run": "now", "cpus": 2, "torch": "x", "seconds": 60, "family_a": [k]})
    assert "| K=4 search (same trials) takes <= 1/2 of CMA-ES's wall time | 150 s vs 400 s (0.38x) | yes |" in text


def test_search_rank_agreement_is_spearmans_rho_over_trials_that_reached_full_budget():
    from benchmarks.search import rank_agreement, spearman
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert abs(spearman([1, 1, 2, 3], [1, 2, 3, 4]) - 0.9486832980505138) < 1e-12  # ties share their mean rank
    trials = [{"steps": [{"budget": "10%", "score": a}, {"budget": "100%", "score": b}]}
              for a, b in ((1, 5), (2, 6), (3, 7), (4, 8))] + [{"steps": [{"budget": "10%", "score": 9}]}]  # pruned
    assert rank_agreement(trials) == {"10%": {"trials": 4, "rho": 1.0}}


def test_model_size_profile_on_a_tiny_family(tmp_path):
    """`run.py --profile 3b` hands its flags to benchmarks/large.py: here the same steps on the tiny family.
    The first merge equals the 100 % merge, linear at 100 % equals mergekit, a 10 % merge reads about its
    budget, the floors and the targets are written, and the generated family is deleted after the run."""
    out, work = tmp_path / "report", tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--profile", "3b", "--size", "tiny", "--k", "2",
         "--ops", "linear", "ties", "--work", str(work), "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "scale-tiny.json").read_text())
    assert not (work / "tiny-bf16-K2").exists() and not list((work).glob("scale-tiny/*"))
    checks = res["checks"]
    for op in ("linear", "ties"):
        assert checks[f"{op}: first merge vs mergepipe 100%"]["differing"] == 0
    assert checks["linear: mergepipe 100% vs mergekit"]["differing"] == 0
    assert checks["ties: mergepipe 100% vs mergekit"]["total"] == res["model_bytes"] // 2
    runs = {(r["op"], r["contender"]): r for r in res["runs"]}
    assert {("-", "floor 10%"), ("-", "floor 25%"), ("-", "floor 100%"), ("ties", "mergekit")} <= set(runs)
    assert all("failed" not in r for r in runs.values())
    assert runs[("ties", "mergepipe 10%")]["read_bytes"] < runs[("ties", "mergepipe 100%")]["read_bytes"]
    targets = {t["target"]: t for t in res["targets"]}
    assert targets["linear: mergepipe 100% vs mergekit: equal"]["met"] is True
    assert targets["MergePipe peak RSS <= 2 GB, every step"]["met"] is True
    md = (out / "scale-tiny.md").read_text()
    assert md.startswith("# Model size: a tiny-shaped bf16 family") and "| mergepipe 10% |" in md


def test_family_writer_streams_shards_and_names_them_as_the_hub_does(tmp_path):
    """The scale family is written shard by shard from a generator: the same tensors, in shards of at most
    shard_bytes, an index naming every tensor's file; the 3B shape has Llama-3.2-3B's parameter count."""
    import math

    import torch
    from safetensors.torch import load_file

    from mergepipe.research.family import tensor_shapes, write_checkpoint
    tensors = {f"t{i}": torch.full((256, 64), float(i), dtype=torch.bfloat16) for i in range(5)}  # 32 KiB each
    write_checkpoint(tmp_path / "m", iter(tensors.items()), {"vocab_size": 8}, shard_bytes=70_000)
    files = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"t0": files[0], "t1": files[0], "t2": files[1], "t3": files[1], "t4": files[2]}
    loaded = {k: v for f in files for k, v in load_file(str(tmp_path / "m" / f)).items()}
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert sum(math.prod(s) for s in tensor_shapes("llama-3.2-3b").values()) == 3_212_749_824


def test_tie_check_finds_every_ties_difference_from_mergekit_at_a_tied_cut_off(tmp_path):
    """benchmarks/tie_check.py on the tiny family: MergePipe's TIES against mergekit's at 100 %; the docs say the
    values that differ are all where an expert's |delta| ties at its top-k cut-off, and this counts them."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tie_check.py"), "--size", "tiny", "--experts", "3",
                          "--work", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["values"] > 100_000 and got["differ"] > 0, got  # the tiny family ties at its cut-offs too
    assert got["differ_elsewhere"] == 0 and got["differ_at_a_tied_cut"] == got["differ"], got
