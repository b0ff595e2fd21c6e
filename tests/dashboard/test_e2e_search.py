"""End-to-end: the Search page in a real browser (Debian chromium, Playwright) against `mergepipe dashboard`'s
server on a fresh analyzed family: a search YAML typed into the page is checked, launched as its own process
(3 trials at 30 % then 100 %, a Python objective in the page's working folder) and watched until it has finished
in the trials table; the score chart and the download of the best recipe are there; "Publish the best" merges
it in another process and the page shows the snapshot id. Nothing is installed at run time."""

from __future__ import annotations

import csv
import io
import re
import time
from pathlib import Path

import pytest

from dashboard_helpers import CHROMIUM, build_catalog, chromium_page, dashboard_server
from mergepipe import api

pytestmark = pytest.mark.e2e

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"

import playwright.sync_api as playwright_sync  # noqa: E402  (installed by scripts/setup.sh: the [test] extra)

if not Path(CHROMIUM).exists():  # a missing browser fails the suite: the e2e test is never skipped
    pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install -y chromium)", pytrace=False)
expect = playwright_sync.expect

OBJECTIVE = '''
from pathlib import Path
from safetensors.torch import load_file

REF = {{}}
for f in sorted(Path({ref!r}).glob("*.safetensors")):
    REF.update(load_file(f))


def score(sd):
    """Closeness of the merged weights to expert_1's (higher: closer)."""
    return -sum(float((sd[k].double() - v.double()).norm()) for k, v in REF.items() if v.is_floating_point())
'''
SEARCH_YAML = """merge_method: task_arithmetic
base_model: base
models:
  - model: expert_1
    parameters: {weight: {range: [0.1, 1.0]}}
  - model: expert_2
    parameters: {weight: {range: [0.1, 1.0]}}
search: {name: e2e, trials: 3, sampler: random, seed: 0, objective: {python: objective.py:score},
         fidelities: [30%, 100%]}
"""


@pytest.fixture
def server(tmp_path):
    built = build_catalog(tmp_path / "built", merged=False)
    work = built.root / "catalog-searches"  # the page's working folder: beside the catalog
    work.mkdir()
    (work / "objective.py").write_text(OBJECTIVE.format(ref=str(built.family / "expert_1")))
    with dashboard_server(built.db, tmp_path) as url:
        yield {"url": url, "db": built.db, "root": built.root}


@pytest.fixture
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile", init_script=NO_SAVE_PICKER) as pg:
        yield pg


def idle(page):
    page.wait_for_selector(IDLE, timeout=90_000)


def click_alone(page, locator, timeout_s: float = 90):
    """Click ``locator`` once it resolves to exactly one element (a rerun may briefly keep a stale twin, and
    Playwright's strict mode then refuses the click: try again)."""
    deadline = time.monotonic() + timeout_s
    while True:
        expect(locator.first).to_be_visible()
        idle(page)
        try:
            locator.click(timeout=10_000)
            return
        except playwright_sync.Error as e:
            if "strict mode violation" not in str(e) or time.monotonic() > deadline:
                raise
        page.wait_for_timeout(250)


def no_exception(page):
    assert page.locator("[data-testid='stException']").count() == 0


def the_search(db) -> dict:
    cat = api.Catalog(db)
    try:
        return api.search_show(cat, api.searches(cat)[0]["id"])
    finally:
        cat.close()


NO_SAVE_PICKER = "delete window.showSaveFilePicker"  # a grid's CSV then comes as a download, not a file dialog


def trials_csv(page) -> list[dict]:
    """The trials grid as its "Download as CSV" button gives it."""
    grid = page.locator("[data-testid='stDataFrame']")
    expect(grid).to_have_count(1)
    grid.hover()
    with page.expect_download() as got:
        grid.get_by_role("button", name="Download as CSV").click()
    return list(csv.DictReader(io.StringIO(Path(got.value.path()).read_text(encoding="utf-8-sig"))))


def test_launch_watch_and_publish_a_search(server, page):
    page.goto(server["url"] + "/search")
    expect(page.locator("h1", has_text="Search")).to_be_visible(timeout=90_000)
    idle(page)
    expect(page.get_by_text("No searches yet")).to_be_visible()
    area = page.locator(".st-key-search_yaml textarea")
    area.fill(SEARCH_YAML)
    area.press("Control+Enter")
    expect(page.get_by_text(re.compile(r"Valid: 3 trials \(random, seed 0\) of task_arithmetic on base"))) \
        .to_be_visible()
    idle(page)
    click_alone(page, page.get_by_role("button", name="Launch search"))
    # the search's own process: checked, recorded, run; the page follows it to the end
    progress = page.locator("[data-testid='stProgress']", has_text="finished: 3 trials")
    expect(progress).to_be_visible(timeout=180_000)
    idle(page)
    shown = the_search(server["db"])
    assert shown["status"] == "finished" and len(shown["trials"]) == 3
    expect(area).to_have_value(SEARCH_YAML)  # the YAML stays through the reruns that followed the search
    table = trials_csv(page)  # the grid is drawn on a canvas: read it through its own CSV download
    assert [(int(r["trial"]), r["status"], r["fidelity"]) for r in table] == [
        (t["number"], t["status"], t["fidelity"]) for t in shown["trials"]]
    assert [float(r["score"]) for r in table] == [t["score"] for t in shown["trials"]]
    chart = page.locator(".st-key-search_scores .js-plotly-plot")
    expect(chart).to_be_visible()
    traces = page.evaluate("() => document.querySelector('.st-key-search_scores .js-plotly-plot')"
                           "._fullData.map(t => [t.name, t.x.length])")
    steps = [s["budget"] for t in shown["trials"] for s in t["steps"]]
    assert traces == [["30%", steps.count("30%")], ["100%", steps.count("100%")]]  # every step, by fidelity
    with page.expect_download() as got:
        click_alone(page, page.get_by_role("button", name="Download the best recipe (mergekit YAML)"))
    recipe = Path(got.value.path()).read_text()
    assert recipe == shown["best"]["recipe"]
    no_exception(page)

    click_alone(page, page.get_by_role("button", name="Publish the best"))
    published = page.get_by_text(re.compile(r"Published trial \d+ as snapshot snap-[0-9a-f]+"))
    expect(published).to_be_visible(timeout=180_000)
    snapshot = re.search(r"snap-[0-9a-f]+", published.inner_text()).group(0)
    best = the_search(server["db"])["trials"][shown["best"]["trial"]]
    assert best["snapshot_id"] == snapshot
    assert (server["root"] / "merged" / f"e2e-{shown['id'].removeprefix('search-')[:6]}-best").is_dir()
    expect(page.get_by_role("button", name="Publish the best")).to_be_disabled()
    no_exception(page)
