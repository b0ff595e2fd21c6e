"""The one setting type (ops/setting.Setting): parse once, the value at a tensor, mergekit YAML, equality."""

import pytest

from mergepipe.errors import PlanError
from mergepipe.ops.setting import Setting, layer_t
from mergepipe.ops.spec import LAMBDA, Param
from mergepipe.planner.settings import check_setting, evaluate


def test_parse_keeps_the_recorded_plain_form():
    # the plain form is what requests and plans hash: exactly the old validator's output
    raw = [{"filter": "self_attn", "value": [0, 1]}, {"value": 0.5}]
    s = Setting.parse(raw, "weight")
    assert s.json == [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": None, "value": 0.5}]
    assert check_setting(raw, "weight") == s.json
    assert Setting.parse(2, "w").json == 2.0 and Setting.parse(2, "w").kind == "number"
    assert Setting.parse([1, 2], "w").kind == "gradient"
    assert s.kind == "conditions"


def test_at_reads_gradients_and_conditions():
    g = Setting.parse([0.0, 1.0], "t")
    name = "model.layers.3.mlp.up_proj.weight"
    assert g.at(name, layer_t(name, 5)) == pytest.approx(0.75)
    c = Setting.parse([{"filter": "mlp", "value": 0.2}], "w")
    assert c.at(name, 0.0) == 0.2 and c.at("model.embed_tokens.weight", 0.0) is None
    assert evaluate(c.json, name, 0.0) == evaluate(c, name, 0.0) == 0.2


def test_errors_name_the_setting():
    with pytest.raises(PlanError, match=r"weight\[1\] must be a \{filter, value\} condition"):
        Setting.parse([{"value": 1}, 2], "weight")
    with pytest.raises(PlanError, match="conditions cannot be nested"):
        Setting.parse([{"value": [{"value": 1}]}], "weight")
    with pytest.raises(PlanError, match="must be a finite number"):
        Setting.parse_param([1.0, float("inf")], LAMBDA)
    with pytest.raises(PlanError, match="outside the range"):
        Setting.parse_param([{"filter": "mlp", "value": 2.0}], Param("t", 0.5, "", low=0.0, high=1.0))
    with pytest.raises(PlanError, match="not a gradient"):
        Setting.parse_flag([1, 0], "normalize")


def test_flags_and_yaml():
    assert Setting.parse_flag(True, "normalize") is True
    f = Setting.parse_flag({"filter": "mlp", "value": True}, "normalize")
    assert f.json == [{"filter": "mlp", "value": 1.0}]
    assert f.to_yaml(flag=True) == [{"filter": "mlp", "value": True}]
    assert Setting.parse([1, 2], "w").to_yaml() == [1.0, 2.0]


def test_equality_and_hash_follow_the_plain_form():
    a = Setting.parse([{"filter": "x", "value": 1}], "w")
    b = Setting.from_json([{"value": 1.0, "filter": "x"}])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Setting.parse(1, "w")
