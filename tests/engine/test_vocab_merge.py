"""Merges over different vocabularies (issue 15 item 4), end to end against mergekit 0.1.5.

A tiny Llama-shaped fp32 family whose experts add tokens (expert_1: ``<tool>``, ``<think>``; expert_2:
``<tool>``, ``<im>``; expert_3 none), their embed_tokens/lm_head grown by those rows, merged from one
mergekit YAML by MergePipe (config path: registration, analysis, plan, engine) and by mergekit itself
(tests/parity/mergekit_runner.py) with ``tokenizer_source: union``, ``base``, a named model and a
``tokenizer:`` block with ``tokens`` (model_token, zero, a model, ``force``) and ``pad_to_multiple_of``.
Asserted: the same vocabulary (token sets; ids of every token but the added ones, whose order
mergekit takes from a set of its models: the same ids in some order); every embedding/lm_head row bit-equal per token (fp32), padding rows within 1e-6 (a mean over
rows in another order); every other tensor bit-equal (ties: within 4 float32 ulps but for at most
0.1 % of entries, the known differences of tests/parity/test_parity_existing.py -- summation order,
entries tied at the cut-off -- which are not this feature's); config.json's vocab_size; the output tokenizer
loads with AutoTokenizer and round-trips the union vocabulary, with mergekit's chat template. A 50 %
budget reads exactly its plan (the embedding rows in full, reserved first) and gives the same rows;
remaining refusals name the key and leave the catalog unchanged.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config
from mergepipe.engine.engine import Engine
from mergepipe.errors import PlanError
from mergepipe.planner.context import Planner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
import mergekit  # noqa: E402,F401  (the reference; in the test extra)
from mergekit_runner import mergekit_merge  # noqa: E402
from vocab_helpers import TEMPLATE, VOCAB_TENSORS, added_tokens_family, same_vocabulary  # noqa: E402


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab"))


def config(fam, method: str, tokenizer: str, base_weight: float | None = None) -> str:
    base, experts = fam
    models = "".join(f"  - model: {e}\n    parameters: {{weight: {w}}}\n"
                     for e, w in zip(experts, (0.6, 1.3, 0.35)))
    if base_weight is not None:  # mergekit's linear with a tokenizer source averages the base in too
        models = f"  - model: {base}\n    parameters: {{weight: {base_weight}}}\n" + models
    return (f"merge_method: {method}\nbase_model: {base}\nmodels:\n{models}dtype: float32\n"
            + textwrap.dedent(tokenizer).format(e1=experts[0], e2=experts[1]))


def mergepipe_merge(tmp: Path, text: str, budget: str | None = None):
    cat = Catalog(tmp / "c.sqlite")
    cfg = parse_config(text + (f"mergepipe: {{budget: '{budget}'}}\n" if budget else ""), "vocab.yml")
    plan, _ = plan_from_config(cat, cfg)
    _, manifest = Engine(cat).execute(plan, out=tmp / "mp")
    return cat, plan, manifest, tmp / "mp"


TOKENS_BLOCK = """\
    tokenizer:
      source: union
      pad_to_multiple_of: 8
      tokens:
        <new>: {{source: {{kind: model_token, model: {e1}, token: t5}}}}
        <tool>: {{source: {e2}, force: true}}
        t7: {{source: {{kind: zero}}, force: true}}
        <think>: {{source: {{kind: model_token, model: {e2}, token_id: 9}}}}
    """
CASES = {
    "task_arithmetic-union": ("task_arithmetic", "tokenizer_source: union\n", None),
    "linear-union": ("linear", "tokenizer_source: union\n", 0.5),
    "ties-union": ("ties", "tokenizer_source: union\nparameters: {{density: 1.0}}\n", None),
    "ties-union-density": ("ties", "tokenizer_source: union\nparameters: {{density: 0.5}}\n", None),
    "ties-tokens-density": ("ties", TOKENS_BLOCK + "parameters: {{density: 0.3}}\n", None),
    "task_arithmetic-base": ("task_arithmetic", "tokenizer_source: base\n", None),
    "task_arithmetic-model": ("task_arithmetic", "tokenizer_source: {e2}\n", None),
    "linear-model": ("linear", "tokenizer_source: {e2}\n", 0.5),
    "task_arithmetic-tokens": ("task_arithmetic", TOKENS_BLOCK, None),
    "linear-tokens": ("linear", TOKENS_BLOCK, 0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_mergekit(fam, tmp_path, case):
    method, tok, base_weight = CASES[case]
    text = config(fam, method, tok, base_weight)
    mk = mergekit_merge(text, tmp_path / "mk", copy_tokenizer=True)
    cat, plan, manifest, out = mergepipe_merge(tmp_path, text)
    mp = load_file(str(out / "model.safetensors"))
    ours = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mk"), local_files_only=True)
    a, b = same_vocabulary(ours, theirs)
    n = len(a)
    vocab = plan["tokenizer"]["vocab"]
    assert vocab["tokens_n"] == n and manifest.core["tokenizer"]["vocab"] == vocab
    assert set(mp) == set(mk)
    for name in sorted(mp):
        assert mp[name].shape == mk[name].shape, name
        if name in VOCAB_TENSORS:
            assert mp[name].shape[0] == vocab["rows"]
            for t, i in a.items():
                assert torch.equal(mp[name][i], mk[name][b[t]]), (case, name, t)
            torch.testing.assert_close(mp[name][n:], mk[name][n:], rtol=1e-6, atol=1e-6)
        elif method == "ties":  # as tests/parity/test_parity_existing.py: summation order, cut-off ties
            off = (mp[name] - mk[name]).abs() > 4 * 2.0 ** -23 * float(mk[name].abs().max())
            assert int(off.sum()) <= max(2, off.numel() // 1000), (case, name, int(off.sum()))
        else:
            assert torch.equal(mp[name], mk[name]), (case, name)
    cfg_mp, cfg_mk = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "mk"))
    assert cfg_mp["vocab_size"] == cfg_mk["vocab_size"] == vocab["rows"]
    assert ours.chat_template == theirs.chat_template
    if "tokens" in case:
        assert vocab["rows"] % 8 == 0 and vocab["rows"] > n  # padded
        assert torch.equal(mp["model.embed_tokens.weight"][a["t7"]], torch.zeros(64))  # forced zero


def test_union_tokenizer_round_trips_and_explain(fam, tmp_path):
    text = config(fam, "task_arithmetic", "tokenizer_source: union\n")
    cat, plan, manifest, out = mergepipe_merge(tmp_path, text)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    vocab = tok.get_vocab()
    assert len(vocab) == 259 and [vocab[t] for t in ("<tool>", "<think>", "<im>")] == [256, 257, 258]
    ids = tok("t5 <tool> t9 <im> <think>")["input_ids"]
    assert ids == [5, 256, 9, 258, 257]
    assert tok.decode(ids).split() == ["t5", "<tool>", "t9", "<im>", "<think>"]
    assert tok.chat_template == TEMPLATE
    text_out = plan.explain()
    assert "tokenizer  union vocabulary of 259 tokens (sha256:" in text_out
    assert ("vocab rows lm_head.weight 259 x 64, model.embed_tokens.weight 259 x 64 re-ordered to it (rows not a "
            "model's own: expert_1 1, expert_2 1, expert_3 3, base 3)") in text_out
    assert "read in full for every model whatever the budget" in text_out
    # the vocabulary and row sources are in the digest: another source is another plan
    other = plan_from_config(cat, parse_config(config(fam, "task_arithmetic", "tokenizer_source: base\n"),
                                               "b.yml"), save=False)[0]
    assert other["tokenizer"]["vocab"]["tokens_n"] == 256 and other.digest != plan.digest
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 259


def test_budgeted_union_reads_its_plan_and_keeps_the_rows(fam, tmp_path):
    text = config(fam, "task_arithmetic", "tokenizer_source: union\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "half").mkdir()
    _, full_plan, _, full_out = mergepipe_merge(tmp_path / "full", text)
    cat, plan, manifest, out = mergepipe_merge(tmp_path / "half", text, budget="50%")
    reserved = {e["id"]: sum(t["nbytes"] for t in cat.tensors(e["id"]) if t["name"] in VOCAB_TENSORS)
                for e in plan["experts"]}
    assert plan["full_expert_bytes"] == full_plan["full_expert_bytes"]
    assert plan["budget"]["bytes"] == plan["full_expert_bytes"] // 2
    realized = manifest.core["realized_by_expert"]
    assert realized == plan["expert_read_by_expert"]  # exactly the plan (the engine refuses otherwise)
    assert sum(realized.values()) <= plan["budget"]["bytes"] < full_plan["estimate"]["expert_read"]
    for eid, n in reserved.items():  # the embedding rows are read in full, whatever the budget
        assert manifest.core["realized_by_tensor"]["model.embed_tokens.weight"] >= n
        assert plan["expert_read_by_expert"][eid] >= n
    assert plan["expert_read_by_tensor"]["lm_head.weight"] == sum(
        next(t["nbytes"] for t in cat.tensors(e) if t["name"] == "lm_head.weight") for e in reserved)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(full_out / "model.safetensors"))
    for name in VOCAB_TENSORS:
        assert torch.equal(a[name], b[name])
    assert any(not torch.equal(a[n], b[n]) for n in a if n not in VOCAB_TENSORS)  # the budget omitted blocks
    # a budget below the embedding rows is refused, naming them; nothing is stored
    plans_before = cat.query("SELECT count(*) AS n FROM plans")[0]["n"]
    with pytest.raises(PlanError, match=r"budget 10% \(\d+ B\) is below the embedding rows a re-ordered "
                                        r"vocabulary reads in full \(\d+ B, tokenizer_source\)"):
        plan_from_config(cat, parse_config(text + "mergepipe: {budget: '10%'}\n", "v.yml"))
    assert cat.query("SELECT count(*) AS n FROM plans")[0]["n"] == plans_before


REFUSALS = [
    ("task_arithmetic", "tokenizer:\n  source: union\n  tokens:\n    <x>: {{source: nowhere}}\n",
     ConfigError, ["tokenizer.tokens.<x>.source", "'nowhere' is neither"]),
    ("task_arithmetic", "tokenizer:\n  source: union\n  tokens:\n    <x>: {{force: true}}\n",
     ConfigError, ["tokenizer.tokens", "'<x>' has no source"]),
]


@pytest.mark.parametrize("method, tok, exc, words", REFUSALS)
def test_refusals_name_the_key_and_leave_the_catalog_unchanged(fam, tmp_path, method, tok, exc, words):
    text = config(fam, method, tok)
    cat = Catalog(tmp_path / "c.sqlite")
    with pytest.raises(exc) as err:
        plan_from_config(cat, parse_config(text, "v.yml"))
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert cat.query("SELECT id FROM models") == [] and cat.query("SELECT id FROM plans") == []


def test_expert_with_another_vocabulary_needs_a_tokenizer_setting(fam, tmp_path):
    """Registered (it has its tokenizer), but a merge without a tokenizer setting is refused naming it."""
    base, experts = fam
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(base))
    register(cat, "e1", str(experts[0]), base_id="base")
    with pytest.raises(PlanError, match=r"expert e1's lm_head.weight has 258 rows, the base's 256 "
                                        r"\(another vocabulary\): merge it from a config with `tokenizer_source`"):
        Planner(cat).plan("base", ["e1"], "task_arithmetic", save=False)


def test_exported_config_replans_to_the_same_digest(fam, tmp_path):
    """The tokenizer settings travel through `export`: the exported YAML plans to the same digest
    (vocabulary, row sources and tokens settings included); an incremental merge of such a snapshot
    is refused (its vocabulary would change)."""
    from mergepipe.config.export import export_mergekit
    from mergepipe.planner.extend import ExtendRequest, plan_extend

    cat, plan, manifest, out = mergepipe_merge(tmp_path, config(fam, "task_arithmetic", TOKENS_BLOCK))
    text = export_mergekit(cat, plan.id)
    assert "tokenizer:" in text and "force: true" in text and "kind: model_token" in text
    again, _ = plan_from_config(cat, parse_config(text, "exported.yml"), save=False)
    assert again.digest == plan.digest
    with pytest.raises(PlanError, match=r"re-ordered its models' embedding rows to another vocabulary "
                                        r"\(tokenizer_source\)"):
        plan_extend(cat, ExtendRequest.build("mp", "remove", "expert_3"))


def test_a_tokenizer_folder_outside_the_models_is_refused_where_rows_would_move(fam, tmp_path):
    """A folder of tokenizer files only (not merged) can be the source when nothing moves; here the experts'
    vocabularies differ, so its rows would be re-ordered: refused naming the key, catalog unchanged."""
    base, experts = fam
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_bytes((experts[1] / name).read_bytes())
    cat = Catalog(tmp_path / "c.sqlite")
    with pytest.raises(ConfigError) as err:
        plan_from_config(cat, parse_config(config(fam, "task_arithmetic", f"tokenizer_source: {tok}\n"), "v.yml"))
    assert f"tokenizer_source: {tok} is not one of the models merged: re-ordering the embedding rows" in str(err.value)
    assert cat.query("SELECT id FROM models") == [] and cat.query("SELECT id FROM plans") == []
