"""The Plan page with 64 experts in a real browser (Debian chromium, Playwright) against `mergepipe dashboard`'s
server, opened the way a user does: the first request to a freshly started server is /plan (or a shared /plan link).

That first run is Streamlit's run of pages/plan.py on its own (app.py's st.navigation has not run yet in the
process), whose widgets have other ids than in every later run through app.py. A rerun (one budget step, a typed
expert search) then met widgets it had never seen: the Experts multiselect fell back to an empty default and the
page said "choose at least one expert" (AppTest and a page reached from the navigation never show it; three
experts opened the same way lost them too)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dashboard_helpers import CHROMIUM, build_catalog, chromium_page, dashboard_server
from many_experts_helpers import K, expert_ids, many_experts_catalog

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"

import playwright.sync_api as playwright_sync  # noqa: E402

if not Path(CHROMIUM).exists():
    pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install -y chromium)", pytrace=False)
expect = playwright_sync.expect


@pytest.fixture
def server(tmp_path, tmp_path_factory):
    """A fresh server (nothing has run in it yet) on a private copy of the 64-expert catalog."""
    db = tmp_path / "catalog.sqlite"
    shutil.copy(many_experts_catalog(tmp_path_factory), db)
    with dashboard_server(db, tmp_path) as url:
        yield url


@pytest.fixture
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile", timeout_ms=90_000) as pg:
        yield pg


def idle(page):
    page.wait_for_timeout(300)  # a key press or Enter starts its rerun a moment later
    page.wait_for_selector(IDLE, timeout=120_000)


def chips(page) -> list[str]:
    """The experts the Experts multiselect holds (its chips)."""
    return page.locator(".st-key-experts [data-tag]").evaluate_all("els => els.map(e => e.getAttribute('aria-label'))")


def assert_plan_of(page, experts: list[str]):
    """The multiselect holds ``experts`` and the page shows their plan (the bytes it reads), no error."""
    n = len(experts)
    expect(page.get_by_text(re.compile(rf"^{n} experts?: "))).to_be_visible(timeout=60_000)
    expect(page.locator(".st-key-experts [data-tag]")).to_have_count(n)  # the chips are drawn a moment later
    assert sorted(chips(page)) == sorted(experts)
    caption = page.get_by_text(re.compile(rf"^{n} experts?: ")).inner_text()
    assert sorted(caption.split(": ", 1)[1].split(", ")) == sorted(experts)
    read = page.locator("[data-testid='stMetric']", has_text="Estimated expert read")
    expect(read.locator("[data-testid='stMetricValue']")).to_have_text(re.compile(r"^\d[\d.]* (B|KiB|MiB)$"))
    assert page.get_by_text("choose at least one expert").count() == 0
    assert page.locator("[data-testid='stException']").count() == 0


def step_budget(page, want: int):
    slider = page.locator(".st-key-budget input[type='range']")
    slider.focus()
    slider.press("ArrowRight")
    expect(slider).to_have_value(str(want))
    idle(page)
    expect(page.get_by_text(re.compile(rf"^Budget .* \({want}%\) · read ")),
           f"the plan at {want}% after the rerun (not 'choose at least one expert')").to_be_visible()


def search(page, text: str):
    box = page.locator(".st-key-mask_search input")
    box.fill(text)
    box.press("Enter")
    idle(page)
    expect(page.get_by_text(f"(matching '{text}': "), f"the mask searched for {text!r} after the rerun").to_be_visible()


def test_first_request_to_plan_then_reruns_keep_the_64_experts(server, page):
    page.goto(server + "/plan")
    expect(page.get_by_role("heading", name="Plan", exact=True)).to_be_visible(timeout=120_000)
    idle(page)
    assert_plan_of(page, expert_ids())  # every analyzed expert, the default
    slider = page.locator(".st-key-budget input[type='range']")
    expect(slider).to_have_value("25")
    step_budget(page, 26)
    assert_plan_of(page, expert_ids())
    assert "budget=26" in page.url and "experts=" not in page.url  # the default selection stays out of the URL
    search(page, "e1*")
    assert_plan_of(page, expert_ids())
    expect(page.get_by_text(f"11 of {K} experts drawn")).to_be_visible()
    step_budget(page, 27)
    assert_plan_of(page, expert_ids())


def test_shared_link_restores_the_selection_and_reruns_keep_it(server, page):
    chosen = ["e2", "e17", "e33", "e64"]
    page.goto(server + "/plan?" + "&".join(f"experts={e}" for e in chosen) + "&budget=40")
    expect(page.get_by_role("heading", name="Plan", exact=True)).to_be_visible(timeout=120_000)
    idle(page)
    assert_plan_of(page, chosen)
    expect(page.locator(".st-key-budget input[type='range']")).to_have_value("40")
    step_budget(page, 41)
    assert_plan_of(page, chosen)
    assert all(f"experts={e}" in page.url for e in chosen) and "budget=41" in page.url
    # the link of the page as it is now restores it in a new session
    link = page.url
    page.goto("about:blank")
    page.goto(link)
    expect(page.get_by_role("heading", name="Plan", exact=True)).to_be_visible(timeout=120_000)
    idle(page)
    assert_plan_of(page, chosen)
    expect(page.locator(".st-key-budget input[type='range']")).to_have_value("41")


def test_three_experts_the_same(tmp_path, page):
    """Not a matter of 64: three experts, the first request to a fresh server being /plan, lost them too."""
    built = build_catalog(tmp_path / "built", merged=False)
    with dashboard_server(built.db, tmp_path) as url:
        page.goto(url + "/plan")
        expect(page.get_by_role("heading", name="Plan", exact=True)).to_be_visible(timeout=120_000)
        idle(page)
        assert_plan_of(page, list(built.experts))
        step_budget(page, 26)
        assert_plan_of(page, list(built.experts))
