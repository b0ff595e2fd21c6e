"""The Plan page with 64 experts: the access mask draws the top 16 experts by bytes read (a slider for how many,
a search box over expert ids), with a caption naming what the others read; the plan itself is unchanged."""

from __future__ import annotations

import json
import shutil

import pytest

from dashboard_helpers import open_page
from many_experts_helpers import K, expert_ids, many_experts_catalog
from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.dashboard import views

pytestmark = pytest.mark.slow  # a 64-expert catalog built once per session


@pytest.fixture(scope="module")
def db64(tmp_path_factory):
    db = tmp_path_factory.mktemp("plan-k64") / "c.sqlite"
    shutil.copy(many_experts_catalog(tmp_path_factory), db)
    return db


@pytest.fixture(scope="module")
def view64(db64):
    cat = Catalog(db64)
    ctx = views.plan_context(cat, "base", expert_ids(), "linear")
    yield ctx, views.plan_view(ctx, 10)
    cat.close()


def _rows(fig) -> list[str]:
    return [str(y) for y in fig.data[0].y]


def test_mask_draws_the_top_16_by_bytes_read(view64):
    ctx, view = view64
    plan = view.plan
    read = plan.estimated_by_expert
    ranked = sorted(expert_ids(), key=lambda e: (-read[e], expert_ids().index(e)))
    assert _rows(view.mask) == ranked[:16]
    fig, caption = views.plan_mask(view)
    assert _rows(fig) == ranked[:16] and len(view.mask_matrix) == K
    rest = sum(read[e] for e in ranked[16:])
    assert caption == (f"16 of 64 experts drawn, most bytes read first; the other 48 read {api.human_bytes(rest)} "
                       f"({100 * rest / sum(read.values()):.1f} % of the expert read)")
    every, _ = views.plan_mask(view, top=K)
    assert _rows(every) == ranked and len(_rows(every)) == 64


def test_mask_search_and_pattern(view64):
    _, view = view64
    fig, caption = views.plan_mask(view, search="E1")  # case-insensitive part of the id
    assert sorted(_rows(fig)) == sorted(["e1", *[f"e{i}" for i in range(10, 20)]])
    assert "(matching 'E1': 11)" in caption
    fig, caption = views.plan_mask(view, top=3, search="e6?")
    assert len(_rows(fig)) == 3 and set(_rows(fig)) <= {f"e{i}" for i in range(60, 65)}
    assert views.plan_mask(view, search="nothing-like-this")[0] is None


def test_mask_rows_change_no_plan(view64):
    ctx, view = view64
    before = view.plan.to_json()
    views.plan_mask(view, top=5, search="e2")
    assert view.plan.to_json() == before
    again = api.plan(ctx.catalog, api.merge_request("base", expert_ids(), "linear", budget="10%"), save=False)
    assert again.digest == view.plan.digest


def test_plan_page_with_64_experts(db64, tmp_path, monkeypatch):
    db = tmp_path / "c.sqlite"
    shutil.copy(db64, db)
    monkeypatch.setenv("MERGEPIPE_DB", str(db))
    monkeypatch.setenv("MERGEPIPE_ALLOWED_ROOTS", str(tmp_path))
    at = open_page("plan", {"budget": "10"})

    def mask_rows() -> list[str]:
        for el in at.get("plotly_chart"):
            if "mask_chart" in el.proto.id:
                return [str(y) for y in json.loads(el.proto.spec)["data"][0]["y"]]
        return []
    assert at.slider(key="mask_top").value == 16 and len(mask_rows()) == 16
    assert any("16 of 64 experts drawn" in c.value for c in at.caption)
    at.text_input(key="mask_search").input("e1*").run()
    assert sorted(mask_rows()) == sorted(["e1", *[f"e{i}" for i in range(10, 20)]]) and not at.exception
    at.text_input(key="mask_search").input("").run()
    at.slider(key="mask_top").set_value(64).run()
    assert len(mask_rows()) == 64 and not at.exception
