"""breadcrumbs' per-tensor statistics from the stored grid cut down to what its two cut-offs read
(planner/candidates._outlier_cut: the served fractions, its own, and the one stored 0 that tells) equal those of
the whole stored grid (ops.core.tensor_statistics), for many densities and gammas; TIES' too."""

from __future__ import annotations

import pytest

from mergepipe.catalog.packed import unpack
from mergepipe.ops.core import get_op, resolve_params, tensor_statistics, threshold_fractions
from mergepipe.planner.candidates import _statistics

from merge_helpers import open_copy, shared_family


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    fam = shared_family(tmp_path_factory, "tiny-bf16")
    cat = open_copy(fam, tmp_path_factory.mktemp("cut") / "c.sqlite")
    try:
        return cat.conn.execute("SELECT thresholds, topk, delta_l1, delta_max_abs, numel FROM tensor_stats "
                                "WHERE topk IS NOT NULL AND delta_nnz > 0").fetchall()
    finally:
        cat.close()


@pytest.mark.parametrize("name", ["breadcrumbs", "breadcrumbs_ties", "ties"])
def test_cut_statistics_equal_the_whole_grid(rows, name):
    spec = get_op(name)
    assert rows
    for density in (0.01, 0.1, 0.2, 0.5, 0.79, 0.9, 0.99, 1.0):
        for gamma in (0.0, 0.01, 0.1, 0.5):
            params = resolve_params(spec, gamma=gamma) if "breadcrumbs" in name else resolve_params(spec)
            fracs = threshold_fractions(spec, density, params)
            for text, topk, l1, max_abs, numel in rows:
                want = tensor_statistics(spec, density, params, unpack(text), unpack(topk), l1, max_abs, numel)
                got = _statistics(spec, density, params, fracs, text, topk, l1, max_abs, numel)
                assert repr(got) == repr(want)
