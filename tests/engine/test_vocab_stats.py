"""sce, ramplus_tl, arcee_fusion, breadcrumbs and della over different vocabularies (issue 15), end to end
against mergekit 0.1.5.

Their per-tensor statistics -- sce's weights (mean(v_i^2)) and, with ``select_topk`` < 1, the top k of the
variance across the experts; ramplus_tl's counts of shared and unique changed entries; arcee_fusion's
importance threshold -- come from ANALYZE for same-layout tensors; for a re-ordered vocabulary's
embed_tokens/lm_head the engine takes them from the composed rows at merge time (engine/vocab.py,
analyze/gram.py ``composed_*``), with ANALYZE's own code. On the added-tokens family (tests/vocab_helpers.py)
with the experts' embedding rows moved far from the base's (``spread``; for ramplus_tl on a random 30 % of the
entries, so that the shared/unique counts set lambda rather than the alpha cap), merged from one mergekit YAML
by MergePipe and by mergekit in-process at full budget: every embedding/lm_head row per token and every other
tensor within the README's tolerance of the method (max |MergePipe - mergekit| in float32 ulps of the
tensor's largest |value|), the same vocabulary, config.json vocab_size and tokenizer. breadcrumbs below
density 1: its two cut-offs from each expert's composed delta (bit-equal rows); della needs no whole-tensor
statistic and is compared in distribution (its random stream is not torch's).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
from mergekit_runner import mergekit_merge  # noqa: E402
from vocab_helpers import VOCAB_TENSORS, added_tokens_family, mergepipe_merge, same_vocabulary  # noqa: E402

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


def measure(a: torch.Tensor, b: torch.Tensor, eps: float = EPS32) -> tuple[float, int]:
    """max |a - b| in ulps (``eps``) of b's largest |value|, and how many entries differ."""
    scale = float(b.abs().max())
    ulps = float((a.double() - b.double()).abs().max()) / (eps * scale) if scale else 0.0
    return ulps, int((a != b).sum())


def compare(family, tmp_path, text: str, seed: int | None = None):
    """Both merges of ``text``: per tensor (MergePipe's, mergekit's), the embedding rows per token
    (``seed``: mergekit's random seed)."""
    mk = mergekit_merge(text, tmp_path / "mk", copy_tokenizer=True, seed=seed)
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


# --- breadcrumbs and della below density 1 on the re-ordered tensors ---------------------------------------
# breadcrumbs' two cut-offs (drop the top int(gamma n), keep the next int(density n): mergekit's
# magnitude_outliers) are exact top-k statistics of each expert's composed delta, taken at merge time as
# ties' are (engine/vocab.exact_outliers). (method, per-model parameters; weights 0.6/1.3/0.35)
SPARSE = {
    "breadcrumbs": ("breadcrumbs", {"density": 0.5, "gamma": 0.1}),
    "breadcrumbs_ties": ("breadcrumbs_ties", {"density": 0.3, "gamma": 0.05}),
}
WEIGHTS = (0.6, 1.3, 0.35)


def sparse_text(family, method: str, params: dict, tokenizer: str, experts=(0, 1, 2), weights=WEIGHTS,
                merge_params: dict | None = None, **extra) -> str:
    base, paths = family
    doc = {"merge_method": method, "base_model": str(base), "dtype": "float32", "tokenizer_source": tokenizer,
           "models": [{"model": str(paths[i]), "parameters": {"weight": w, **params}} for i, w in zip(experts, weights)],
           **({"parameters": merge_params} if merge_params else {}), **extra}
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.mark.parametrize("case, tokenizer", [(c, t) for c in SPARSE for t in ("union", "base")])
def test_breadcrumbs_parity_with_mergekit(fam, tmp_path, case, tokenizer):
    """Every embedding/lm_head row per token bit-equal to mergekit's; the other tensors (thresholds from the
    catalog, as before) bit-equal but for the entries tied at a cut-off (README: 2 in fp32)."""
    method, params = SPARSE[case]
    pairs, plan = compare(fam, tmp_path, sparse_text(fam, method, params, tokenizer))
    pairs.pop("tokens")
    assert not set(VOCAB_TENSORS) & set(plan["thresholds"]["expert_1"])  # taken from the composed rows
    tied = 0
    for name, (ours, theirs) in pairs.items():
        if name in VOCAB_TENSORS:
            assert torch.equal(ours, theirs), (case, tokenizer, name, measure(ours, theirs))
        else:
            tied += measure(ours, theirs)[1]
    assert tied <= 4, (case, tokenizer, tied)
    print(f"{case} {tokenizer}: embedding rows bit-equal; other tensors: {tied} entries differ (ties)")


