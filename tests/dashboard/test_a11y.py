"""Accessibility: every dashboard page passes axe-core (run in Debian's chromium) with no serious or
critical violation, on a catalog with two snapshots. axe-core comes from npm (`npm install`, see
package.json and scripts/setup.sh); nothing is installed at run time. Writes each page's cached load
time to test-artifacts/dashboard-a11y.json."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dashboard_helpers import REPO, build_catalog, free_port, wait_for_health
from mergepipe import api
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.dashboard.server import run_dashboard

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
AXE = REPO / "node_modules" / "axe-core" / "axe.min.js"
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
PAGES = ["/", "/models", "/catalog", "/catalog?rows=block", "/plan", "/plan?op=ties", "/run", "/snapshots",
         "/compare", "/lineage", "/sweeps"]

import playwright.sync_api as playwright_sync  # noqa: E402



def _require_tools() -> None:
    """Fail this test (not the whole collection) when the browser or axe-core is missing."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install -y chromium)", pytrace=False)
    if not AXE.exists():
        pytest.fail(f"{AXE} is missing: run `npm install` in the repository (axe-core, see package.json)",
                    pytrace=False)

RUN_AXE = """async () => (await axe.run(document, {resultTypes: ['violations']})).violations
    .filter(v => v.impact === 'serious' || v.impact === 'critical')
    .map(v => ({id: v.id, impact: v.impact, help: v.help,
                nodes: v.nodes.slice(0, 3).map(n => n.failureSummary + ' @ ' + n.html.slice(0, 120))}))"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _require_tools()
    root = tmp_path_factory.mktemp("a11y")
    built = build_catalog(root)
    cat = Catalog(built.db)
    merge(cat, "base", list(built.experts), root / "merged" / "m2", operator="ties", model_id="merged-2",
          density=0.5, budget="60%")
    sweep = root / "sweep.yml"  # the Sweeps page with a sweep's table and frontier chart
    sweep.write_text(f"name: a11y\nbase: base\nexperts: {list(built.experts)}\nout: {root / 'sweep-outs'}\n"
                     "grid: {operator: [linear], budget: ['30%', '100%']}\n")
    api.run_sweep(cat, api.load_sweep(sweep))
    cat.close()
    port = free_port()
    log = open(root / "server.log", "wb")
    proc = run_dashboard(built.db, port=port, extra_roots=[root], wait=False, stdout=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, timeout=90, proc=proc)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _visit(page, url: str) -> float:
    t0 = time.monotonic()
    page.goto(url)
    page.wait_for_selector(IDLE, timeout=60_000)
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].every(e => e._fullLayout)",
                           timeout=30_000)
    return time.monotonic() - t0


def test_every_page_passes_axe(server, tmp_path):
    axe = AXE.read_text()
    found, timings = {}, {}
    with playwright_sync.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
                                                   args=["--headless", "--no-sandbox", "--disable-gpu"],
                                                   viewport={"width": 1400, "height": 1000})
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        try:
            for path in PAGES:
                _visit(page, server + path)  # first visit fills the caches
                timings[path] = round(_visit(page, server + path), 2)
                page.wait_for_timeout(300)
                page.add_script_tag(content=axe)
                bad = page.evaluate(RUN_AXE)
                if bad:
                    found[path] = bad
        finally:
            ctx.close()
    out = REPO / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / "dashboard-a11y.json").write_text(json.dumps({"cached_load_s": timings, "violations": found}, indent=1))
    assert not found, json.dumps(found, indent=1)
