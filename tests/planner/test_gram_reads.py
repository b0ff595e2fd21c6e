"""Reading the Gram statistics for planning (catalog/gram.py): the per-tensor matrices read as values only (every
pair stored) equal those read with their keys, byte for byte; sce and ramplus_tl, which read no dot product between
two experts, count the pairs instead of reading them and still refuse a catalog that lacks one; the plans, and
their digests, are those of the row-by-row reads."""

from __future__ import annotations

import numpy as np
import pytest

from mergepipe import api
from mergepipe.analyze.runner import analyze
from mergepipe.catalog import gram as gram_reads
from mergepipe.catalog.gram import load_gram, load_gram_matrices, pack, unpack
from mergepipe.errors import PlanError
from mergepipe.planner import methods

from merge_helpers import open_copy, shared_family

GRAM_OPS = ("model_stock", "karcher", "sce", "ramplus_tl")


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


@pytest.fixture()
def cat(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    analyze(cat, fam.expert_ids, gram=True, block_bytes=fam.spec.block_bytes)
    yield cat
    cat.close()


def _by_rows(cat, ids):
    """The matrices built from load_gram's rows one at a time (the reference)."""
    pos = {"": 0, **{e: i + 1 for i, e in enumerate(ids)}}
    out = {}
    for tensor, rows in load_gram(cat, "base", ids).items():
        m = out[tensor] = np.full((len(pos), len(pos)), np.nan)
        for (a, b), value in rows.items():
            m[pos[a], pos[b]] = m[pos[b], pos[a]] = value
    return out


def _drop_pair(cat, a: str, b: str, first_tensor_only: bool = False) -> None:
    """Delete the stored pair (a, b) of the base (on the first tensor only): its entry in the packed row
    (base, tensor, a) (catalog/gram.py)."""
    rows = cat.conn.execute("SELECT tensor, b, value FROM gram WHERE base_id = 'base' AND a = ? ORDER BY tensor",
                            [a]).fetchall()
    for tensor, bs, value in rows[:1] if first_tensor_only else rows:
        entries = unpack(bs, value)
        del entries[b]
        cat.conn.execute("UPDATE gram SET b = ?, value = ? WHERE base_id = 'base' AND tensor = ? AND a = ?",
                         [*pack(entries), tensor, a])


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[t].tobytes() == b[t].tobytes() for t in a)


def test_matrices_equal_the_rows(cat, fam):
    ids = list(fam.expert_ids)
    for order in (ids, ids[::-1], ids[:2]):
        assert _same(load_gram_matrices(cat, "base", order), _by_rows(cat, order))
    # a pair missing: the keys are read (NaN there), still equal
    _drop_pair(cat, *sorted(ids[:2]), first_tensor_only=True)
    got = load_gram_matrices(cat, "base", ids)
    assert _same(got, _by_rows(cat, ids))
    assert any(np.isnan(m).any() for m in got.values())


def _digests(cat, ids):
    out = {}
    for op in GRAM_OPS:
        for budget in ("50%", "100%"):
            out[op, budget] = api.plan(cat, api.merge_request("base", ids, op, budget=budget), save=False).digest
    return out


def test_plans_equal_the_row_reads(cat, fam, monkeypatch):
    ids = list(fam.expert_ids)
    fast = _digests(cat, ids)
    monkeypatch.setattr(gram_reads, "_complete_matrices", lambda *a: None)
    monkeypatch.setattr(methods, "DIAGONAL_METHODS", ())
    assert _digests(cat, ids) == fast


@pytest.mark.parametrize("op", ["sce", "ramplus_tl", "model_stock"])
def test_a_missing_pair_is_refused(cat, fam, op):
    ids = list(fam.expert_ids)
    api.plan(cat, api.merge_request("base", ids, op, budget="100%"), save=False)
    _drop_pair(cat, *sorted(ids[:2]))
    with pytest.raises(PlanError, match="dot products of the experts' deltas"):
        api.plan(cat, api.merge_request("base", ids, op, budget="100%"), save=False)
