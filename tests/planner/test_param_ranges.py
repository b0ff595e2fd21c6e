"""Every parameter is range-checked (issue 14): through the API (MergeRequest, the planner, ANALYZE) and
the command line, every out-of-range value -- NaN included -- is one PlanError/CatalogError naming the
parameter, the value and the allowed range; the CLI prints one `error:` line, exits 2 and leaves the
catalog as it was."""

from __future__ import annotations

import math

import pytest

from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.errors import CatalogError, PlanError
from mergepipe.planner.context import Planner
from mergepipe.planner.request import MergeRequest

from merge_helpers import copy_catalog, dump_db, open_copy, run_cli, shared_family

NAN, INF = math.nan, math.inf

# (operator, settings, words of the message); each one class of bad input
BAD_REQUESTS = [
    ("task_arithmetic", dict(lam=NAN), "lambda must be a finite number, not nan"),
    ("task_arithmetic", dict(lam=INF), "lambda must be a finite number, not inf"),
    ("linear", dict(weights=[1.0, NAN]), "weight of e2 must be a finite number, not nan"),
    ("linear", dict(weights=[1.0, -INF]), "weight of e2 must be a finite number"),
    ("linear", dict(weights=[1.0, -1.0]), "the weights sum to 0; normalize divides by their sum"),
    ("linear", dict(weights=[0.0, 0.0]), "the weights sum to 0"),
    ("task_arithmetic", dict(weights=[2.0, -2.0], normalize=True), "the weights sum to 0"),
    ("ties", dict(density=0.0), "density 0 of e1 is outside (0, 1]"),
    ("ties", dict(density=1.5), "density 1.5 of e1 is outside (0, 1]"),
    ("ties", dict(density=NAN), "density of e1 must be a finite number, not nan"),
    ("dare_linear", dict(density=-0.5), "density -0.5 of e1 is outside (0, 1]"),
    ("breadcrumbs", dict(gamma=2.0, density=0.3), "gamma 2 is outside the range [0, 1] of gamma"),
    ("breadcrumbs", dict(gamma=NAN, density=0.3), "gamma nan is outside the range [0, 1] of gamma"),
    ("breadcrumbs_ties", dict(gamma=-0.1, density=0.3), "gamma -0.1 is outside the range [0, 1]"),
    ("breadcrumbs", dict(gamma=0.6, density=0.5), "breadcrumbs needs gamma + density <= 1 (gamma 0.6 + density 0.5 of e1"),
    ("della", dict(epsilon=0.7, density=0.5), "epsilon 0.7 is outside the range [0, 0.5] of epsilon"),
    ("della", dict(epsilon=NAN, density=0.5), "epsilon nan is outside the range [0, 0.5] of epsilon"),
    ("della_linear", dict(epsilon=0.1, density=0.95), "della needs 0 < density - epsilon and density + epsilon <= 1"),
    ("della", dict(epsilon=0.3, density=0.2), "della needs 0 < density - epsilon"),
    ("linear", dict(seed=-1), "seed -1 is outside the range [0, 18446744073709551615] of seed"),
    ("linear", dict(seed=1.5), "seed must be an integer in [0, 18446744073709551615], not 1.5"),
    ("linear", dict(seed=NAN), "seed must be an integer"),
    ("linear", dict(seed=True), "seed must be an integer"),
]


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


@pytest.mark.parametrize("op, kw, words", BAD_REQUESTS, ids=[f"{o}-{'-'.join(k)}-{i}" for i, (o, k, _) in
                                                          enumerate(BAD_REQUESTS)])
def test_bad_parameter_refused_by_the_request(op, kw, words):
    with pytest.raises(PlanError) as exc:
        MergeRequest.build("base", ["e1", "e2"], op, **kw)
    assert words in str(exc.value)
    with pytest.raises(PlanError):  # the API's keyword convenience builds the same request
        api.merge_request("base", ["e1", "e2"], op, **kw)


def test_good_edges_are_accepted():
    MergeRequest.build("base", ["e1", "e2"], "breadcrumbs", gamma=0.5, density=0.5)  # gamma + density == 1
    MergeRequest.build("base", ["e1", "e2"], "breadcrumbs", gamma=0.01)  # density 1 (default): all but the top
    MergeRequest.build("base", ["e1", "e2"], "della", epsilon=0.1, density=0.9)
    MergeRequest.build("base", ["e1", "e2"], "ties", weights=[1.0, -1.0])  # consensus: no division by the sum
    MergeRequest.build("base", ["e1", "e2"], "task_arithmetic", weights=[1.0, -1.0])  # normalize off
    MergeRequest.build("base", ["e1", "e2"], "linear", weights=[1.0, -1.0], normalize=False)
    assert MergeRequest.build("base", ["e1"], "linear", seed=7.0).seed == 7
    assert MergeRequest.build("base", ["e1"], "linear", seed=2**64 - 1).seed == 2**64 - 1


