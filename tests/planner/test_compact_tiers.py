"""Three-way selection (planner/tiers.py) on synthetic candidate tables: the budget is never exceeded (exact +
compact bytes), each candidate's upgrades are taken in order, the selection without compacts is the exact-only
greedy's, the residuals are what each tier leaves out, and the greedy prefix's bound never rises."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from mergepipe.planner.candidates import Candidates
from mergepipe.planner.tiers import EXACT, OMIT, Tiers, _lower_hull
from mergepipe.storage.codecs import level_bytes


def table(seed: int, n: int, setup: bool = False, with_compact: bool = True, group: int = 32):
    rng = np.random.default_rng(seed)
    expert = rng.integers(0, 3, n)
    tensor = rng.integers(0, 4, n)
    block = np.arange(n)
    entries = rng.integers(8, 512, n)
    nbytes = entries * 2  # bf16
    l2 = rng.gamma(2.0, 1.0, n)
    coef = rng.uniform(0.1, 1.0, n)
    bound = coef * l2
    # one-off bytes are per (expert, tensor), as a LoRA adapter's A matrix: expert 0 is the adapter here
    one_off = np.where(expert == 0, 16 * (tensor + 1), 0).astype(np.int64)
    cands = Candidates(expert, tensor, block, nbytes.astype(np.int64), bound.copy(), bound,
                       setup=one_off if setup else None)
    frac = {1: rng.uniform(0.4, 0.9, n), 2: rng.uniform(0.2, 0.8, n), 4: rng.uniform(0.05, 0.3, n)}
    errors = {lv: l2 * frac[lv] for lv in (1, 2, 4)}
    have = (rng.random(n) < 0.8) if with_compact else np.zeros(n, dtype=bool)
    tiers = Tiers(cands, coef, np.ones(n), np.where(have, entries, 0), errors,
                  np.where(have, group, 0), (1, 2, 4), offsets=np.zeros(n, dtype=np.int64))
    return cands, tiers, coef, errors, entries, have


def spent(cands, tiers, tier) -> int:
    exact = np.nonzero(tier == EXACT)[0]
    return int(cands.bytes_of(exact).sum()) + int(tiers.compact_read(tier).sum())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60), frac=st.floats(0, 1.2), setup=st.booleans())
def test_budget_is_never_exceeded_and_residuals_are_the_tiers(seed, n, frac, setup):
    cands, tiers, coef, errors, entries, have = table(seed, n, setup)
    budget = int(frac * cands.full_bytes)
    tier = tiers.select(budget)
    assert spent(cands, tiers, tier) <= budget
    assert set(np.unique(tier)) <= {OMIT, 1, 2, 4, EXACT}
    assert not (~have & (tier != OMIT) & (tier != EXACT)).any()  # no compact where none is stored
    res = tiers.residual(tier)
    for i, t in enumerate(tier):
        want = {OMIT: cands.bound_term[i], EXACT: 0.0}.get(int(t))
        if want is None:
            want = coef[i] * errors[int(t)][i]
            assert tiers.compact_read(tier)[i] == level_bytes(int(entries[i]), 32, int(t))
        assert res[i] == want
    if budget >= cands.full_bytes:
        assert (tier == EXACT).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60), frac=st.floats(0, 1.0))
def test_without_compacts_the_selection_is_the_exact_only_greedy(seed, n, frac):
    cands, tiers, *_ = table(seed, n, with_compact=False)
    budget = int(frac * cands.full_bytes)
    tier = tiers.select(budget)
    assert set(np.nonzero(tier == EXACT)[0]) == set(cands.select(budget).tolist())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 60))
def test_greedy_prefix_bound_never_rises_and_reaches_zero(seed, n):
    cands, tiers, *_ = table(seed, n)
    bounds = [b for _, b in tiers.frontier(25)]
    assert all(b2 <= b1 + 1e-12 for b1, b2 in zip(bounds, bounds[1:]))
    assert bounds[-1] == 0.0 and bounds[0] == float(cands.bound_term.sum())


def test_upgrades_follow_each_chain():
    """The greedy takes a candidate's upgrades in order (omit -> ... -> exact): the tiers at every budget are
    each on the candidate's hull."""
    cands, tiers, *_ = table(7, 40)
    seg = tiers.seg
    for budget in range(0, cands.full_bytes + 1, max(1, cands.full_bytes // 50)):
        tier = tiers.select(budget)
        for i in range(len(tier)):
            chain = [OMIT] + [int(t) for t in seg["to"][seg["cand"] == i]]
            assert int(tier[i]) in chain


def test_lower_hull():
    # (cost, residual, tier): a dominated level (costs more, leaves more) and a point above the chord go
    opts = [(0, 10.0, OMIT), (10, 9.0, 1), (20, 9.5, 2), (30, 1.0, 4), (100, 0.0, EXACT)]
    assert [o[2] for o in _lower_hull(opts)] == [OMIT, 4, EXACT]
    opts = [(0, 10.0, OMIT), (10, 6.0, 1), (20, 7.0, 2), (30, 1.0, 4), (100, 0.0, EXACT)]
    assert [o[2] for o in _lower_hull(opts)] == [OMIT, 1, 4, EXACT]  # 6 < the chord's 7 at cost 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1000), st.floats(0, 100)), min_size=0, max_size=4), st.floats(0.01, 100))
def test_vectorized_hulls_equal_the_reference(levels, omit_res):
    """planner/tiers._lower_hulls (all candidates at once) keeps exactly the options _lower_hull keeps."""
    from mergepipe.planner.tiers import _lower_hulls
    opts = sorted([(0, omit_res, OMIT)] + [(c, r, 10 + i) for i, (c, r) in enumerate(levels)] + [(2000, 0.0, EXACT)],
                  key=lambda o: (o[0], o[1]))
    want = [o[2] for o in _lower_hull(opts)]
    cost = np.array([[o[0] for o in opts]], dtype=np.float64)
    res = np.array([[o[1] for o in opts]], dtype=np.float64)
    stack, size = _lower_hulls(cost, res)
    assert [opts[j][2] for j in stack[0, :size[0]]] == want
