"""The dashboard on the demo catalog (`mergepipe demo`: a small bf16 family, four analyzed experts with compact
deltas, one TIES merge), in a real browser (Debian chromium, Playwright) at a laptop's 1280x800 viewport: what a
new user saw there (issue 28). Settings set from a callback (an applied YAML, a loaded mergekit file, the
suggested budget, the switch to a target bound) log no Streamlit warning; the budget slider is visible without
scrolling; the charts' titles, legends and tick labels do not overlap, byte axes are in MiB/KiB and labels are at
least 11 px; Home counts the demo's merge. Nothing is installed at run time (never `playwright install`)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dashboard_helpers import free_port, wait_for_health
from mergepipe.cli.demo import build_demo
from mergepipe.dashboard.server import run_dashboard

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
VIEWPORT = {"width": 1280, "height": 800}

import playwright.sync_api as playwright_sync  # noqa: E402

expect = playwright_sync.expect
expect.set_options(timeout=30_000)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install -y chromium)", pytrace=False)
    root = tmp_path_factory.mktemp("demo")
    res = build_demo(root / "demo", log=lambda *a: None)
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = run_dashboard(res["db"], port=port, extra_roots=[root], wait=False, stdout=log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_health(url, timeout=90, proc=proc)
            yield {"url": url, "log": log_path, "root": root, **res}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def page(demo, tmp_path_factory):
    with playwright_sync.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM,
                                                   headless=True, viewport=VIEWPORT,
                                                   args=["--headless", "--no-sandbox", "--disable-gpu"])
        ctx.set_default_timeout(60_000)
        pg = ctx.pages[0] if ctx.pages else ctx.new_page()
        # a first visit to the root runs app.py, which registers the pages: a fresh server sent straight to
        # /plan runs pages/plan.py on its own (Streamlit's pages/ discovery), without app.py's wide layout
        pg.goto(demo["url"] + "/")
        pg.wait_for_selector(IDLE, timeout=90_000)
        try:
            yield pg
        finally:
            ctx.close()


def open_page(page, demo, path: str, charts: int = 0):
    """Load ``path`` and wait until the app is idle and ``charts`` Plotly charts are drawn."""
    page.goto(demo["url"] + path)
    page.wait_for_selector(IDLE, timeout=90_000)
    if charts:
        page.wait_for_function("n => { const p = [...document.querySelectorAll('.js-plotly-plot')];"
                               " return p.length >= n && p.every(e => e._fullLayout); }", arg=charts, timeout=60_000)
        page.wait_for_timeout(300)


def idle(page):
    page.wait_for_selector(IDLE, timeout=90_000)


def expect_value(page, locator, value: str, timeout_s: float = 30.0):
    """``locator`` settles on one element holding ``value``: a rerun may briefly draw a stale twin beside the
    widget, so both conditions are polled together (checking the count, then the value, races a second rerun)."""
    deadline = time.monotonic() + timeout_s
    values: list = []
    while time.monotonic() < deadline:
        idle(page)
        values = locator.evaluate_all("els => els.map(e => e.value)")
        if values == [value]:
            return
        page.wait_for_timeout(200)
    raise AssertionError(f"expected one element holding {value!r}, found {values!r}")


def server_log(demo) -> str:
    return demo["log"].read_text(errors="replace")


def assert_quiet_log(demo):
    log = server_log(demo)
    assert "was created with a default value" not in log, log[-3000:]
    assert "Traceback" not in log and "Stack (most recent call last)" not in log, log[-3000:]


# --- 1: settings set from callbacks log nothing ---------------------------------------------------------------
def test_plan_settings_from_callbacks_log_no_streamlit_warning(demo, page):
    open_page(page, demo, "/plan")
    slider = page.locator("[data-testid='stSlider'] input[type='range']")
    expect_value(page, slider, "25")
    # apply an edited YAML: the experts, operator, weights and budget are set through session state
    page.get_by_text("Settings as mergekit YAML").click()
    area = page.locator("[data-testid='stTextArea'] textarea")
    text = area.input_value()
    assert "budget: 25%" in text, text
    area.fill(text.replace("budget: 25%", "budget: 40%"))
    area.press("Control+Enter")
    idle(page)
    page.get_by_role("button", name="Apply to the settings").click()
    expect(page.get_by_text("Applied the YAML: linear of expert_1, expert_2, expert_3, expert_4 on base, "
                            "budget 40%.")).to_be_visible()
    expect_value(page, slider, "40")
    idle(page)
    # the suggested budget moves the slider from a callback too
    use = page.get_by_role("button", name=re.compile(r"^Use \d+ %$"))
    suggested = use.inner_text().split()[1]
    use.click()
    expect_value(page, slider, suggested)
    idle(page)
    # the switch to a target bound sets the target from a callback
    page.get_by_text("target bound", exact=True).click()
    expect(page.get_by_role("spinbutton", name="Target relative error bound")).to_be_visible()
    idle(page)
    # a mergekit file loaded by path
    yml = demo["root"] / "merge.yml"
    yml.write_text("merge_method: ties\nbase_model: base\nmodels:\n  - model: expert_1\n    parameters: {weight: 0.5}\n"
                   "  - model: expert_2\n    parameters: {weight: 1.5}\nparameters: {density: 0.4}\n")
    page.get_by_text("Load a mergekit YAML").click()
    page.get_by_role("textbox", name="... or its path").fill(str(yml))
    page.get_by_role("textbox", name="... or its path").press("Enter")
    idle(page)
    page.get_by_role("button", name="Load settings").click()
    expect(page.get_by_text("Loaded merge.yml: ties of expert_1, expert_2 on base.")).to_be_visible()
    idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    assert_quiet_log(demo)


# --- 2: the budget slider above the fold ------------------------------------------------------------------------
@pytest.mark.parametrize("query", ["", "?op=ties"], ids=["linear", "ties"])
def test_plan_budget_slider_visible_without_scrolling(demo, page, query):
    open_page(page, demo, "/plan" + query)
    slider = page.locator("[data-testid='stSlider']")
    expect(slider).to_contain_text("Expert-read budget")
    box = slider.bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT["height"], box
    expect(slider).to_be_in_viewport(ratio=1.0)
    assert page.evaluate("() => Math.max(window.scrollY, ...[...document.querySelectorAll('*')]"
                         ".map(e => e.scrollTop))") == 0  # nothing was scrolled


# --- 6: the charts' layout in the browser -------------------------------------------------------------------------
BOXES = """() => [...document.querySelectorAll('.js-plotly-plot')].map(p => {
    const box = e => { const b = e.getBoundingClientRect(); return {x: b.x, y: b.y, w: b.width, h: b.height}; };
    return {title: [...p.querySelectorAll('.gtitle')].map(e => ({text: e.textContent, ...box(e)})),
            legend: [...p.querySelectorAll('.legend')].map(box),
            xticks: [...p.querySelectorAll('.xtick text')].map(e => ({text: e.textContent, ...box(e),
                     size: parseFloat(getComputedStyle(e).fontSize)})),
            bartext: [...p.querySelectorAll('text.bartext')].map(e => ({text: e.textContent, ...box(e)}))};
})"""


def overlap(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]


def assert_readable(chart: dict):
    title = chart["title"][0]
    for legend in chart["legend"]:
        assert not overlap(title, legend), (title, legend)
    ticks = chart["xticks"]
    assert ticks and all(t["size"] >= 11 for t in ticks), ticks
    for i, a in enumerate(ticks):
        for b in ticks[i + 1:]:
            assert not overlap(a, b), (a, b)


def test_plan_mask_title_legend_and_ticks_do_not_overlap(demo, page):
    open_page(page, demo, "/plan", charts=2)
    charts = page.evaluate(BOXES)
    mask = next(c for c in charts if c["title"] and c["title"][0]["text"].startswith("access mask"))
    assert_readable(mask)
    assert mask["xticks"][-1]["text"] == "other, head"


def test_snapshot_charts_binary_units_and_readable_labels(demo, page):
    open_page(page, demo, f"/snapshots?snapshot={demo['snapshot_id']}", charts=3)
    charts = page.evaluate(BOXES)
    bars = [c for c in charts if c["bartext"]]
    assert len(bars) == 2  # expert bytes per expert and per tensor
    for chart in bars:
        assert_readable(chart)
        labels = [t["text"] for t in chart["xticks"]]
        assert labels[0] == "0" and all(t.endswith(("KiB", "MiB")) for t in labels[1:]), labels
        assert all(t["h"] >= 11 for t in chart["bartext"]), chart["bartext"]  # not shrunk to the bar's ~7 px
    touched = next(c for c in charts if c["title"] and c["title"][0]["text"].startswith("touched blocks"))
    assert_readable(touched)


# --- 4: Home counts the demo's merge -----------------------------------------------------------------------------
def test_home_counts_the_demo_merge(demo, page):
    open_page(page, demo, "/")
    runs = page.locator("[data-testid='stMetric']", has_text="Runs").locator("[data-testid='stMetricValue']")
    expect(runs).to_have_text("1")
    expect(page.get_by_text("No runs yet.")).to_have_count(0)
    expect(page.get_by_text("A merge made from the command line has no run number")).to_be_visible()
    assert_quiet_log(demo)
