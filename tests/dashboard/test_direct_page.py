"""A fresh server whose very first request opens a page directly (/plan) shows the app's page: Streamlit runs a
script of the pages/ folder on its own (its automatic page list: "app, catalog, ..., ui", no wide layout, no
catalog caption) until app.py's st.navigation has run once in the process; every page goes through app.py.
Real browser (Debian chromium, Playwright) against `mergepipe dashboard`'s server, as in test_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard_helpers import CHROMIUM, build_catalog, chromium_page, dashboard_server

pytestmark = pytest.mark.e2e

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
NAV = ["Home", "Models", "Catalog", "Plan", "Run", "Snapshots", "Compare", "Lineage", "Sweeps", "Search"]

import playwright.sync_api as playwright_sync  # noqa: E402

if not Path(CHROMIUM).exists():
    pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install -y chromium)", pytrace=False)
expect = playwright_sync.expect


@pytest.fixture
def server(tmp_path):
    built = build_catalog(tmp_path / "built", merged=False)
    with dashboard_server(built.db, tmp_path) as url:
        yield {"url": url, "db": built.db}


@pytest.fixture
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile") as pg:
        yield pg


def _nav_labels(page) -> list[str]:
    links = page.locator("[data-testid='stSidebarNav'] a")
    return [t.strip().splitlines()[-1].strip() for t in links.all_inner_texts()]  # after the icon's name


def test_plan_first_on_a_fresh_server_is_the_app_page(server, page):
    page.goto(server["url"] + "/plan?op=ties", wait_until="domcontentloaded")
    page.wait_for_selector(IDLE, timeout=120_000)
    expect(page.get_by_role("heading", name="Plan", exact=True)).to_be_visible(timeout=90_000)
    page.wait_for_selector(IDLE, timeout=120_000)
    expect(page.locator("[data-testid='stSidebarNav'] a")).to_have_count(len(NAV), timeout=30_000)
    assert _nav_labels(page) == NAV
    assert "ui" not in [t.lower() for t in _nav_labels(page)]
    expect(page.get_by_text(f"Catalog: {server['db']}")).to_be_visible()  # app.py's sidebar caption
    # app.py's wide layout (st.set_page_config(layout="wide")): the main block is not the centered 736 px one
    width = page.locator("[data-testid='stMainBlockContainer']").bounding_box()["width"]
    assert width > 900, width
    assert page.url.split("?")[0].endswith("/plan")
    assert "op=ties" in page.url  # the query parameters survive
    assert page.locator("[data-testid='stException']").count() == 0

    # the next page opened from the navigation is the app's too
    page.locator("[data-testid='stSidebarNav'] a", has_text="Run").click()
    page.wait_for_selector(IDLE, timeout=120_000)
    expect(page.get_by_role("heading", name="Run", exact=True)).to_be_visible(timeout=60_000)
    assert _nav_labels(page) == NAV
