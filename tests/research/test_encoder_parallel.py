"""The parallel runner of the encoder fidelity study: learning-rate choice, phases, process pool, joining."""

from __future__ import annotations

import time

from benchmarks.fidelity.encoder_parallel import choose, keep_other_variants, longest_first, run_pool, study_jobs
from benchmarks.fidelity.encoder_study import BLOCK_SWEEP, STRATEGIES, join_results, phase_list


def _scores(gains: dict) -> dict:
    """Validation accuracies of each candidate: base probe 0.6 on two tasks, experts at probe + gain."""
    return {c: {"base_probe": {"a": 0.6, "b": 0.6},
                "experts": {"full": {"a": 0.6 + ga, "b": 0.6 + gb}}} for c, (ga, gb) in gains.items()}


def test_choose_takes_the_smallest_rate_where_every_expert_clearly_beats_the_probe():
    scores = _scores({"lr2e-5": (0.30, 0.05), "lr3e-5": (0.20, 0.12), "lr5e-5": (0.35, 0.30)})
    assert choose(scores, "full", ["lr2e-5", "lr3e-5", "lr5e-5"]) == "lr3e-5"  # lr5e-5 is better but larger
    assert choose(scores, "full", ["lr2e-5", "lr3e-5", "lr5e-5"], margin=0.25) == "lr5e-5"


def test_choose_falls_back_to_the_best_mean_when_none_clears_the_margin():
    scores = _scores({"lr2e-5": (0.02, 0.05), "lr3e-5": (0.09, 0.01), "lr5e-5": (0.04, 0.04)})
    assert choose(scores, "full", ["lr2e-5", "lr3e-5", "lr5e-5"]) == "lr3e-5"  # mean gains .035 .05 .04


def test_phases_cover_every_variant_size_and_strategy_once():
    tasks = [f"t{i}" for i in range(8)]
    phases = phase_list(["full", "lora"], tasks)
    names = [p[0] for p in phases]
    assert len(names) == len(set(names)) == 2 * 3 * len(STRATEGIES)
    assert {(p[1], p[2]) for p in phases} == {(v, k) for v in ("full", "lora") for k in (None, 4, 2)}
    assert all(list(p[3]) == [p[0].split()[-1]] for p in phases)  # one strategy, the one it is named by
    assert [p[0] for p in phase_list(["full"], tasks[:2])] == [f"full K=2 {s}" for s in STRATEGIES]
    jobs = study_jobs({"full": "lr2e-5", "lora": "lr3e-5"}, tasks, mini=False)
    assert len(jobs) == len(phases) + len(BLOCK_SWEEP)
    k8 = [n for n in names if "K=8" in n]
    assert [j[0] for j in jobs] == k8 + [f"blocks {b}" for b in BLOCK_SWEEP] + names[len(k8):]  # informative first
    assert names[:2] == ["full K=8 norm", "lora K=8 norm"]
    assert [j[0] for j in longest_first(jobs)[:10]] == [n for n in names if "K=2" in n]
    lora = next(argv for name, argv in jobs if name == "lora K=8 kept")
    assert argv_value(lora, "--family").endswith("minilm-lr3e-5") and argv_value(lora, "--phases") == "lora K=8 kept"


def argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_pool_runs_jobs_and_stops_the_rest_at_the_deadline(tmp_path):
    jobs = [("ok", ["-c", "print('hi')"]), ("fails", ["-c", "raise SystemExit(3)"]),
            ("slow", ["-c", "import time; time.sleep(60)"]), ("late", ["-c", "pass"])]
    t0 = time.time()
    assert run_pool(jobs, 3, tmp_path / "a", deadline=time.time() + 4) == {"ok": 0, "fails": 3, "slow": None,
                                                                            "late": 0}
    assert (tmp_path / "a" / "ok.log").read_text() == "hi\n"
    one_at_a_time = run_pool([jobs[2], jobs[0]], 1, tmp_path / "b", deadline=time.time() + 2)
    assert one_at_a_time == {"slow": None, "ok": None}  # stopped, and never started
    assert not (tmp_path / "b" / "ok.log").exists()
    assert time.time() - t0 < 30


def _part(variant, merges, lam=None, probe=0.5, seconds=10.0):
    return {"variants": {variant: {"analyze_seconds": 1.0, "lambda": lam or {}, "merges": merges}},
            "accuracy": {"base_probe": {"a": probe}, "experts": {variant: {"a": 0.9}},
                         "base_expert_head": {variant: {"a": 0.55}}},
            "phases_done": [f"{variant} phase"], "family": {"seconds_per_step": {variant: 0.1}},
            "seconds_total": seconds}


