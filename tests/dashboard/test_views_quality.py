"""Views added for issue 16's second half: the cached per-budget plan view and per-snapshot view, task
suites in Evaluate, and Compare of plans with quality scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.dashboard import views
from dashboard_helpers import build_catalog, copy_catalog


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("quality"))


@pytest.fixture
def cat(built, tmp_path):
    c = Catalog(copy_catalog(built.db, tmp_path / "c.sqlite"))
    yield c
    c.close()


def test_plan_view_is_the_plan_and_its_figures(cat, built):
    ctx = views.plan_context(cat, "base", list(built.experts), "linear")
    v = views.plan_view(ctx, budget_pct=40)
    p = views.make_plan(ctx, budget_pct=40)
    assert v.plan.id == p.id and v.plan["access"] == p["access"]
    mask = views.mask_matrix(ctx, p)
    z = np.asarray(v.mask.data[0].z)
    assert z.dtype == np.float32 and np.array_equal(z, mask.to_numpy(dtype=np.float32))
    x, y = views.current_point(ctx, p, True)
    assert v.frontier.data[-1].x[0] == pytest.approx(x) and v.frontier.data[-1].y[0] == pytest.approx(y)
    assert v.explain == p.explain()
    t = views.plan_view(ctx, target_rel=0.5)
    assert t.plan.id == views.make_plan(ctx, target_rel=0.5).id


def test_snapshot_view_matches_the_single_views(cat, built):
    v = views.snapshot_view(cat, built.snapshot_id)
    m = views.load_manifest(cat, built.snapshot_id)
    assert v.manifest.manifest_hash == m.manifest_hash and v.manifest_json == m.to_json()
    assert v.recipe == views.snapshot_recipe(cat, built.snapshot_id) and v.recipe_error is None
    assert v.summary.equals(views.manifest_summary(m))
    assert v.by_tensor.equals(views.bytes_by_tensor_df(m, views.manifest_plan(cat, m)))
    tm = views.touched_matrix(cat, m)
    assert np.array_equal(np.asarray(v.touched.data[0].z), tm.to_numpy(dtype=np.float32))
    assert [b.name for b in v.by_expert.data] == [b.name for b in views.bytes_bars(views.bytes_by_expert_df(m),
                                                                                    "expert").data]

