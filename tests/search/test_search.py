"""Recipe search: spaces (ranges, choices, filter groups, refusals), seeded reproducibility, in-memory trials equal
to published merges bit for bit, objectives (Python, task suite, perplexity) equal to independent scoring,
pruning by rank, failing objectives, resume after SIGKILL, held-out scores, publishing, and the CLI."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from dashboard_helpers import build_catalog, copy_catalog
from merge_helpers import cli_cmd, dump_db, load_dir, rows
from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.config.model import ConfigError
from mergepipe.research.evaluate import load_model, load_tokenizer, perplexity, read_task_suite, score_task_suite

OBJECTIVE = '''
import json, os
from pathlib import Path
from safetensors.torch import load_file

REF = {}
for f in sorted(Path(os.environ["SEARCH_REF"]).glob("*.safetensors")):
    REF.update(load_file(f))
CALLS = os.environ.get("SEARCH_CALLS")


def closeness(sd):
    """Negative distance of the merged weights to expert_1's (higher: closer)."""
    if CALLS:
        with open(CALLS, "a") as fh:
            fh.write(json.dumps(sorted((k, round(float(v.float().sum()), 6)) for k, v in sd.items())[:2]) + "\\n")
    slow = float(os.environ.get("SEARCH_SLEEP", "0"))
    if slow:
        import time
        time.sleep(slow)
    return -sum(float((sd[k].double() - v.double()).norm()) for k, v in REF.items() if v.is_floating_point())


_n = [0]


def every_other(sd):
    _n[0] += 1
    if _n[0] % 2 == 0:
        raise ValueError("every other call fails")
    return closeness(sd)


def not_a_number(sd):
    return "high"