def _merge(op, budget, strategy, experts=("a", "b")):
    return {"operator": op, "budget_pct": budget, "strategy": strategy, "experts": list(experts)}


def test_join_results_adds_new_merges_once_and_keeps_every_variant():
    a = _part("full", [_merge("ties", 100, "all"), _merge("ties", 25, "norm")], {"8": {"chosen": 0.5}})
    b = _part("full", [_merge("ties", 25, "norm"), _merge("ties", 25, "kept")], {"8": {"chosen": 1.0}},
              seconds=30.0)
    c = _part("lora", [_merge("linear", 10, "random", ("a",))], {"2": {"chosen": 0.3}})
    c["block_sweep"] = [{"block_bytes": 16384}]
    res = join_results(join_results(a, b), c)
    got = {(m["operator"], m["budget_pct"], m["strategy"]) for m in res["variants"]["full"]["merges"]}
    assert got == {("ties", 100, "all"), ("ties", 25, "norm"), ("ties", 25, "kept")}
    assert len(res["variants"]["full"]["merges"]) == 3
    assert res["variants"]["full"]["lambda"] == {"8": {"chosen": 0.5}}  # the first part's choice stands
    assert res["variants"]["lora"]["lambda"] == {"2": {"chosen": 0.3}}
    assert set(res["accuracy"]["experts"]) == {"full", "lora"}
    assert res["phases_done"] == ["full phase", "full phase", "lora phase"]
    assert res["seconds_total"] == 30.0 and res["block_sweep"] == [{"block_bytes": 16384}]



def _run(parts, chosen, validation, parallel):
    res = parts[0]
    for p in parts[1:]:
        res = join_results(res, p)
    res["lr_search"] = {"candidates": {c: {"lora_lr": lr} for c, lr in validation.items()},
                        "validation": {c: {"base_probe": {"a": 0.5}, "base_expert_head": {v: {"a": 0.5} for v in chosen},
                                           "experts": {v: {"a": lr} for v in chosen}} for c, lr in validation.items()},
                        "evaluation": {v: {"experts": {v: {"a": 0.9}}} for v in chosen}, "chosen": chosen}
    res["family"]["spec_by_variant"] = {v: {"variant": v, "run": parallel} for v in chosen}
    res["parallel"] = {"run": parallel}
    return res


def test_keep_other_variants_replaces_only_the_rerun_variant():
    prev = _run([_part("full", [_merge("ties", 25, "norm")]), _part("lora", [_merge("ties", 25, "norm"),
                                                                               _merge("ties", 50, "norm")])],
                {"full": "lr2e-5", "lora": "lr5e-5"}, {"lr2e-5": 0.1, "lr5e-5": 0.2}, "old")
    prev["block_sweep"] = [{"block_bytes": 16384}]
    lora = _part("lora", [_merge("linear", 10, "kept")], {"2": {"chosen": 0.7}}, seconds=5.0)
    lora["accuracy"]["experts"]["lora"] = {"a": 0.99}
    new = _run([lora], {"lora": "lr2e-5"}, {"lr2e-5": 0.3, "lr5e-5": 0.4}, "new")
    res = keep_other_variants(prev, new, ["lora"])
    assert res["variants"]["full"] == prev["variants"]["full"]
    assert res["variants"]["lora"]["merges"] == [_merge("linear", 10, "kept")]  # the old LoRA merges are gone
    assert res["variants"]["lora"]["lambda"] == {"2": {"chosen": 0.7}}
    assert res["accuracy"]["experts"] == {"full": {"a": 0.9}, "lora": {"a": 0.99}}
    assert res["phases_done"] == ["full phase", "lora phase"] and res["block_sweep"] == [{"block_bytes": 16384}]
    assert res["lr_search"]["chosen"] == {"full": "lr2e-5", "lora": "lr2e-5"}
    val = res["lr_search"]["validation"]
    assert val["lr5e-5"]["experts"] == {"full": {"a": 0.2}, "lora": {"a": 0.4}}
    assert res["family"]["spec_by_variant"]["full"]["run"] == "old"
    assert res["family"]["spec_by_variant"]["lora"]["run"] == "new"
    assert res["parallel"] == {"run": "new", "previous": {"run": "old"}}
    assert prev["variants"]["lora"]["merges"][0] == _merge("ties", 25, "norm")  # the input is not changed
