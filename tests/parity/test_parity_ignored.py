"""Parameters mergekit 0.1.5 accepts and ignores (issue 32, item 2): a merge-wide parameter given per model
(normalize, rescale, int8_mask, t, select_topk, lambda under a source, scale outside passthrough) and a
per-model one given for the base (DELLA's epsilon under the base's `sources:`, as mergekit's model card
renders a `modules: default: slices:` config). mergekit's output is bit-equal with and without them;
MergePipe accepts them with one `warning:` line per key and writes the same bits as without them (and, for
the deterministic task_arithmetic, the same bits as mergekit). What mergekit does read there (a non-base
source's epsilon) is still refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from mergepipe.config import ignored
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config

from mergekit_runner import merge_both, params_family

LAYERS = 2  # the tiny family's


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    f = params_family(tmp_path_factory, "ignored")
    yield f
    f["cat"].close()


def _module_slices(f, method: str, base_params: dict | None, expert_extra: dict | None = None) -> dict:
    """A `modules: default: slices:` config over every layer, the base listed last among the sources."""
    sources = [{"model": e, "layer_range": [0, LAYERS],
                "parameters": {"weight": w, "density": 0.5, **(expert_extra or {})}}
               for e, w in zip(f["experts"], (0.6, 1.3, 0.35))]
    base = {"model": f["base"], "layer_range": [0, LAYERS]}
    if base_params:
        base["parameters"] = base_params
    return {"merge_method": method, "base_model": f["base"], "dtype": "float32",
            "modules": {"default": {"slices": [{"sources": sources + [base]}]}},
            "parameters": {"normalize": True, "lambda": 1.0}, "mergepipe": {"seed": 7}}


def _models(f, method: str, extra: dict) -> dict:
    models = [{"model": e, "parameters": {"weight": w, "density": 0.5, **extra}}
              for e, w in zip(f["experts"], (0.6, 1.3, 0.35))]
    return {"merge_method": method, "base_model": f["base"], "dtype": "float32", "models": models,
            "mergepipe": {"seed": 7}}


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


BASE_KEYS = {"epsilon": 0.1, "lambda": 0.5, "normalize": False, "rescale": True, "int8_mask": True}


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_model_card_config_equals_itself_without_the_base_keys(fam, method, capsys):
    ignored._WARNED.clear()
    _, ours, theirs = merge_both(fam, _module_slices(fam, method, BASE_KEYS), f"{method}-with")
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("warning: ignoring")]
    assert len(lines) == len(BASE_KEYS), err
    for key in BASE_KEYS:
        assert any(f"`{key}` in slices[0].sources[3].parameters" in ln and "mergekit 0.1.5 ignores it too" in ln
                   for ln in lines), (key, err)
    _, ours0, theirs0 = merge_both(fam, _module_slices(fam, method, None), f"{method}-without")
    assert _equal(theirs, theirs0)  # mergekit: the keys change nothing
    assert _equal(ours, ours0)  # MergePipe: the same bits as without them


def test_task_arithmetic_slices_with_base_keys_bit_equal_to_mergekit(fam):
    _, ours, theirs = merge_both(fam, _module_slices(fam, "task_arithmetic", BASE_KEYS), "ta-slices")
    assert _equal(ours, theirs)


PER_MODEL = {"normalize": False, "rescale": True, "int8_mask": True, "t": 0.3, "select_topk": 0.5, "scale": 2.0}


def test_merge_wide_keys_per_model_are_ignored_like_mergekit(fam, capsys):
    ignored._WARNED.clear()
    _, ours, theirs = merge_both(fam, _models(fam, "task_arithmetic", PER_MODEL), "ta-per-model")
    err = capsys.readouterr().err
    assert sum(ln.startswith("warning: ignoring") for ln in err.splitlines()) == len(PER_MODEL) * 3, err
    _, ours0, theirs0 = merge_both(fam, _models(fam, "task_arithmetic", {}), "ta-plain")
    assert _equal(theirs, theirs0)
    assert _equal(ours, ours0)
    assert _equal(ours, theirs)


def test_what_mergekit_reads_is_still_refused(fam):
    cfg = _module_slices(fam, "della", None, expert_extra={"epsilon": 0.1})  # a non-base source's own epsilon
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_dump(cfg), source="d.yaml")
    assert "unsupported parameter `epsilon` in slices[0].sources[0].parameters" in str(err.value)
    slice_level = copy.deepcopy(_module_slices(fam, "ties", None))
    slice_level["modules"]["default"]["slices"][0]["parameters"] = {"normalize": False}  # mergekit reads it
    with pytest.raises(ConfigError):
        parse_config(yaml.safe_dump(slice_level), source="t.yaml")
    with pytest.raises(ConfigError, match="unsupported parameter `wieght`"):  # an unknown key: a typo
        parse_config(yaml.safe_dump(_models(fam, "ties", {"wieght": 1.0})), source="w.yaml")


def test_lambda_per_model_is_ignored_like_mergekit(fam, capsys):
    """mergekit's lambda is merge-wide (SHARED): per model it changes nothing, agreeing or not; MergePipe applied
    an agreeing one and refused differing ones before issue 32."""
    ignored._WARNED.clear()
    cfg = _models(fam, "task_arithmetic", {})
    for m, lam in zip(cfg["models"], (0.5, 0.5, 2.0)):
        m["parameters"]["lambda"] = lam
    plan, ours, theirs = merge_both(fam, cfg, "ta-lambda-per-model")
    err = capsys.readouterr().err
    assert [ln.split(":")[1].strip() for ln in err.splitlines() if ln.startswith("warning: ignoring")] == [
        f"ignoring `lambda` in models[{i}].parameters" for i in range(3)], err
    assert plan["params"]["lambda"] == 1.0
    _, _, theirs0 = merge_both(fam, _models(fam, "task_arithmetic", {}), "ta-lambda-none")
    assert _equal(theirs, theirs0)
    assert _equal(ours, theirs)