'''


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("search"), merged=False)


@pytest.fixture
def cat(built, tmp_path, monkeypatch):
    (tmp_path / "objective.py").write_text(OBJECTIVE)
    monkeypatch.setenv("SEARCH_REF", str(built.family / "expert_1"))
    c = Catalog(copy_catalog(built.db, tmp_path / "c.sqlite"))
    yield c
    c.close()


WITH_DENSITY = """
  - model: expert_1
    parameters: {weight: {range: [0.1, 1.0]}, density: {range: [0.2, 0.8]}}
  - model: expert_2
    parameters: {weight: {range: [0.1, 1.0]}, density: {range: [0.2, 0.8]}}
"""
WEIGHTS = """
  - model: expert_1
    parameters: {weight: {range: [0.1, 1.0]}}
  - model: expert_2
    parameters: {weight: {range: [0.1, 1.0]}}
"""


def space_file(tmp_path: Path, search: dict, models: str | None = None, method="[ties, task_arithmetic]",
               extra: str = "") -> Path:
    models = models or (WEIGHTS if method == "task_arithmetic" else WITH_DENSITY)
    search = {"objective": {"python": "objective.py:closeness"}, "seed": 3, **search}
    text = f"merge_method: {method}\nbase_model: base\nmodels:{models}{extra}\nsearch: {json.dumps(search)}\n"
    path = tmp_path / "space.yml"
    path.write_text(text)
    return path


def run(cat, path, **kw):
    return api.search(cat, api.load_search(path), **kw)


# --- spaces ----------------------------------------------------------------------------------------------
def test_space_dimensions_names_and_recipes(tmp_path):
    path = space_file(tmp_path, {"trials": 1}, models="""
  - model: expert_1
    parameters:
      weight: {range: [0.1, 1.0]}
      density: [{filter: self_attn, value: {range: [0.1, 0.9]}}, {value: 0.5}]
  - model: expert_2
    parameters: {weight: {range: [0.5, 2.0], log: true, name: w2}}
""", extra="\nparameters:\n  lambda: {choice: [0.5, 1.0, 1.5]}\n")
    (tmp_path / "objective.py").write_text(OBJECTIVE)
    sf = api.load_search(path)
    dims = {d.name: d for d in sf.space.dimensions}
    assert list(dims) == ["merge_method", "expert_1.weight", "expert_1.density[self_attn]", "w2", "lambda"]
    assert dims["merge_method"].choices == ("ties", "task_arithmetic")
    assert (dims["w2"].low, dims["w2"].high, dims["w2"].log) == (0.5, 2.0, True)
    assert dims["expert_1.density[self_attn]"].step == 0.01  # on ANALYZE's thresholds grid
    assert dims["lambda"].choices == (0.5, 1.0, 1.5)
    values = {"merge_method": "ties", "expert_1.weight": 0.3, "expert_1.density[self_attn]": 0.25, "w2": 1.5,
              "lambda": 1.0}
    assert sf.space.recipe(values) == {
        "merge_method": "ties", "base_model": "base",
        "models": [{"model": "expert_1", "parameters": {
                       "weight": 0.3, "density": [{"filter": "self_attn", "value": 0.25}, {"value": 0.5}]}},
                   {"model": "expert_2", "parameters": {"weight": 1.5}}],
        "parameters": {"lambda": 1.0}}
    # task_arithmetic takes no density: the whole filter list goes, the other dimensions stay
    values = {"merge_method": "task_arithmetic", "expert_1.weight": 0.3, "w2": 1.5, "lambda": 1.0}
    assert sf.space.recipe(values)["models"][0] == {"model": "expert_1", "parameters": {"weight": 0.3}}


@pytest.mark.parametrize("fragment,words", [
    ("weight: {range: [1.0, 0.1]}", "models[0].parameters.weight.range must have low < high"),
    ("weight: {range: [0.1]}", "models[0].parameters.weight.range must be [low, high]"),
    ("weight: {range: [0, 1], log: true}", "models[0].parameters.weight: a log range needs low > 0"),
    ("weight: {range: [0, 1], choice: [1]}", "models[0].parameters.weight: give either range or choice"),
    ("weight: {range: [0, 1], bins: 3}", "unknown key 'bins' in a search dimension"),
    ("weight: {choice: []}", "models[0].parameters.weight: choice must be a non-empty list"),
    ("wieght: {range: [0, 1]}", "wieght"),
])
def test_bad_spaces_are_one_error_naming_the_key(tmp_path, cat, fragment, words):
    path = space_file(tmp_path, {"trials": 1}, models=f"\n  - model: expert_1\n    parameters: {{{fragment}}}\n"
                                                      "  - model: expert_2\n", method="ties")
    db = Path(cat.path)
    before = dump_db(db)
    proc = subprocess.run([*cli_cmd(), "--db", str(db), "search", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr
    assert dump_db(db) == before


@pytest.mark.parametrize("search,words", [
    ({"sampler": "grid"}, "search.sampler 'grid' is unknown (choose from random, tpe, cmaes)"),
    ({"trials": 0}, "search.trials must be an integer from 1 to 10000"),
    ({"fidelities": ["50%", "10%"]}, "search.fidelities must rise"),
    ({"fidelities": ["512MiB"]}, "is not a share of the expert read"),
    ({"objective": {"python": "no_colon"}}, "search.objective.python must be module:function"),
    ({"objective": {"tasks": "missing.jsonl"}}, "search.objective: "),
    ({"pruner": "median"}, "search.pruner 'median' is unknown"),
    ({"trails": 3}, "unknown key 'trails' in search"),
])
def test_bad_search_blocks_are_refused(tmp_path, cat, search, words):
    path = space_file(tmp_path, search)
    with pytest.raises(ConfigError) as exc:
        api.load_search(path)
    assert words in str(exc.value)
    assert "\n" not in str(exc.value)


def test_unknown_model_is_refused_before_anything_is_recorded(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 2}, models="\n  - model: expert_1\n    parameters: {weight: {range: [0, 1]}}"
                                                      "\n  - model: nobody\n", method="linear")
    before = dump_db(Path(cat.path))
    with pytest.raises(ConfigError, match="'nobody' is neither a registered model id nor an existing path"):
        run(cat, path)
    assert dump_db(Path(cat.path)) == before


# --- trials ----------------------------------------------------------------------------------------------
def test_same_seed_same_trials(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 6, "sampler": "tpe", "fidelities": ["30%", "100%"]})
    first = run(cat, path)
    second = run(cat, path)
    strip = [(t["number"], t["params"], t["status"], t["score"]) for t in first["trials"]]
    assert strip == [(t["number"], t["params"], t["status"], t["score"]) for t in second["trials"]]
    assert first["id"] != second["id"]
    assert len({json.dumps(t["params"], sort_keys=True) for t in first["trials"]}) == 6
    path = space_file(tmp_path, {"trials": 6, "sampler": "tpe", "fidelities": ["30%", "100%"], "seed": 4})
    assert [t["params"] for t in run(cat, path)["trials"]] != [t["params"] for t in first["trials"]]


def test_in_memory_trial_equals_the_published_merge_bit_for_bit(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 3, "fidelities": ["40%"]}, method="ties")
    res = run(cat, path)
    best = res["best"]
    assert best["fidelity"] == "40%" and best["recipe"].endswith("mergepipe:\n  budget: 40%\n")
    # the trial's merge, again in memory from its recorded plan, and the recipe published as a snapshot
    step = res["trials"][best["trial"]]["steps"][-1]
    recipe = yaml.safe_load(best["recipe"])
    (tmp_path / "best.yml").write_text(best["recipe"])
    plan = api.plan_config(cat, tmp_path / "best.yml", save=False)
    assert plan.id == step["plan_id"]
    memory = api.merge_in_memory(cat, plan)
    published = api.search_publish(cat, res["id"], tmp_path / "out")
    assert published[0]["model_id"] == f"{res['name']}-{res['id'][len('search-'):][:6]}-best"
    on_disk = load_dir(Path(published[0]["out"]))
    assert set(on_disk) == set(memory.tensors)
    for name, t in on_disk.items():
        assert torch.equal(t, memory.tensors[name]), name
    assert memory.expert_read == step["expert_read"]
    assert {"parent_id": res["id"], "role": "search", "weight": None} in api.parents_of(cat, published[0]["model_id"])
    assert recipe["merge_method"] == "ties"
    shown = api.search_show(cat, res["id"])
    assert shown["trials"][best["trial"]]["snapshot_id"] == published[0]["snapshot_id"]


def test_budget_as_fidelity_reads_less_and_records_each_step(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 6, "fidelities": ["20%", "50%", "100%"], "pruner": "none"},
                      method="task_arithmetic")
    res = run(cat, path)
    for t in res["trials"]:
        assert [s["budget"] for s in t["steps"]] == ["20%", "50%", "100%"]
        reads = [s["expert_read"] for s in t["steps"]]
        assert reads[0] < reads[1] < reads[2] == t["steps"][2]["full_expert_bytes"]
        for s in t["steps"]:
            plan_budget = float(s["budget"].rstrip("%")) / 100 * s["full_expert_bytes"]
            assert s["expert_read"] <= plan_budget + 1
        assert t["steps"][0]["error_bound"] > t["steps"][1]["error_bound"] > t["steps"][2]["error_bound"] == 0
        assert t["expert_read"] == sum(reads)
        assert t["score"] == t["steps"][-1]["score"]


def test_successive_halving_promotes_by_rank(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 10, "sampler": "random", "fidelities": ["20%", "100%"],
                                 "pruner": "successive_halving"}, method="task_arithmetic")
    res = run(cat, path)
    seen = []
    for t in res["trials"]:  # one at a time: each trial competes with the rung-1 scores reported before it
        first = t["steps"][0]["score"]
        seen.append(first)
        ranked = sorted(seen, reverse=True)
        promotable = ranked[max(0, len(seen) // 2 - 1)]
        assert (t["status"] == "complete") == (first >= promotable), (t["number"], first, ranked)
        assert len(t["steps"]) == (2 if t["status"] == "complete" else 1)
    statuses = [t["status"] for t in res["trials"]]
    assert "pruned" in statuses and "complete" in statuses
    # a pruned trial read only the low budget
    pruned = [t for t in res["trials"] if t["status"] == "pruned"]
    assert all(t["expert_read"] == t["steps"][0]["expert_read"] for t in pruned)


def test_a_failing_objective_fails_its_trial_and_the_search_goes_on(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 4, "objective": {"python": "objective.py:every_other"}},
                      method="task_arithmetic")
    seen = []
    res = run(cat, path, on_trial=seen.append)
    assert [t["status"] for t in res["trials"]] == ["complete", "failed", "complete", "failed"]
    failed = res["trials"][1]
    assert failed["error"] == "every_other raised ValueError: every other call fails"
    assert failed["score"] is None
    assert res["status"] == "finished" and res["best"]["trial"] in (0, 2)
    assert [r["status"] for r in seen] == ["complete", "failed", "complete", "failed"]
    path = space_file(tmp_path, {"trials": 1, "objective": {"python": "objective.py:not_a_number"}},
                      method="task_arithmetic")
    res = run(cat, path)
    assert res["trials"][0]["error"] == "not_a_number returned str, not a number"
    assert res["best"] is None


def test_python_objective_scores_the_merged_weights(tmp_path, cat, built):
    path = space_file(tmp_path, {"trials": 2}, method="task_arithmetic")
    res = run(cat, path)
    best = res["best"]
    published = api.search_publish(cat, res["id"], tmp_path / "out")
    merged, ref = load_dir(Path(published[0]["out"])), load_dir(built.family / "expert_1")
    expected = -sum(float((merged[k].double() - v.double()).norm()) for k, v in ref.items() if v.is_floating_point())
    assert math.isclose(best["score"], expected, rel_tol=1e-12)


def test_task_suite_and_perplexity_objectives_with_a_held_out_split(tmp_path, cat):
    suite = [{"task": "mc", "prompt": f"t{i}", "choices": [f"t{i + 1}", f"t{i + 2}"], "answer": i % 2}
             for i in range(5, 17)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in suite[:6]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in suite[6:]))
    (tmp_path / "text.txt").write_text("t5 t6 t7 t8 t9 t10 t11 t12 t13 t14 " * 4)
    path = space_file(tmp_path, {"trials": 2, "objective": {"tasks": "val.jsonl"}, "holdout": {"tasks": "test.jsonl"}},
                      method="task_arithmetic")
    res = run(cat, path)
    out = api.search_publish(cat, res["id"], tmp_path / "out")[0]["out"]
    model, tok = load_model(out), load_tokenizer(out)
    best = res["best"]
    assert best["score"] == score_task_suite(model, read_task_suite(tmp_path / "val.jsonl"), tok)["mean"]
    assert best["holdout"] == score_task_suite(model, read_task_suite(tmp_path / "test.jsonl"), tok)["mean"]
    path = space_file(tmp_path, {"trials": 1, "objective": {"text": "text.txt", "window": 16, "max_tokens": 64}},
                      method="task_arithmetic")
    res = run(cat, path)
    trial = res["trials"][0]
    recipe_model = api.search_publish(cat, res["id"], tmp_path / "out2")[0]["out"]
    ppl = perplexity(recipe_model, (tmp_path / "text.txt").read_text(), window=16, max_tokens=64)["perplexity"]
    assert math.isclose(trial["score"], -ppl, rel_tol=1e-6)


# --- the command line and resume ---------------------------------------------------------------------------
def test_cli_json_names_the_best_parameters(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 3}, method="task_arithmetic",
                      extra="\nparameters:\n  lambda: {range: [0.5, 1.5]}\n")
    proc = subprocess.run([*cli_cmd(), "--db", cat.path, "--json", "search", str(path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    best = res["best"]
    assert set(best["params"]) == {"expert_1.weight", "expert_2.weight", "lambda"}
    assert 0.5 <= best["params"]["lambda"] <= 1.5
    assert best["score"] == max(t["score"] for t in res["trials"])
    assert proc.stderr.count("trial ") == 3
    shown = subprocess.run([*cli_cmd(), "--db", cat.path, "search", "show", res["id"]], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0 and f"best: trial {best['trial']}" in shown.stdout
    listed = subprocess.run([*cli_cmd(), "--db", cat.path, "search", "list"], capture_output=True, text=True)
    assert res["id"] in listed.stdout


@pytest.mark.slow
def test_resume_after_sigkill_loses_no_trial_and_runs_none_twice(tmp_path, cat):
    calls = tmp_path / "calls.jsonl"
    path = space_file(tmp_path, {"trials": 6, "sampler": "random"}, method="task_arithmetic")
    env = {**os.environ, "SEARCH_CALLS": str(calls), "SEARCH_SLEEP": "0.6"}
    cmd = [*cli_cmd(), "--db", cat.path, "--json", "search"]
    proc = subprocess.Popen([*cmd, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        done = rows(Path(cat.path), "SELECT number FROM search_trials WHERE status = 'complete'")
        running = rows(Path(cat.path), "SELECT number FROM search_trials WHERE status = 'running'")
        if len(done) >= 2 and running:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = rows(Path(cat.path), "SELECT number, status, params FROM search_trials ORDER BY number")
    finished = {r["number"]: r["params"] for r in killed if r["status"] == "complete"}
    interrupted = [r for r in killed if r["status"] == "running"]
    assert len(finished) >= 2 and len(interrupted) == 1
    calls_before = calls.read_text().splitlines()
    search_id = rows(Path(cat.path), "SELECT id FROM searches")[0]["id"]
    resumed = subprocess.run([*cmd, "--resume", search_id], capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    res = json.loads(resumed.stdout)
    assert [t["number"] for t in res["trials"]] == list(range(6))
    assert all(t["status"] == "complete" for t in res["trials"])
    for number, params in finished.items():  # kept as they were
        assert json.dumps(res["trials"][number]["params"], sort_keys=True) == params
    # the interrupted trial ran again with its own parameters; each finished trial's merge ran once
    assert json.dumps(res["trials"][interrupted[0]["number"]]["params"], sort_keys=True) == interrupted[0]["params"]
    calls_after = calls.read_text().splitlines()
    assert len(calls_after) - len(calls_before) == 6 - len(finished)
    assert len(calls_after) in (6, 7)  # 7 when the killed trial had already been scored


def test_a_v10_catalog_gets_the_search_tables(tmp_path, cat):
    for t in ("searches", "search_trials", "search_steps"):
        cat.conn.execute(f"DROP TABLE {t}")
    cat.conn.execute("UPDATE meta SET value = '10' WHERE key = 'schema_version'")
    cat.conn.commit()
    path = Path(cat.path)
    cat.close()
    again = Catalog(path)
    try:
        assert again.query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"] == "13"
        assert api.searches(again) == []
    finally:
        again.close()


@pytest.mark.parametrize("sampler", ["random", "cmaes"])
def test_every_sampler_runs_seeded(tmp_path, cat, sampler):
    path = space_file(tmp_path, {"trials": 4, "sampler": sampler}, method="task_arithmetic")
    first, second = run(cat, path), run(cat, path)
    assert [t["params"] for t in first["trials"]] == [t["params"] for t in second["trials"]]
    assert all(t["status"] == "complete" for t in first["trials"])
    assert len({t["params"]["expert_1.weight"] for t in first["trials"]}) == 4


def test_a_finished_search_publishes_and_shows_after_its_objective_file_is_gone(tmp_path, cat):
    path = space_file(tmp_path, {"trials": 2}, method="task_arithmetic")
    res = run(cat, path)
    (tmp_path / "objective.py").unlink()
    published = api.search_publish(cat, res["id"], tmp_path / "out")
    assert published[0]["trial"] == res["best"]["trial"]
    assert api.search_show(cat, res["id"])["trials"][res["best"]["trial"]]["snapshot_id"] == published[0]["snapshot_id"]
    assert set(api.search_parameter_importance(cat, res["id"])) <= {"expert_1.weight", "expert_2.weight"}


def test_a_space_with_a_model_of_another_shape_is_refused_by_the_preflight(tmp_path, cat):
    from mergepipe.research.family import make_family
    other = make_family(tmp_path / "other", experts=1, size="small", dtype="fp32")["experts"][0]
    path = space_file(tmp_path, {"trials": 2}, method="task_arithmetic",
                      models=f"\n  - model: expert_1\n    parameters: {{weight: {{range: [0.1, 1.0]}}}}"
                             f"\n  - model: {other}\n")
    before = dump_db(Path(cat.path))
    with pytest.raises(ConfigError, match="preflight found .* the trials would meet; the first: "):
        run(cat, path)
    assert dump_db(Path(cat.path)) == before
