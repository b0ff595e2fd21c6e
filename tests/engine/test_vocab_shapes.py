"""Tokenizer settings over different vocabularies in the config shapes beyond `models:` with a base (issue 15):
model soups without `base_model`, `slices:` configs and passthrough frankenmerges, end to end against mergekit
0.1.5 in-process.

The added-tokens family (tests/vocab_helpers.py) with the experts' embedding rows moved far from the base's
(so that the interpolation methods' angles matter). Asserted per case: every embedding/lm_head row per token
and every other tensor within the case's tolerance (max |MergePipe - mergekit| in float32 ulps of the
tensor's largest |value|; None: bit-equal), the same vocabulary, config.json vocab_size, the tokenizer
loading with AutoTokenizer; what stays refused gives one ``error:`` line and leaves the catalog unchanged.

Without `base_model` mergekit gives no model the base's role in the rows (a token several models hold but
not all gets the mean of their rows) and builds the vocabulary on the first model of a Python set (an
arbitrary one): a union holds the same tokens whichever it is (compared per token); `base` is refused.
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
from mergepipe.cli.app import main
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
from mergekit_runner import mergekit_merge  # noqa: E402
from vocab_helpers import ADDED_TOKENS, VOCAB_TENSORS, added_tokens_family, mergepipe_merge, same_vocabulary  # noqa: E402

EPS32 = 2.0 ** -23
BF16 = 2.0 ** -8


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab-shapes"), spread=1.0)


@pytest.fixture(scope="module")
def fam_bf16(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab-shapes-bf16"), spread=1.0, dtype="bf16")


def _soup(method: str, n: int, weights=None, **params):
    def doc(f):
        _, experts = f
        models = [{"model": str(e), **({"parameters": {"weight": weights[i]}} if weights else {})}
                  for i, e in enumerate(experts[:n])]
        return {"merge_method": method, "models": models, **({"parameters": params} if params else {})}
    return doc


def _slices(method: str, n: int, ranges, base: bool = True, per_slice=None, weights=None, **params):
    """``ranges``: each slice's layer_range; ``per_slice``: each slice's parameters; ``weights``: each
    source's weight (the base first)."""
    def doc(f):
        b, experts = f
        models = [b, *experts[:n]]
        own = [{"parameters": {"weight": w}} for w in weights] if weights else [{} for _ in models]
        slices = [{"sources": [{"model": str(m), "layer_range": list(r), **o} for m, o in zip(models, own)],
                   **({"parameters": per_slice[i]} if per_slice else {})} for i, r in enumerate(ranges)]
        return {"merge_method": method, **({"base_model": str(b)} if base else {}), "slices": slices,
                **({"parameters": params} if params else {})}
    return doc


# config, tokenizer_source ("e2": the second expert's path), max ulps on the embedding rows / other tensors
# (None: bit-equal); karcher's 1-D tensors within 6e-4 of their largest value (README's Interpolation table)
CASES = {
    "soup-linear-union": (_soup("linear", 3, [0.6, 1.3, 0.35]), "union", None, None),
    "soup-linear-model": (_soup("linear", 3, [0.6, 1.3, 0.35]), "e2", None, None),
    "soup-karcher-union": (_soup("karcher", 3), "union", 4.0, 4.0),
    "soup-nuslerp-union": (_soup("nuslerp", 2, [0.3, 0.7]), "union", 1.8, 1.8),
    "soup-multislerp-union": (_soup("multislerp", 3, [0.5, 0.3, 0.2]), "union", 2.6, 2.6),
    "slices-slerp-gradient-union": (_slices("slerp", 1, [(0, 2)], t=[0.2, 0.9, 0.4]), "union", 1.1, 1.1),
    "slices-slerp-per-slice-base": (_slices("slerp", 1, [(0, 1), (1, 2)], per_slice=[{"t": 0.3}, {"t": 0.6}]),
                                     "base", 1.1, 1.1),
    "slices-task_arithmetic-union": (_slices("task_arithmetic", 3, [(0, 1), (1, 2)],
                                             per_slice=[{"weight": 0.5}, {"weight": 0.8}]), "union", None, None),
    "slices-task_arithmetic-reordered-union": (_slices("task_arithmetic", 3, [(1, 2), (0, 1)], weights=[1.0, 0.6, 1.3, 0.35]), "union", None, None),
    "slices-linear-one-layer-union": (_slices("linear", 2, [(1, 2)], weights=[0.5, 0.3, 0.2]), "union", None, None),
    "slices-linear-union": (_slices("linear", 2, [(0, 2)], base=False, weights=[0.5, 0.3, 0.2]), "union", None, None),
}