def test_breadcrumbs_bf16(fam_bf16, tmp_path):
    """bf16 (`dtype: float32, out_dtype: bfloat16`): bf16 deltas tie often, and mergekit's torch.sort keeps an
    arbitrary subset of the tied entries at a cut-off (MergePipe the first in flat order, README): the number
    of entries kept is the same, which ones may differ; every other entry equal."""
    pairs, _ = compare(fam_bf16, tmp_path, sparse_text(fam_bf16, "breadcrumbs", {"density": 0.5, "gamma": 0.1},
                                                       "union", (0,), (1.0,), out_dtype="bfloat16"))
    pairs.pop("tokens")
    base = load_file(str(fam_bf16[0] / "model.safetensors"))
    outs = [load_file(str(tmp_path / d / "model.safetensors")) for d in ("mp", "mk")]
    for name in VOCAB_TENSORS:
        ours, theirs = pairs[name]
        ulps, differ = measure(ours, theirs, BF16)
        kept = [int((o[name][:256] != base[name]).sum()) for o in outs]  # the base's tokens keep their ids
        print(f"bf16 breadcrumbs union {name}: {ulps:.2f} bf16 ulp, {differ} of {theirs.numel()} entries differ; "
              f"kept {kept[0]} / mergekit {kept[1]} of {base[name].numel()}")
        assert differ <= 0.03 * theirs.numel(), (name, differ)
        assert kept[0] == kept[1], (name, kept)


def _rows(out: dict, name: str) -> torch.Tensor:
    return out[name][:256].double()  # the base's 256 tokens keep their ids in both outputs


def _della(family, tmp_path, tag: str, experts, weights, params: dict, merge_params: dict | None = None,
           method: str = "della"):
    (tmp_path / tag).mkdir()
    return compare(family, tmp_path / tag, sparse_text(family, method, params, "union", experts, weights,
                                                       merge_params, mergepipe={"seed": 7}), seed=7)


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_statistically_equal_mergekit(fam, tmp_path, method):
    """DELLA over re-ordered rows needs no whole-tensor statistic (its ranks are per row, rows whole in a block;
    the L1 restoration per block): its random mask is MergePipe's counter stream, not torch's generator, so
    equal in distribution (tests/parity/test_parity_existing.py's criteria) on the embedding rows: the keep
    rate of one expert without rescale within 5 binomial standard deviations of mergekit's and of density; with
    rescale the L1 of the output delta within 1e-4 relative of mergekit's and its mean within 5 % of the L1 / n
    scale; three experts: L1 within 3 %. A token only the expert has keeps its row exactly on both sides."""
    base = load_file(str(fam[0] / "model.safetensors"))
    density = 0.5
    pairs, plan = _della(fam, tmp_path, "rate", (0,), (1.0,), {"density": density, "epsilon": 0.1},
                         {"rescale": False}, method)
    tokens = pairs.pop("tokens")
    think = tokens.index("<think>")  # expert_1's alone: every model's row is expert_1's, delta 0
    kept_o = kept_t = n = 0
    for name in VOCAB_TENSORS:
        ours, theirs = pairs[name]
        assert torch.equal(ours[think], theirs[think])
    mp_out = load_file(str(tmp_path / "rate" / "mp" / "model.safetensors"))
    mk_out = load_file(str(tmp_path / "rate" / "mk" / "model.safetensors"))
    expert = load_file(str(fam[1][0] / "model.safetensors"))
    for name in VOCAB_TENSORS:
        changed = (_rows(expert, name) != base[name].double())
        n += int(changed.sum())
        kept_o += int(((_rows(mp_out, name) != base[name].double()) & changed).sum())
        kept_t += int(((_rows(mk_out, name) != base[name].double()) & changed).sum())
    sd = (density * (1 - density) / n) ** 0.5
    rate_o, rate_t = kept_o / n, kept_t / n
    print(f"{method} union keep rate: MergePipe {rate_o:.4f}, mergekit {rate_t:.4f} (density {density}, sd {sd:.4f}, "
          f"{n} changed entries)")
    assert abs(rate_o - rate_t) <= 5 * sd * 2 ** 0.5 and abs(rate_o - density) <= 5 * sd, (rate_o, rate_t)
    for tag, experts, weights, tol in (("l1", (0,), (1.0,), 1e-4), ("three", (0, 1, 2), WEIGHTS, 0.03)):
        _della(fam, tmp_path, tag, experts, weights, {"density": density, "epsilon": 0.1}, None, method)
        mp_out = load_file(str(tmp_path / tag / "mp" / "model.safetensors"))
        mk_out = load_file(str(tmp_path / tag / "mk" / "model.safetensors"))
        for name in VOCAB_TENSORS:
            d_o, d_t = _rows(mp_out, name) - base[name].double(), _rows(mk_out, name) - base[name].double()
            l1_o, l1_t = float(d_o.abs().sum()), float(d_t.abs().sum())
            rel = abs(l1_o - l1_t) / l1_t
            print(f"{method} union {tag} {name}: L1 of the delta {rel:.2e} relative, mean gap "
                  f"{abs(float(d_o.sum() - d_t.sum())) / l1_t:.2e} of L1")
            assert rel <= tol, (tag, name, l1_o, l1_t)
            assert abs(float(d_o.sum() - d_t.sum())) <= 0.05 * l1_t, (tag, name)


