"""The Sweeps page (AppTest): the recorded sweeps, a sweep's points and its frontier chart, from a
real local sweep over the dashboard test family."""

from __future__ import annotations

import pytest

from mergepipe import api

from dashboard_helpers import EXPERTS, build_catalog, open_page, page_env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("sweeps-page"), merged=False)


def test_sweeps_page_empty_says_how_to_start(built, tmp_path, monkeypatch):
    page_env(built, tmp_path, monkeypatch)
    at = open_page("sweeps")
    assert "No sweeps yet" in at.info[0].value


def test_sweeps_page_shows_points_and_frontier(built, tmp_path, monkeypatch):
    env = page_env(built, tmp_path, monkeypatch)
    cfg = tmp_path / "s.yml"
    cfg.write_text(f"name: pg\nbase: base\nexperts: {list(EXPERTS)}\nout: {tmp_path / 'outs'}\n"
                   "grid: {operator: [linear, ties], budget: ['30%', '100%']}\nsettings: {density: 0.5}\n")
    cat = api.Catalog(env["db"])
    try:
        res = api.run_sweep(cat, api.load_sweep(cfg))
    finally:
        cat.close()
    at = open_page("sweeps")
    sweeps_table, points = at.dataframe[0].value, at.dataframe[1].value
    assert list(sweeps_table["id"]) == [res["sweep_id"]] and list(sweeps_table["points"]) == [4]
    assert list(points["status"]) == ["published"] * 4
    assert list(points["snapshot"]) == [p["snapshot_id"] for p in res["points"]]
    # not evaluated: placed by the planner's error bound (ties' is the sound, loose sparsified one)
    assert list(points["metric"]) == ["error bound"] * 4
    bounds = [p["error_bound"] for p in res["points"]]
    assert list(points["quality"]) == bounds and bounds[1] < bounds[0] and bounds[3] < bounds[2]
    assert list(points["frontier"][:2]) == [True, True]  # more bytes, smaller bound: both kept
    assert len(at.get("plotly_chart")) == 1
