"""Operators declare themselves (issue 13, part 3): name, aliases, reference, enums for sparsification
and consensus, and parameters (default, range, help, per tensor). The command line's flags and help, the
YAML checks and the Plan page's widgets are generated from the declarations."""

from __future__ import annotations

import re

import pytest

from mergepipe import api
from mergepipe.cli.app import build_parser
from mergepipe.config.model import ConfigError, GLOBAL_PARAMS, MODEL_PARAMS
from mergepipe.config.parse import parse_config
from mergepipe.dashboard import views
from mergepipe.ops.core import OPERATORS, get_op, threshold_fractions
from mergepipe.ops.spec import Consensus, Param, Sparsify, all_parameters


def test_every_operator_declares_itself():
    assert list(OPERATORS) == ["linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs",
                               "breadcrumbs_ties", "della", "della_linear", "slerp", "nuslerp", "model_stock",
                               "multislerp", "karcher", "nearswap", "sce", "ram", "ramplus_tl", "passthrough",
                               "arcee_fusion"]
    for spec in OPERATORS.values():
        if spec.nonlinear:  # the interpolation methods (ops/interp.py): their own parameters only
            assert spec.joint and not spec.additive and spec.budget_semantics and spec.bound_note.startswith("n/a")
            assert {p.name for p in spec.parameters} <= {"weight"} | {p.name for p in spec.extras}
            assert spec.reference and all(isinstance(p, Param) and p.help for p in spec.parameters)
            continue
        assert spec.reference.startswith(("model soups", "task arithmetic", "TIES", "DARE", "model breadcrumbs",
                                          "DELLA")) and "arxiv.org" in spec.reference
        assert spec.sparsify is None or isinstance(spec.sparsify, Sparsify)
        assert isinstance(spec.consensus, Consensus)
        names = [p.name for p in spec.parameters]
        assert names[:1] == ["weight"] and {"lambda", "normalize", "rescale"} <= set(names)
        assert ("density" in names) == spec.uses_density
        assert all(isinstance(p, Param) and p.help for p in spec.parameters)
    assert get_op("ties").sparsify is Sparsify.MAGNITUDE and get_op("ties").consensus is Consensus.SIGN
    assert get_op("dare").name == "dare_ties" and get_op("AVG").name == "linear"
    assert get_op("breadcrumbs").sparsify == "magnitude_outliers"  # a str enum: compares with its value
    assert threshold_fractions(get_op("breadcrumbs"), 0.3, {"gamma": 0.01}) == [0.01, 0.31]
    assert threshold_fractions(get_op("ties"), 0.3, {}) == [0.3]
    assert threshold_fractions(get_op("della"), 0.3, {"epsilon": 0.1}) == []
    per_tensor = {p.name for p in all_parameters() if p.per_tensor}
    assert per_tensor == {"weight", "density"}
    assert get_op("della").parameters[-1].range_text() == "[0, 0.5]"


def _plan_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["plan"].format_help()


def test_cli_flags_and_help_list_every_declared_parameter():
    text = re.sub(r"\s+", " ", _plan_help())
    for p in all_parameters():
        assert p.option in text, p.name
        assert p.help in text, p.name
        if p.range_text():
            assert f"range {p.range_text()}" in text, p.name
        if p.kind is bool:
            assert f"--no-{p.name}" in text
    for spec in OPERATORS.values():
        assert spec.name in text
    assert "operators: breadcrumbs, breadcrumbs_ties" in text and "operators: della, della_linear" in text
    # and they parse into the request keywords
    parser = build_parser()
    args = parser.parse_args(["plan", "--base", "b", "--experts", "e", "--gamma", "0.02", "--lambda", "0.5",
                              "--no-normalize", "--weights", "1", "2"])
    assert (args.gamma, args.lam, args.normalize, args.weights, args.epsilon) == (0.02, 0.5, False, [1.0, 2.0], None)


def test_yaml_keys_come_from_the_declarations():
    assert set(GLOBAL_PARAMS) == {p.name for p in all_parameters()} | {"int8_mask"}
    assert set(MODEL_PARAMS) == {"weight", "density", "lambda", "gamma", "epsilon"}


@pytest.mark.parametrize("method, key, value, rng", [
    ("breadcrumbs", "gamma", 1.5, "[0, 1]"),
    ("breadcrumbs", "gamma", -0.1, "[0, 1]"),
    ("della", "epsilon", 0.7, "[0, 0.5]"),
])
def test_yaml_rejects_out_of_range_values_with_the_declared_range(method, key, value, rng):
    text = f"merge_method: {method}\nbase_model: b\nmodels:\n  - model: e\nparameters:\n  {key}: {value}\n"
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "c.yaml")
    msg = str(exc.value)
    assert msg.startswith("c.yaml: parameters.") and f"outside the range {rng} of {key}" in msg
    ok = text.replace(str(value), "0.05")
    assert getattr(parse_config(ok, "c.yaml"), key) == 0.05


def test_plan_page_widgets_come_from_the_declarations():
    for spec in OPERATORS.values():
        info = views.op_info(spec.name)
        assert [p["name"] for p in info["params"]] == [p.name for p in spec.parameters]
        assert info["reference"] == spec.reference
        main = {p["name"] for p in info["params"] if p["place"] == "main"}
        assert main == {p.name for p in spec.parameters} - {"weight", "lambda", "normalize", "rescale"}
        for p, d in zip(info["params"], spec.parameters):
            assert p["max"] == d.high and p["help"].startswith(d.help)
    b = {p["name"]: p for p in views.op_info("breadcrumbs")["params"]}
    assert (b["gamma"]["min"], b["gamma"]["max"], b["gamma"]["default"]) == (0.0, 1.0, 0.01)
    assert (b["density"]["min"], b["density"]["max"], b["density"]["default"]) == (0.01, 1.0, 0.5)


def test_api_exposes_the_declarations():
    assert [s.name for s in api.operators()] == list(OPERATORS)
    assert api.parameters() == all_parameters()


def test_config_overrides_take_the_declared_parameters():
    cfg = parse_config("merge_method: breadcrumbs\nbase_model: b\nmodels:\n  - model: e1\n  - model: e2\n", "c.yaml")
    new = cfg.with_overrides(weights=[2, 1], density=0.3, lam=0.5, normalize=True, gamma=0.02, budget="10%")
    assert [(m.weight, m.density) for m in new.models] == [(2.0, 0.3), (1.0, 0.3)]
    assert (new.lam, new.normalize, new.gamma, new.budget) == (0.5, True, 0.02, "10%")
    with pytest.raises(ConfigError, match="unknown parameter temperature"):
        cfg.with_overrides(temperature=1.0)
    with pytest.raises(ConfigError, match="3 weights given for the 2 models"):
        cfg.with_overrides(weights=[1, 2, 3])