def _outlier_ties(family, name: str, params: dict, experts=(0, 1, 2)) -> torch.Tensor:
    """Entries where some expert's non-zero |delta| equals one of its breadcrumbs cut-off magnitudes (mergekit's
    ranks: of n entries by |delta| descending, [n - n_bot - target, n - n_bot), target = int(density n), n_bot =
    max(0, n - target - int(gamma n))): there mergekit's sort keeps an arbitrary subset of the tied entries."""
    base = load_file(str(family[0] / "model.safetensors"))[name].float()
    tied = torch.zeros(base.shape, dtype=torch.bool)
    for i in experts:
        a = (load_file(str(family[1][i] / "model.safetensors"))[name].float() - base).abs()
        n = a.numel()
        target = int(params["density"] * n)
        n_bot = max(0, n - target - int(params["gamma"] * n))
        srt = torch.sort(a.reshape(-1), descending=True).values
        for k in (n - n_bot - target, n - n_bot):
            if 0 < k <= n and srt[k - 1] > 0:
                tied |= a == srt[k - 1]
    return tied


@pytest.mark.parametrize("method, params, tokenizer", [
    ("breadcrumbs", {"density": 0.5, "gamma": 5e-5}, "union"),  # int(gamma n) = 0 on every tensor
    ("breadcrumbs", {"density": 0.5, "gamma": 0.0}, "union"),
    ("breadcrumbs_ties", {"density": 0.3, "gamma": 5e-5}, "base"),
    ("ties", {"density": 0.333}, "union"),  # a density off ANALYZE's grid: analyzed on the way as well
])
def test_analyzed_on_the_way_over_reordered_rows(fam, tmp_path, method, params, tokenizer):
    """A top-k fraction ANALYZE's stored grid lacks (a tiny or zero gamma: top-5e-05, top-0; a density of 0.333)
    makes the merge analyze its experts on the way; over a re-ordered vocabulary the thresholds of the composed
    rows (engine/vocab.py) and those of the other tensors (the analysis on the way) both reach the merge (it
    crashed with an IndexError: the composed rows' thresholds replaced the dict the analysis fills), the composed
    rows are merged whole and read once (the plan's read of them was counted twice for an expert of the base's
    vocabulary). Equal to mergekit 0.1.5: embedding rows bit-equal, other tensors but for entries tied at a
    cut-off."""
    pairs, plan = compare(fam, tmp_path, sparse_text(fam, method, params, tokenizer))
    pairs.pop("tokens")
    assert all(e.get("analyze") for e in plan["experts"])  # analyzed on the way
    differ = 0
    for name, (ours, theirs) in pairs.items():
        if name in VOCAB_TENSORS:
            assert torch.equal(ours, theirs), (method, params, tokenizer, name, measure(ours, theirs))
            continue
        diff = ours != theirs
        if method != "ties":
            tied = _outlier_ties(fam, name, params)
            assert not (diff & ~tied).any(), (name, int((diff & ~tied).sum()))
        differ += int(diff.sum())
    assert differ <= 4, differ
    print(f"{method} {params} {tokenizer}: embedding rows bit-equal; other tensors: {differ} entries differ (ties)")
