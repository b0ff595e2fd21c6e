"""sce, ramplus_tl and arcee_fusion over different vocabularies (issue 15), end to end against mergekit 0.1.5.

Their per-tensor statistics -- sce's weights (mean(v_i^2)) and, with ``select_topk`` < 1, the top k of the
variance across the experts; ramplus_tl's counts of shared and unique changed entries; arcee_fusion's
importance threshold -- come from ANALYZE for same-layout tensors; for a re-ordered vocabulary's
embed_tokens/lm_head the engine takes them from the composed rows at merge time (engine/vocab.py,
analyze/gram.py ``composed_*``), with ANALYZE's own code. On the added-tokens family (tests/vocab_helpers.py)
with the experts' embedding rows moved far from the base's (``spread``; for ramplus_tl on a random 30 % of the
entries, so that the shared/unique counts set lambda rather than the alpha cap), merged from one mergekit YAML
by MergePipe and by mergekit in-process at full budget: every embedding/lm_head row per token and every other
tensor within the README's tolerance of the method (max |MergePipe - mergekit| in float32 ulps of the
tensor's largest |value|), the same vocabulary, config.json vocab_size and tokenizer.
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
from mergepipe.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
from mergekit_runner import mergekit_merge  # noqa: E402
from vocab_helpers import VOCAB_TENSORS, added_tokens_family, same_vocabulary  # noqa: E402

EPS32 = 2.0 ** -23
BF16 = 2.0 ** -7


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab-stats"), spread=1.0)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab-stats-sparse"), spread=1.0, fraction=0.3)


@pytest.fixture(scope="module")
def fam_bf16(tmp_path_factory):
    return added_tokens_family(tmp_path_factory.mktemp("vocab-stats-bf16"), spread=1.0, dtype="bf16")


# method, experts (their indices), parameters, the family, and the README's tolerance in float32 ulps
# (None: bit-equal). sce's weights are float32 roundings of float64 energies (mergekit: float32 means): <= 0.5
# ulp on the catalog family, 0.6 on this one's q_proj (from the catalog); its select_topk rows <= 4 ulp
CASES = {
    "sce": ("sce", (0, 1, 2), {}, "fam", 0.7),
    "sce-topk-0.5": ("sce", (0, 1, 2), {"select_topk": 0.5}, "fam", 4.0),
    "sce-topk-0.3": ("sce", (0, 1, 2), {"select_topk": 0.3}, "fam", 4.0),
    "ramplus_tl": ("ramplus_tl", (0, 1, 2), {}, "fam", None),
    "ramplus_tl-counts": ("ramplus_tl", (0, 1, 2), {"r": 0.5, "alpha": 2.0}, "sparse", None),
    "arcee_fusion": ("arcee_fusion", (0,), {}, "fam", None),
    "arcee_fusion-e2": ("arcee_fusion", (1,), {}, "fam", None),
}
RUNS = [(case, tokenizer) for case in CASES for tokenizer in ("union", "base")]


def config_text(family, case: str, tokenizer: str, budget: str | None = None, **extra) -> str:
    base, experts = family
    method, which, params, _, _ = CASES[case]
    doc = {"merge_method": method, "base_model": str(base), "dtype": "float32", "tokenizer_source": tokenizer,
           "models": [{"model": str(experts[i])} for i in which], **extra}
    if params:
        doc["parameters"] = params
    if budget:
        doc["mergepipe"] = {"budget": budget}
    return yaml.safe_dump(doc, sort_keys=False)


def mergepipe_merge(tmp: Path, text: str):
    cat = Catalog(tmp / "c.sqlite")
    plan, _ = plan_from_config(cat, parse_config(text, "stats.yml"))
    _, manifest = Engine(cat).execute(plan, out=tmp / "mp")
    return cat, plan, manifest, load_file(str(tmp / "mp" / "model.safetensors"))


def measure(a: torch.Tensor, b: torch.Tensor, eps: float = EPS32) -> tuple[float, int]:
    """max |a - b| in ulps (``eps``) of b's largest |value|, and how many entries differ."""
    scale = float(b.abs().max())
    ulps = float((a.double() - b.double()).abs().max()) / (eps * scale) if scale else 0.0
    return ulps, int((a != b).sum())