def config_text(fam, case: str, dtype: str = "float32", out_dtype: str | None = None) -> str:
    make, tokenizer = CASES[case][:2]
    doc = make(fam)
    doc["dtype"] = dtype
    if out_dtype:
        doc["out_dtype"] = out_dtype
    doc["tokenizer_source"] = str(fam[1][1]) if tokenizer == "e2" else tokenizer
    return yaml.safe_dump(doc, sort_keys=False)


def measure(a: torch.Tensor, b: torch.Tensor, eps: float = EPS32) -> tuple[float, int]:
    """(max |a - b| in ulps of b's largest |value|, entries that differ)."""
    scale = float(b.float().abs().max())
    diff = (a.double() - b.double()).abs()
    return (float(diff.max()) / (eps * scale) if scale else 0.0), int((diff > 0).sum())


def compare(fam, tmp_path, text: str):
    """MergePipe against mergekit on one config: per-tensor (ulps, entries differing), the vocabulary checked."""
    mk = mergekit_merge(text, tmp_path / "mk", copy_tokenizer=True)
    cat, plan, manifest, mp = mergepipe_merge(tmp_path, text)
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mp"), local_files_only=True)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mk"), local_files_only=True)
    a, b = same_vocabulary(ours, theirs)
    vocab = plan["tokenizer"]["vocab"]
    assert vocab["tokens_n"] == len(a) and manifest.core["tokenizer"]["vocab"] == vocab
    assert set(mp) == set(mk)
    out = {}
    for name in sorted(mk):
        assert mp[name].shape == mk[name].shape and mp[name].dtype == mk[name].dtype, name
        if name in VOCAB_TENSORS:  # row by row, per token
            ours_ids, theirs_ids = torch.tensor([a[t] for t in a]), torch.tensor([b[t] for t in a])
            out[name] = (mp[name][ours_ids], mk[name][theirs_ids])
        else:
            out[name] = (mp[name], mk[name])
    cfg_mp, cfg_mk = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "mp", tmp_path / "mk"))
    assert cfg_mp["vocab_size"] == cfg_mk["vocab_size"] == vocab["rows"]
    assert cfg_mp.get("num_hidden_layers") == cfg_mk.get("num_hidden_layers")
    if vocab["source"] == "union":  # the union round-trips every model's tokens
        words = ["t5", *sorted(ADDED_TOKENS & set(a)), "t9"]
        assert len(words) > 2 and ours.decode(ours(" ".join(words))["input_ids"]).split() == words
    cat.close()
    return out, plan


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_mergekit(fam, tmp_path, case):
    _, tokenizer, vocab_tol, other_tol = CASES[case]
    pairs, plan = compare(fam, tmp_path, config_text(fam, case))
    for name, (ours, theirs) in pairs.items():
        tol = vocab_tol if name in VOCAB_TENSORS else other_tol
        ulps, differ = measure(ours, theirs)
        print(f"{case} {name}: {ulps:.2f} ulp, {differ} of {theirs.numel()} differ")
        if tol is None:
            assert differ == 0, (case, name, ulps, differ)
        elif "karcher" in case and ours.ndim == 1:
            assert float((ours - theirs).abs().max()) <= 6e-4 * float(theirs.abs().max()), (case, name)
        else:
            assert ulps <= tol, (case, name, ulps)


def test_bf16_soup_with_float32_compute(fam_bf16, tmp_path):
    """`dtype: float32, out_dtype: bfloat16` on a bf16 family: mergekit computes in float32 and rounds once;
    MergePipe rounds a mean row to bf16 before the merge (docs/tokenizer-union.md): within one bf16 ulp."""
    text = config_text(fam_bf16, "soup-linear-union", out_dtype="bfloat16")
    pairs, plan = compare(fam_bf16, tmp_path, text)
    for name, (ours, theirs) in pairs.items():
        assert ours.dtype == torch.bfloat16
        ulps, differ = measure(ours, theirs, BF16)
        print(f"bf16 soup-linear-union {name}: {ulps:.2f} bf16 ulp, {differ} of {theirs.numel()} differ")
        assert ulps <= 1.0, (name, ulps)


