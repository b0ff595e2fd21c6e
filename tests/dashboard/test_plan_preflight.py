"""The Plan page shows the preflight of a loaded mergekit config (dashboard/preflight.py, pages/plan.py): one table
row per model, what the merge will meet, and one error per problem, also when the page cannot take the config's
settings (models not registered yet). AppTest against the tiny analyzed family (dashboard_helpers.py)."""

from __future__ import annotations

import torch

from dashboard_helpers import open_page
from hub_server import _variant


def _table(at):
    """The preflight table (display-only tables have no key in AppTest: found by its own columns)."""
    for el in at.dataframe:
        if {"vs base", "fetched"} <= set(el.value.columns):
            return el.value
    raise AssertionError("no preflight table")


def _load(at, path):
    at.text_input(key="mk_path").input(str(path))
    at.button(key="mk_load").click().run()
    assert not at.exception, [e.value for e in at.exception]


def _expander_labels(at) -> list[str]:
    return [e.label for e in at.expander]


def test_a_loaded_config_shows_its_preflight_table(env, built):
    fam = built.family
    cfg = env["tmp"] / "merge.yml"
    cfg.write_text(f"merge_method: ties\nbase_model: {fam / 'base'}\nmodels:\n"
                   f"  - model: {fam / 'expert_1'}\n    parameters: {{weight: 1.0, density: 0.5}}\n"
                   f"  - model: expert_2\n    parameters: {{weight: 1.0, density: 0.5}}\n")
    at = open_page("plan")
    assert not any(label.startswith("Preflight") for label in _expander_labels(at))
    _load(at, cfg)
    assert [s.value for s in at.success] == ["Loaded merge.yml: ties of expert_1, expert_2 on base."]
    assert not at.error, [e.value for e in at.error]
    assert "Preflight of merge.yml: the merge will run (read 0 bytes of headers)." in _expander_labels(at)
    df = _table(at)
    assert df["model"].tolist() == [str(fam / "base"), str(fam / "expert_1"), "expert_2"]
    assert df["role"].tolist() == ["base", "model", "model"]
    assert df["from"].tolist() == ["catalog, local"] * 3
    assert df["vs base"].tolist() == ["-", "same layout", "same layout"]
    assert df["vocab"].tolist() == [256] * 3 and df["lm_head"].tolist() == ["own"] * 3
    summary = next(c.value for c in at.code if c.value.startswith("output"))
    assert "106,816 parameters (the base's)" in summary and "transfer 0 B" in summary


def test_problems_show_as_errors_even_when_the_settings_cannot_load(env, built):
    fam, tmp = built.family, env["tmp"]
    _variant(fam / "expert_1", tmp / "shape", lambda t: {**t, "model.layers.0.mlp.up_proj.weight": torch.zeros(130, 64)})
    _variant(fam / "base", tmp / "tied", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
             lambda c: c.update(tie_word_embeddings=True))
    cfg = tmp / "bad.yml"
    cfg.write_text(f"merge_method: ties\nbase_model: {tmp / 'tied'}\nmodels:\n"
                   f"  - model: {tmp / 'shape'}\n    parameters: {{weight: 1.0, density: 0.5}}\n")
    at = open_page("plan")
    _load(at, cfg)
    errors = [e.value for e in at.error]
    assert any("not registered in the catalog" in e for e in errors), errors  # the settings: refused as before
    assert f"models[0].model {tmp / 'shape'}: does not match the base: model.layers.0.mlp.up_proj.weight: shape " \
           "[130, 64] != base [128, 64]" in errors
    assert any(e.startswith(f"models[0].model {tmp / 'shape'}: has its own lm_head.weight [256, 64] but the base ties "
                            "its embeddings") for e in errors), errors
    assert "Preflight of bad.yml: 2 problems, the merge would not run (read 0 bytes of headers)." \
        in _expander_labels(at)
    df = _table(at)
    assert df["lm_head"].tolist() == ["tied", "own"] and df["vs base"].tolist() == ["-", "1 differ"]
