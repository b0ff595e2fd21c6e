"""Interpolation methods over different vocabularies (issue 15), end to end against mergekit 0.1.5.

The added-tokens family (tests/vocab_helpers.py) with the experts' embed_tokens/lm_head (and one attention
matrix, whose statistics come from the catalog as usual) moved far from the base's (``spread``): the
family's own deltas are so small that slerp would take its linear branch and the whole-tensor angles would
not matter. Merged from one mergekit YAML by MergePipe (the re-ordered tensors' Gram statistics taken from
their composed rows at merge time, engine/vocab.py) and by mergekit in-process. Asserted per method: every
embedding/lm_head row per token and every other tensor within the README's Interpolation table
tolerance (max |MergePipe - mergekit| in float32 ulps of the tensor's largest |value|), the same
vocabulary, config.json vocab_size and tokenizer; the plan records where those coefficients come from
and re-plans to the same digest; a budget keeps the documented semantics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from mergepipe.catalog.db import Catalog
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import TensorInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
from mergekit_runner import mergekit_merge  # noqa: E402
from vocab_helpers import VOCAB_TENSORS, added_tokens_family, mergepipe_merge, same_vocabulary  # noqa: E402

EPS32 = 2.0 ** -23


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab-interp"), spread=1.0)


def _models(fam, n: int, weights=None, with_base=False) -> list[dict]:
    base, experts = fam
    models = [{"model": str(base)}] if with_base else []
    for i in range(n):
        models.append({"model": str(experts[i]), **({"parameters": {"weight": weights[i]}} if weights else {})})
    return models


# method settings, and the README's Interpolation-table tolerance in ulps (None: bit-equal); karcher's
# 1-D tensors (layer norms) within 6e-4 of their largest value, as the table states
CASES = {
    "slerp": (lambda f: {"models": _models(f, 1, with_base=True), "parameters": {"t": 0.3}}, 1.1),
    "slerp-gradient": (lambda f: {"models": _models(f, 1, with_base=True), "parameters": {"t": [0.2, 0.9, 0.4]}},
                       1.1),
    "nearswap": (lambda f: {"models": _models(f, 1, with_base=True), "parameters": {"t": 0.002}}, None),
    "ram": (lambda f: {"models": _models(f, 3)}, None),
    "nuslerp": (lambda f: {"models": _models(f, 2, [0.3, 0.7])}, 0.4),
    "nuslerp-rows": (lambda f: {"models": _models(f, 2, [0.6, 0.4]), "parameters": {"nuslerp_flatten": False}},
                     None),
    "model_stock": (lambda f: {"models": _models(f, 3)}, 1.7),
    "model_stock-filter_wise": (lambda f: {"models": _models(f, 3), "parameters": {"filter_wise": True}}, 0.9),
    # mergekit's float32 tangent-step residue grows with the tensor: 1.8 ulp on these 16 K-entry embeddings
    # (MergePipe's result is within 0.9 ulp of the float64 one there, mergekit's within 1.5)
    "multislerp": (lambda f: {"models": _models(f, 2, [0.5, 0.3])}, 2.0),
    "karcher": (lambda f: {"models": _models(f, 3)}, 4.0),
}
RUNS = [(case, tokenizer) for case in CASES for tokenizer in ("union", "base")]


def config_text(fam, case: str, tokenizer: str, budget: str | None = None) -> str:
    base, _ = fam
    doc = {"merge_method": case.split("-")[0], "base_model": str(base), "dtype": "float32",
           "tokenizer_source": tokenizer, **CASES[case][0](fam)}
    if budget:
        doc["mergepipe"] = {"budget": budget}
    return yaml.safe_dump(doc, sort_keys=False)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32 ulps of b's largest |value|."""
    scale = float(b.abs().max())
    return float((a.double() - b.double()).abs().max()) / (EPS32 * scale) if scale else 0.0