def _refuse(tmp_path, capsys, doc: dict, words: list[str]) -> None:
    path = tmp_path / "refused.yml"
    path.write_text(yaml.safe_dump(doc))
    db = tmp_path / "c.sqlite"
    rc = main(["--db", str(db), "merge", "--config", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "out").exists()
    cat = Catalog(db)
    assert cat.query("SELECT id FROM models") == [] and cat.query("SELECT id FROM plans") == []
    cat.close()


def test_base_without_base_model_is_refused(fam, tmp_path, capsys):
    doc = yaml.safe_load(config_text(fam, "soup-linear-union"))
    doc["tokenizer_source"] = "base"
    _refuse(tmp_path, capsys, doc, ["tokenizer_source: `base` without a `base_model`", "name the model"])


def _passthrough(f, slices, source="union", base=False, **extra) -> str:
    """A passthrough frankenmerge of ``slices`` ((expert index or "base", layer_range) each)."""
    b, experts = f
    model = {"base": b, **dict(enumerate(experts))}
    doc = {"merge_method": "passthrough", "dtype": "float32", **({"base_model": str(b)} if base else {}),
           "slices": [{"sources": [{"model": str(model[m]), "layer_range": list(r)}]} for m, r in slices],
           **({"tokenizer_source": source} if source else {}), **extra}
    return yaml.safe_dump(doc, sort_keys=False)


# slices, tokenizer_source, base_model named: mergekit re-orders the first slice's model's embed_tokens and the
# last slice's lm_head each alone (its own rows, zero rows for the tokens that model lacks)
PASSTHROUGH = {
    "e1-e2-union": ([(0, (0, 1)), (1, (1, 2))], "union", False),
    "e3-e1-e2-union": ([(2, (0, 2)), (0, (0, 1)), (1, (1, 2))], "union", False),  # the middle model no row source
    "base-e1-union": ([("base", (0, 2)), (0, (1, 2))], "union", True),
    "base-e1-base": ([("base", (0, 2)), (0, (1, 2))], "base", True),
    "e1-e2-base-model": ([(0, (0, 1)), (1, (1, 2)), ("base", (1, 2))], "e2", True),  # expert_2's tokenizer
}


@pytest.mark.parametrize("case", list(PASSTHROUGH))
def test_passthrough_over_different_vocabularies(fam, tmp_path, case):
    """Every tensor bit-equal to mergekit 0.1.5's, the embedding rows per token: each copied embedding tensor
    re-ordered alone from the model it copies (the plan's ``copies``), zero rows for the tokens that model
    lacks; no expert byte is read (a copy is a read of its model, as any passthrough copy)."""
    slices, tokenizer, base = PASSTHROUGH[case]
    if tokenizer == "e2":
        tokenizer = str(fam[1][1])
    text = _passthrough(fam, slices, tokenizer, base)
    pairs, plan = compare(fam, tmp_path, text)
    vocab = plan["tokenizer"]["vocab"]
    first, last = (plan["layout"]["tensors"][i][1] for i in (0, -1))
    assert vocab["copies"] == {"model.embed_tokens.weight": first, "lm_head.weight": last}
    assert plan["expert_read_by_expert"] == {e["id"]: 0 for e in plan["experts"]}
    for name, (ours, theirs) in pairs.items():
        assert torch.equal(ours, theirs), (case, name, measure(ours, theirs))
    explain = plan.explain()
    assert "re-ordered to it, each alone from the model it copies (lm_head.weight of " in explain, explain
    print(f"passthrough {case}: every tensor bit-equal")


def test_passthrough_padding_rows(fam, tmp_path):
    """`pad_to_multiple_of`: the padding rows are the mean of the copied tensor's re-ordered rows (its zero rows
    included), as mergekit's; within 1e-6 of mergekit's (a mean in another order)."""
    text = _passthrough(fam, [(0, (0, 1)), (1, (1, 2))], None,
                        tokenizer={"source": "union", "pad_to_multiple_of": 64})
    pairs, plan = compare(fam, tmp_path, text)
    vocab = plan["tokenizer"]["vocab"]
    assert vocab["rows"] % 64 == 0 and vocab["rows"] > vocab["tokens_n"]
    for name, (ours, theirs) in pairs.items():
        assert torch.equal(ours, theirs), name
    mp, mk = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("mp", "mk"))
    for name in VOCAB_TENSORS:
        pad = slice(vocab["tokens_n"], vocab["rows"])
        assert float((mp[name][pad] - mk[name][pad]).abs().max()) <= 1e-6, name