def compare(family, tmp_path, text: str):
    """Both merges of ``text``: per tensor (MergePipe's, mergekit's), the embedding rows per token."""
    mk = mergekit_merge(text, tmp_path / "mk", copy_tokenizer=True)
    cat, plan, manifest, mp = mergepipe_merge(tmp_path, text)
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mp"), local_files_only=True)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "mk"), local_files_only=True)
    a, b = same_vocabulary(ours, theirs)
    vocab = plan["tokenizer"]["vocab"]
    assert manifest.core["realized"]["expert_read"] == plan["full_expert_bytes"]
    assert set(mp) == set(mk)
    pairs = {"tokens": list(a)}  # the embedding rows' order
    for name in sorted(mk):
        assert mp[name].shape == mk[name].shape, name
        if name in VOCAB_TENSORS:
            pairs[name] = (mp[name][torch.tensor([a[t] for t in a])], mk[name][torch.tensor([b[t] for t in a])])
        else:
            pairs[name] = (mp[name], mk[name])
    cfg_mp, cfg_mk = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "mp", tmp_path / "mk"))
    assert cfg_mp["vocab_size"] == cfg_mk["vocab_size"] == vocab["rows"]
    assert ours.chat_template == theirs.chat_template
    cat.close()
    return pairs, plan


@pytest.mark.parametrize("case, tokenizer", RUNS)
def test_parity_with_mergekit(fam, sparse, tmp_path, case, tokenizer):
    family = {"fam": fam, "sparse": sparse}[CASES[case][3]]
    tol = CASES[case][4]
    pairs, plan = compare(family, tmp_path, config_text(family, case, tokenizer))
    assert set(plan["composed_coefficients"]) == set(VOCAB_TENSORS)
    assert not set(VOCAB_TENSORS) & set(plan["coefficients"])  # no catalog statistics of the composed rows
    rows, other = [], []
    pairs.pop("tokens")
    for name, (ours, theirs) in pairs.items():
        ulps, differ = measure(ours, theirs)
        (rows if name in VOCAB_TENSORS else other).append((ulps, differ, theirs.numel()))
        if tol is None:
            assert torch.equal(ours, theirs), (case, tokenizer, name, ulps, differ)
        else:
            assert ulps <= tol, (case, tokenizer, name, ulps)
    print(f"{case} {tokenizer}: embedding rows {max(rows)[0]:.2f} ulp, {sum(r[1] for r in rows)} of "
          f"{sum(r[2] for r in rows)} differ; other tensors {max(other)[0]:.2f} ulp, "
          f"{sum(r[1] for r in other)} of {sum(r[2] for r in other)}")


def test_ramplus_counts_set_lambda(sparse):
    """On the sparse family the experts' lm_head shared/unique ratio is below alpha 2: lambda comes from the
    counts of the composed rows, not from the cap (so the parity case above checks them)."""
    base, experts = sparse
    b = load_file(str(base / "model.safetensors"))["lm_head.weight"]
    nz = torch.stack([(load_file(str(e / "model.safetensors"))["lm_head.weight"][:256] - b).abs().reshape(-1) > 1e-5
                      for e in experts])
    counts = nz.sum(dim=0)
    shared, unique = (nz & (counts > 1)).sum(dim=1), (nz & (counts == 1)).sum(dim=1)
    rho = shared / unique
    assert bool(((rho > 0.1) & (rho < 2.0)).all()), rho