def test_weights_summing_to_zero_on_some_tensors_are_refused_naming_one(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    experts = [{"model": "e1", "weight": [{"filter": "self_attn", "value": -1.0}, {"value": 1.0}]}, "e2"]
    MergeRequest.build("base", experts, "linear")  # per tensor: the planner sums them per tensor
    with pytest.raises(PlanError, match=r"the weights sum to 0 on model\.layers\.\d+\.self_attn\.[\w.]+; normalize"):
        Planner(cat).plan("base", experts, "linear", save=False)
    Planner(cat).plan("base", experts, "linear", normalize=False, save=False)
    cat.close()


@pytest.mark.parametrize("kw, words", [
    (dict(densities=[2.0]), "--densities: 2.0 is outside the range (0, 1] of densities"),
    (dict(densities=[0.0]), "--densities: 0.0 is outside the range (0, 1]"),
    (dict(densities=[NAN]), "--densities: nan is outside the range (0, 1]"),
    (dict(sketch_size=0), "--sketch-size must be positive: 0 is outside the range [1, inf)"),
    (dict(sketch_size=-3), "--sketch-size must be positive"),
    (dict(sketch_size=2.5), "--sketch-size must be a positive integer, not 2.5"),
    (dict(block_bytes=0), "--block-bytes must be positive: 0 is outside the range [1, inf)"),
    (dict(block_bytes=-4096), "--block-bytes must be positive"),
])
def test_bad_analyze_settings_refused_before_anything(fam, tmp_path, kw, words):
    db = copy_catalog(fam, tmp_path / "c.sqlite")
    before = dump_db(db)
    cat = api.Catalog(db)
    with pytest.raises(CatalogError) as exc:
        analyze(cat, ["e1"], force=True, **kw)
    assert words in str(exc.value)
    with pytest.raises(CatalogError):  # also with no expert to analyze: checked first
        analyze(cat, [], **kw)
    cat.close()
    assert dump_db(db) == before


CLI_CASES = [
    (["plan", "--op", "task_arithmetic", "--lambda", "nan"], "lambda must be a finite number, not nan"),
    (["plan", "--op", "task_arithmetic", "--lambda", "inf"], "lambda must be a finite number"),
    (["plan", "--weights", "1", "nan"], "weight of e2 must be a finite number"),
    (["plan", "--weights", "1", "-1"], "the weights sum to 0"),
    (["plan", "--op", "ties", "--density", "0"], "density 0 of e1 is outside (0, 1]"),
    (["plan", "--op", "ties", "--density", "nan"], "density of e1 must be a finite number"),
    (["plan", "--op", "breadcrumbs", "--gamma", "2", "--density", "0.3"], "gamma 2 is outside the range [0, 1]"),
    (["plan", "--op", "breadcrumbs", "--gamma", "0.8", "--density", "0.3"], "gamma + density <= 1"),
    (["plan", "--op", "della", "--epsilon", "0.9", "--density", "0.5"], "epsilon 0.9 is outside the range [0, 0.5]"),
    (["plan", "--op", "della", "--epsilon", "0.1", "--density", "0.95"], "della needs"),
    (["plan", "--seed", "-1"], "seed -1 is outside the range"),
    (["merge", "--op", "task_arithmetic", "--lambda", "nan", "--out", "{tmp}/m"], "lambda must be a finite number"),
    (["merge", "--weights", "2", "-2", "--out", "{tmp}/m"], "the weights sum to 0"),
    (["analyze", "e1", "--densities", "2.0"], "--densities: 2.0 is outside the range (0, 1]"),
    (["analyze", "e1", "--densities", "nan"], "--densities: nan is outside the range (0, 1]"),
    (["analyze", "--sketch-size", "0"], "--sketch-size must be positive"),
    (["analyze", "e1", "--block-bytes", "0", "--force"], "--block-bytes must be positive"),
]


@pytest.mark.parametrize("args, words", CLI_CASES, ids=[" ".join(a[:1] + a[1:3]) + f"-{i}"
                                                        for i, (a, _) in enumerate(CLI_CASES)])
def test_cli_bad_parameter_is_one_error_line_exit_2(fam, tmp_path, args, words):
    db = copy_catalog(fam, tmp_path / "c.sqlite")
    before = dump_db(db)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if args[0] in ("plan", "merge"):
        args = [args[0], "--base", "base", "--experts", "e1", "e2", *args[1:]]
    r = run_cli(["--db", db, *args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert words in lines[0]
    assert dump_db(db) == before
    assert not (tmp_path / "m").exists()


def test_yaml_nan_and_out_of_range_are_refused():
    from mergepipe.config.parse import parse_config
    from mergepipe.errors import MergePipeError
    head = "merge_method: breadcrumbs\nbase_model: b\nmodels:\n  - model: e\n    parameters: {density: 0.3}\n"
    for text, words in ((head + "parameters:\n  lambda: .nan\n", "finite"),
                        (head + "parameters:\n  gamma: .nan\n", "finite"),
                        (head + "parameters:\n  gamma: 2\n", "outside the range [0, 1] of gamma")):
        with pytest.raises(MergePipeError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_config(text, "c.yaml")
