"""breadcrumbs(_ties) cut-offs at the edges of mergekit 0.1.5's magnitude_outliers (mergekit/sparsify.py), on the
catalog path (ordinary tensors, thresholds from ANALYZE's stored grid or from the analysis on the way).

mergekit sorts the n entries of a delta by |delta| ascending and keeps positions [n_bot, n_bot + target),
target = int(density n), n_bot = max(0, n - target - int(gamma n)). So:

* gamma + density = 1 keeps int(density n) entries below the top int(gamma n), which is n - 1 of the rest
  where both products round down (n = 4096, gamma 0.01: 40 + 4055 = 4095; the smallest entry is dropped);
  MergePipe kept all of them (32 entries differed on this family) and now keeps the top n - 1 from the stored
  fraction 1 (ANALYZE's grid holds it: the top n and n - 1);
* int(gamma n) = 0 (gamma 0, or 5e-05 on these tensors) drops no top entry; the fraction is off the stored grid,
  so the merge analyzes its experts on the way;
* density 1 keeps the delta as it is, whatever gamma.

Full budget, fp32, three experts (weights 0.6/1.3/0.35): bit-equal to mergekit except entries tied in magnitude
at a cut-off (mergekit's unstable sort keeps an arbitrary subset of them, MergePipe the first in flat C order,
README "Ties at a cut-off"); one-expert merges keep exactly mergekit's count.
"""

from __future__ import annotations

import pytest
import torch

from mergekit_runner import merge_both, params_config, params_family

# (gamma, density, off ANALYZE's default grid: the first merge that needs them analyzes on the way and stores them)
CASES = {
    "g0.01+d0.99": (0.01, 0.99, False),
    "g0.3+d0.7": (0.3, 0.7, False),
    "g0.1+d0.9": (0.1, 0.9, False),
    "g0+d0.5": (0.0, 0.5, True),
    "g5e-05+d0.5": (5e-5, 0.5, True),
    "g5e-05+d0.99995": (5e-5, 0.99995, True),
    "g0+d1": (0.0, 1.0, False),
    "g5e-05+d1": (5e-5, 1.0, False),
    "g0.01+d1": (0.01, 1.0, False),
}


@pytest.fixture(scope="module")
def bfam(tmp_path_factory):
    fam = params_family(tmp_path_factory, "breadcrumbs-edges")
    yield fam
    fam["cat"].close()


def _cfg(fam, method, gamma, density, experts=(0, 1, 2), weights=(0.6, 1.3, 0.35)):
    cfg = params_config(fam, method, {"gamma": [gamma] * len(experts)}, experts=experts, weights=list(weights))
    for m in cfg["models"]:
        m["parameters"]["density"] = density
    return cfg


def _ranks(n: int, gamma: float, density: float) -> tuple[int, int]:
    """mergekit's kept ranks [k_hi, k_lo) in |delta| descending order."""
    target = int(density * n)
    n_bot = max(0, n - target - int(gamma * n))
    return n - n_bot - target, n - n_bot


def _tied(fam, name, gamma, density, experts) -> torch.Tensor:
    """Entries where some expert's non-zero |delta| equals one of its cut-off magnitudes."""
    base = fam["base_t"][name].float()
    tied = torch.zeros(base.shape, dtype=torch.bool)
    if density >= 1:
        return tied
    for i in experts:
        a = (fam["experts_t"][i][name].float() - base).abs()
        srt = torch.sort(a.reshape(-1), descending=True).values
        for k in _ranks(a.numel(), gamma, density):
            if 0 < k <= a.numel() and srt[k - 1] > 0:
                tied |= a == srt[k - 1]
    return tied


def test_the_family_rounds_down():
    """The family's tensors (64, 4096, 8192 entries): gamma + density = 1 keeps n - 1 of the rest."""
    for n in (64, 4096, 8192):
        for gamma, density in ((0.01, 0.99), (0.3, 0.7)):
            k_hi, k_lo = _ranks(n, gamma, density)
            assert k_hi == int(gamma * n) and k_lo == n - 1, (n, gamma, density)


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize("case", list(CASES))
def test_breadcrumbs_edges_equal_mergekit(bfam, method, case):
    gamma, density, on_the_way = CASES[case]
    experts = (0, 1, 2)
    plan, ours, theirs = merge_both(bfam, _cfg(bfam, method, gamma, density), f"{method}-{case}")
    if not on_the_way:  # the stored grid answers (fraction 1 too): the plan reads as any budgeted plan would
        assert not any(e.get("analyze") for e in plan["experts"]), [e.get("analyze") for e in plan["experts"]]
    differing = at_ties = 0
    for name in ours:
        diff = ours[name] != theirs[name]
        tied = _tied(bfam, name, gamma, density, experts)
        assert not (diff & ~tied).any(), (name, int((diff & ~tied).sum()))
        differing += int(diff.sum())
        at_ties += int(tied.sum())
    print(f"{method} {case}: {differing} entries differ, all tied at a cut-off ({at_ties} tied entries)")
    # one expert, weight 1: exactly mergekit's kept count (output != base where an entry is kept)
    _, o1, t1 = merge_both(bfam, _cfg(bfam, method, gamma, density, experts=(1,), weights=(1.0,)),
                           f"{method}-{case}-one")
    base = bfam["base_t"]
    kept_o = sum(int((o1[n] != base[n]).sum()) for n in o1)
    kept_t = sum(int((t1[n] != base[n]).sum()) for n in t1)
    assert kept_o == kept_t, (kept_o, kept_t)