@pytest.mark.parametrize("case", ["sce", "sce-topk-0.5", "ramplus_tl", "arcee_fusion"])
def test_bf16_with_float32_compute(fam_bf16, tmp_path, case):
    """A bf16 family, `dtype: float32, out_dtype: bfloat16`: mergekit computes in float32 and rounds once;
    MergePipe rounds a mean row to bf16 before the merge (docs/tokenizer-union.md): within one bf16 ulp."""
    text = config_text(fam_bf16, case, "union", out_dtype="bfloat16")
    pairs, plan = compare(fam_bf16, tmp_path, text)
    tokens = pairs.pop("tokens")
    mean = tokens.index("<tool>")  # held by expert_1 and expert_2, not the base: every other model's row a mean
    for name, (ours, theirs) in pairs.items():
        assert ours.dtype == torch.bfloat16
        if name in VOCAB_TENSORS and case.startswith("sce"):
            # sce on a mean row: expert_1's and expert_2's deltas from the mean cancel, so the elected sign is
            # the rounding's; MergePipe's mean is rounded to bf16 first (docs/tokenizer-union.md): each entry is
            # one of the two holders' values (or their mean) on both sides, not always the same one
            held = [load_file(str(e / "model.safetensors"))[name][256].float() for e in fam_bf16[1][:2]]
            held.append((held[0] + held[1]) / 2)  # select_topk < 1 masks some entries: the mean (the base's row)
            for out in (ours[mean].float(), theirs[mean].float()):
                near = torch.stack([(out - h).abs() <= BF16 * h.abs() for h in held]).any(dim=0)
                assert bool(near.all()), (case, name)
            swapped = int((ours[mean] != theirs[mean]).sum())
            keep = torch.arange(len(tokens)) != mean
            ours, theirs = ours[keep], theirs[keep]
            print(f"bf16 {case} union {name}: the mean row <tool>: {swapped} of {held[0].numel()} entries take the "
                  f"other holder's value")
        ulps, differ = measure(ours, theirs, BF16)
        if name in VOCAB_TENSORS:
            print(f"bf16 {case} union {name}: {ulps:.2f} bf16 ulp, {differ} of {theirs.numel()} differ")
        assert ulps <= 1.0, (case, name, ulps)


@pytest.mark.parametrize("case, words", [
    ("sce-topk-0.5", "the top k of the variance across the experts"),
    ("ramplus_tl", "counts of shared and unique changed entries"),
    ("arcee_fusion", "the importance threshold, median + 1.5 IQR"),
])
def test_plan_says_where_the_statistics_come_from(fam, tmp_path, case, words):
    text = config_text(fam, case, "union")
    cat = Catalog(tmp_path / "c.sqlite")
    plan, _ = plan_from_config(cat, parse_config(text, "stats.yml"))
    composed = plan["composed_coefficients"]
    assert sorted(composed) == sorted(VOCAB_TENSORS)
    for settings in composed.values():  # the statistics are the merge's, not the plan's
        assert not {"sce", "ram_counts", "arcee_threshold"} & set(settings)
    assert "model.layers.0.self_attn.q_proj.weight" in plan["coefficients"]
    line = next(x for x in plan.explain().splitlines() if x.startswith("  coefficients of "))
    assert "lm_head.weight, model.embed_tokens.weight: from the composed rows at merge time" in line and words in line
    again, _ = plan_from_config(cat, parse_config(text, "again.yml"), save=False)
    assert again.digest == plan.digest
    cat.close()


def test_budget_keeps_the_embedding_rows(fam, tmp_path):
    """sce at 50 %: the re-ordered tensors are read in full and merged as at full budget (their statistics
    from all of their rows); other tensors follow the budget."""
    (tmp_path / "full").mkdir()
    (tmp_path / "half").mkdir()
    _, _, _, full = mergepipe_merge(tmp_path / "full", config_text(fam, "sce-topk-0.5", "union"))
    cat, plan, manifest, half = mergepipe_merge(tmp_path / "half", config_text(fam, "sce-topk-0.5", "union", "50%"))
    assert plan["budget"]["bytes"] == plan["full_expert_bytes"] // 2
    assert manifest.core["realized_by_expert"] == plan["expert_read_by_expert"]
    for name in VOCAB_TENSORS:
        assert torch.equal(half[name], full[name]), name
    assert plan["omitted"] and not set(VOCAB_TENSORS) & set(plan["omitted"])
    assert any(not torch.equal(half[n], full[n]) for n in half if n not in VOCAB_TENSORS)
    cat.close()