def within(case: str, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    tol = CASES[case][1]
    if tol is None:
        assert torch.equal(a, b), (case, name, ulps(a, b))
    elif case == "karcher" and a.ndim == 1:  # mergekit's float32 `theta < tol` branch (README)
        assert float((a - b).abs().max()) <= 6e-4 * float(b.abs().max()), (case, name)
    else:
        assert ulps(a, b) <= tol, (case, name, ulps(a, b))


@pytest.mark.parametrize("case, tokenizer", RUNS)
def test_parity_with_mergekit(fam, tmp_path, case, tokenizer):
    text = config_text(fam, case, tokenizer)
    mk = mergekit_merge(text, tmp_path / "mk", copy_tokenizer=True)
    cat, plan, manifest, mp = mergepipe_merge(tmp_path, text)
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mp"), local_files_only=True)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mk"), local_files_only=True)
    a, b = same_vocabulary(ours, theirs)
    vocab = plan["tokenizer"]["vocab"]
    assert vocab["tokens_n"] == len(a) == (256 if tokenizer == "base" else vocab["tokens_n"])
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    assert set(mp) == set(mk)
    for name in sorted(mk):
        assert mp[name].shape == mk[name].shape, name
        if name in VOCAB_TENSORS:
            ours_ids = torch.tensor([a[t] for t in a])
            theirs_ids = torch.tensor([b[t] for t in a])
            within(case, name, mp[name][ours_ids], mk[name][theirs_ids])  # row by row, per token
        else:
            within(case, name, mp[name], mk[name])
    cfg_mp, cfg_mk = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "mp", tmp_path / "mk"))
    assert cfg_mp["vocab_size"] == cfg_mk["vocab_size"] == vocab["rows"]
    assert ours.chat_template == theirs.chat_template
    if (case, tokenizer) == ("slerp", "base"):  # the rows are far apart: slerp's spherical branch, not a lerp
        base, expert = (load_file(str(p / "model.safetensors")) for p in (fam[0], fam[1][0]))
        lerp = 0.7 * base["lm_head.weight"] + 0.3 * expert["lm_head.weight"][:256]
        assert ulps(lerp, mk["lm_head.weight"]) > 1000
    gram_method = case.split("-")[0] not in ("nearswap", "ram")
    assert set(plan.data.get("composed_coefficients", {})) == (set(VOCAB_TENSORS) if gram_method else set())
    cat.close()


def test_plan_says_where_the_embedding_coefficients_come_from(fam, tmp_path):
    text = config_text(fam, "slerp", "union")
    cat = Catalog(tmp_path / "c.sqlite")
    plan, _ = plan_from_config(cat, parse_config(text, "interp.yml"))
    composed = plan["composed_coefficients"]
    assert sorted(composed) == sorted(VOCAB_TENSORS) and composed["lm_head.weight"]["t"] == 0.3
    assert not set(VOCAB_TENSORS) & set(plan["coefficients"])  # the catalog holds no statistics of those rows
    assert "model.layers.0.self_attn.q_proj.weight" in plan["coefficients"]
    assert ("  coefficients of lm_head.weight, model.embed_tokens.weight: from the composed rows at merge time "
            "(their Gram statistics, computed in memory from the rows read in full for every model; no extra "
            "read)") in plan.explain()
    again, _ = plan_from_config(cat, parse_config(text, "again.yml"), save=False)
    assert again.digest == plan.digest
    other, _ = plan_from_config(cat, parse_config(text.replace("t: 0.3", "t: 0.4"), "t.yml"), save=False)
    assert other.digest != plan.digest  # the recorded settings are in the digest
    cat.close()


def test_budget_keeps_the_embedding_rows_and_reads_its_plan(fam, tmp_path):
    """At 50 %: the re-ordered tensors are read in full for every model (reserved first) and merged as at full
    budget; the other tensors are read jointly (both models or neither); omitted blocks keep the base."""
    (tmp_path / "full").mkdir()
    (tmp_path / "half").mkdir()
    _, full_plan, _, full = mergepipe_merge(tmp_path / "full", config_text(fam, "slerp", "union"))
    cat, plan, manifest, half = mergepipe_merge(tmp_path / "half", config_text(fam, "slerp", "union", "50%"))
    assert plan["budget"]["bytes"] == plan["full_expert_bytes"] // 2
    assert manifest.core["realized_by_expert"] == plan["expert_read_by_expert"]
    for name in VOCAB_TENSORS:
        assert torch.equal(half[name], full[name]), name
    assert plan["omitted"] and not set(VOCAB_TENSORS) & set(plan["omitted"])
    base = load_file(str(fam[0] / "model.safetensors"))
    for name, ranges in plan["omitted"].items():
        info = TensorInfo(name, "F32", tuple(base[name].shape), "", 0, base[name].numel() * 4)
        spans = tensor_grid(info, plan["grid"]["block_bytes"])
        for lo, hi in ranges:
            rows = slice(spans[lo].row_start, spans[hi - 1].row_end)
            assert torch.equal(half[name][rows], base[name][rows]), name
    assert any(not torch.equal(half[n], full[n]) for n in half if n not in VOCAB_TENSORS)
    cat.close()