def test_passthrough_exported_config_replans_to_the_same_digest(fam, tmp_path):
    from mergepipe.config.export import export_mergekit
    cat, plan, _, _ = mergepipe_merge(tmp_path, _passthrough(fam, [(2, (0, 2)), (0, (0, 1)), (1, (1, 2))]))
    again, _ = plan_from_config(cat, parse_config(export_mergekit(cat, plan.id), "exported.yml"), save=False)
    assert again.digest == plan.digest
    cat.close()


def test_passthrough_with_a_tokens_block_is_refused(fam, tmp_path, capsys):
    """A `tokens:` block would take rows from models the copied tensor does not come from: not done; one error
    line naming the key, catalog unchanged."""
    doc = yaml.safe_load(_passthrough(fam, [(0, (0, 1)), (1, (1, 2))], None,
                                      tokenizer={"source": "union", "tokens": {"<new>": {"source": "zero"}}}))
    doc["tokenizer"]["tokens"]["<new>"] = {"source": {"kind": "zero"}}
    _refuse(tmp_path, capsys, doc, ["tokenizer.tokens: passthrough re-orders each copied embedding tensor alone",
                                    "is not done by MergePipe"])


def test_mean_rows_in_another_slice_order_are_refused():
    """A mean over three or more rows summed in the last slice's order (lm_head) differs from the first's in
    float32: refused naming the key; two rows (a commutative sum) or one order are accepted."""
    from types import SimpleNamespace

    from mergepipe.config.vocab import VocabRefusal, _check_mean_order

    def cfg(*orders):
        return SimpleNamespace(slices=[SimpleNamespace(where=f"slices[{i}]", sources=[
            SimpleNamespace(ref=m, where=f"slices[{i}].sources[{j}]") for j, m in enumerate(o)])
            for i, o in enumerate(orders)])

    three = {"a": [("mean", (("a", 3), ("b", 3), ("c", 3)))]}
    two = {"a": [("mean", (("b", 3), ("c", 3)))]}
    ref = lambda text, where: text  # noqa: E731
    _check_mean_order(cfg("abc", "abc"), list("abc"), three, ref)
    _check_mean_order(cfg("abc", "acb"), list("abc"), two, ref)
    with pytest.raises(VocabRefusal) as err:
        _check_mean_order(cfg("abc", "acb"), list("abc"), three, ref)
    assert err.value.args[0] == "tokenizer_source" and "slices[1] lists the models in another order" in err.value.args[1]


@pytest.mark.parametrize("case", ["soup-linear-model", "slices-task_arithmetic-reordered-union"])
def test_exported_config_replans_to_the_same_digest(fam, tmp_path, case):
    """A soup's named reference tokenizer is recorded by id, so the export names its path and plans back."""
    from mergepipe.config.export import export_mergekit

    cat = Catalog(tmp_path / "c.sqlite")
    plan, _ = plan_from_config(cat, parse_config(config_text(fam, case), "shapes.yml"))
    text = export_mergekit(cat, plan.id)
    again, _ = plan_from_config(cat, parse_config(text, "exported.yml"), save=False)
    assert again.digest == plan.digest and again["tokenizer"]["vocab"]["source"] == plan["tokenizer"]["vocab"]["source"]
    cat.close()


def test_passthrough_bf16(fam_bf16, tmp_path):
    """A bf16 family (`out_dtype: bfloat16`): the copied rows and zero rows are exact, every tensor bit-equal."""
    pairs, plan = compare(fam_bf16, tmp_path, _passthrough(fam_bf16, [(2, (0, 2)), (0, (0, 1)), (1, (1, 2))],
                                                           out_dtype="bfloat16"))
    for name, (ours, theirs) in pairs.items():
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs), (name, measure(ours, theirs, BF16))
