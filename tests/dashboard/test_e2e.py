"""End-to-end: the dashboard in a real browser (Debian chromium driven by Playwright).

Starts the app through mergepipe.dashboard.server.run_dashboard on 127.0.0.1 with a free port and a fresh
catalog, then: registers and analyzes a generated family on the Models page (and registers a PEFT LoRA
adapter, refused without a base), moves the budget slider
on the Plan page and sees the estimated expert I/O and the access mask change, loads a mergekit YAML
that sets the operator, experts, weights and density, saves the plan, launches
the merge on the Run page and watches it complete, finds the snapshot in Snapshots, evaluates it (with its
base and experts) on a held-out text and a task suite in the background, downloads its recipe, compares it
with a second snapshot, finds it in Lineage and opens its manifest, and deletes it (the other one stays). A screenshot of each page goes to test-artifacts/ (and to assets/, shown by the docs, when
MERGEPIPE_UPDATE_SCREENSHOTS=1).
Nothing is installed at run time: chromium comes from apt, playwright from PyPI (never
`playwright install`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from urllib.parse import urlparse

import pytest

from dashboard_helpers import REPO, free_port, wait_for_health
from mergepipe.catalog.db import Catalog
from mergepipe.dashboard.server import run_dashboard
from mergepipe.research.family import make_family

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
ASSETS = REPO / "assets"
ARTIFACTS = REPO / "test-artifacts"
EXPERTS = ("expert_1", "expert_2", "expert_3")

import playwright.sync_api as playwright_sync  # noqa: E402  (installed by scripts/setup.sh: the [test] extra)

if not Path(CHROMIUM).exists():  # a missing browser fails the suite: the e2e test is never skipped
    pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install -y chromium)", pytrace=False)
expect = playwright_sync.expect
expect.set_options(timeout=20_000)  # a loaded 2-core machine: page reruns can take seconds


@pytest.fixture
def server(tmp_path):
    fam = tmp_path / "family"
    make_family(fam, experts=len(EXPERTS), size="tiny", dtype="fp32")
    db = tmp_path / "catalog.sqlite"
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    # what `mergepipe dashboard` runs, minus the wait
    proc = run_dashboard(db, port=port, extra_roots=[tmp_path], wait=False, stdout=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, timeout=90, proc=proc)
        yield {"url": url, "db": db, "family": fam, "tmp": tmp_path, "proc": proc}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@pytest.fixture
def page(tmp_path):
    with playwright_sync.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), executable_path=CHROMIUM,
                                                   headless=True, args=CHROMIUM_ARGS,
                                                   viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(30_000)
        pg = ctx.pages[0] if ctx.pages else ctx.new_page()
        try:
            yield pg
        finally:
            ctx.close()


# --- helpers ----------------------------------------------------------------------------------------------
def idle(page, timeout=60_000):
    page.wait_for_selector(IDLE, timeout=timeout)


def settled(page, locator, timeout=90_000):
    """Wait until ``locator`` shows, then until it shows once: a fragment's last tick and the app rerun it
    triggers may briefly both render the same element."""
    expect(locator.first).to_be_visible(timeout=timeout)
    idle(page)
    expect(locator).to_have_count(1, timeout=30_000)
    return locator


def click_alone(page, locator, timeout=90_000):
    """Click ``locator`` when it resolves to exactly one element. A rerun can render a stale twin again between
    the count and the click; Playwright's strict mode then refuses the click (nothing is clicked), so try again."""
    deadline = time.monotonic() + timeout / 1000
    while True:
        settled(page, locator)
        try:
            locator.click(timeout=10_000)
            return
        except playwright_sync.Error as e:
            if "strict mode violation" not in str(e) or time.monotonic() > deadline:
                raise
        page.wait_for_timeout(250)


def press(page, name: str):
    """Click the button named ``name`` once the page shows exactly one (a rerun may keep a stale twin)."""
    click_alone(page, page.get_by_role("button", name=name))


def nav(page, title: str, heading: str | None = None):
    page.locator("[data-testid='stSidebarNav'] a", has_text=title).first.click()
    expect(page.locator("h1", has_text=heading or title)).to_be_visible()
    idle(page)


def shot(page, name: str):
    idle(page)
    page.wait_for_timeout(400)  # let charts finish drawing
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("MERGEPIPE_UPDATE_SCREENSHOTS"):  # refresh the README's screenshots on request only
        shutil.copyfile(path, ASSETS / f"dashboard-{name}.png")


def no_exception(page):
    assert page.locator("[data-testid='stException']").count() == 0


def choose(page, label: str, option: str, tries: int = 4):
    """Pick an option of a selectbox by typing it into its combobox and clicking the option. An app rerun
    (a background job's fragment finishing) can close the open list before the click: open it again."""
    box = page.get_by_role("combobox", name=label)
    for attempt in range(tries):
        idle(page)
        box.click()
        box.fill(option)
        try:
            page.get_by_role("option", name=option, exact=True).click(timeout=10_000)
            break
        except playwright_sync.TimeoutError:
            if attempt == tries - 1:
                raise
            page.keyboard.press("Escape")
    idle(page)


def metric(page, label: str) -> str:
    return page.locator("[data-testid='stMetric']", has_text=label).locator("[data-testid='stMetricValue']").inner_text()


MASK_COUNT = """() => {
    // the Plan page's only heatmap (Streamlit draws chart titles itself, outside the Plotly layout)
    const el = [...document.querySelectorAll('.js-plotly-plot')]
        .find(e => e._fullData && e._fullData.length && e._fullData[0].type === 'heatmap');
    if (!el || !el._fullData || !el._fullData.length) return null;
    let n = 0;
    for (const row of el._fullData[0].z) for (const v of row) if (v === 1) n++;
    return String(n);
}"""


def mask_selected(page) -> int:
    """Blocks selected in the drawn access-mask heatmap; waits until it agrees with the caption's count."""
    caption = page.locator("[data-testid='stCaptionContainer']", has_text="mask:").inner_text()
    want = int(re.search(r"mask: (\d+) of", caption).group(1))
    page.wait_for_function(f"() => ({MASK_COUNT})() === '{want}'", timeout=15_000)
    return want


def register(page, path: Path, model_id: str, base: str | None, kind: str | None = None):
    page.get_by_role("textbox", name="Checkpoint path (directory or .safetensors file)").fill(str(path))
    page.get_by_role("textbox", name="Model id (default: the folder's name)").fill(model_id)
    if base:
        choose(page, "Base", base)
    if kind:
        choose(page, "Kind", kind)
    press(page, "Register")
    expect(page.get_by_text(f"registered: {model_id}")).to_be_visible()
    idle(page)


def write_lora_adapter(base_dir: Path, out: Path, r: int = 4) -> None:
    """A PEFT-format LoRA adapter on q_proj/v_proj of a generated family's base."""
    import torch
    from safetensors.torch import save_file
    from mergepipe.storage.safetensors import open_checkpoint
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, info in open_checkpoint(base_dir).tensors.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, info.shape[1], generator=gen)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(info.shape[0], r, generator=gen) * 0.01
    out.mkdir()
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8,
                                                         "target_modules": ["q_proj", "v_proj"]}))


def test_dashboard_end_to_end(server, page):
    t0 = time.monotonic()
    hosts = set()  # every request the page makes must stay on 127.0.0.1 (no CDN, no fonts, no icons)
    page.on("request", lambda r: hosts.add(urlparse(r.url).hostname) if urlparse(r.url).scheme in (
        "http", "https", "ws", "wss") else None)
    page.goto(server["url"] + "/")
    expect(page.locator("h1", has_text="MergePipe")).to_be_visible(timeout=60_000)
    expect(page.get_by_text("The catalog is empty")).to_be_visible()

    # --- Models: register base + experts, a refused path, then ANALYZE with live progress ---------------
    nav(page, "Models")
    page.get_by_role("textbox", name="Checkpoint path (directory or .safetensors file)").fill("/etc")
    press(page, "Register")
    expect(page.get_by_text("is outside the allowed folders")).to_be_visible()
    no_exception(page)
    fam = server["family"]
    register(page, fam / "base", "base", None)
    for e in EXPERTS:
        register(page, fam / e, e, "base")
    expect(page.get_by_text("Not analyzed yet: expert_1, expert_2, expert_3")).to_be_visible()
    kib = page.get_by_role("spinbutton", name="Block size (KiB)")
    kib.fill("4")
    kib.press("Enter")
    idle(page)
    click_alone(page, page.locator(".st-key-analyze_btn button"))
    settled(page, page.get_by_text(re.compile(r"run \d+ succeeded: analyze expert_1,expert_2,expert_3: 100%")))
    expect(page.get_by_text("Not analyzed yet")).to_have_count(0)
    cat = Catalog(server["db"])
    assert all(cat.is_analyzed(e) for e in EXPERTS) and cat.grid_block_bytes("base") == 4096
    shot(page, "models")
    # a PEFT LoRA adapter: refused without a base, registered with one
    write_lora_adapter(fam / "base", server["tmp"] / "adapter")
    register_form = page.get_by_role("textbox", name="Checkpoint path (directory or .safetensors file)")
    register_form.fill(str(server["tmp"] / "adapter"))
    page.get_by_role("textbox", name="Model id (default: the folder's name)").fill("chat-lora")
    choose(page, "Base", "(none: this is a base model)")
    choose(page, "Kind", "lora")
    press(page, "Register")
    expect(page.get_by_text("needs a base")).to_be_visible()
    register(page, server["tmp"] / "adapter", "chat-lora", "base", "lora")
    assert cat.model("chat-lora")["kind"] == "lora"
    expect(page.get_by_text("Not analyzed yet: chat-lora")).to_be_visible()
    no_exception(page)

    # --- Catalog: the heatmap, and a click on a layer cell drills down to its blocks ---------------------
    nav(page, "Catalog")
    expect(page.locator(".js-plotly-plot")).to_have_count(1)
    shot(page, "catalog")
    x, y = page.evaluate("""() => {
        const el = document.querySelector('.js-plotly-plot');
        const L = el._fullLayout, r = el.getBoundingClientRect();
        return [r.left + L.xaxis._offset + L.xaxis.l2p(1), r.top + L.yaxis._offset + L.yaxis.l2p(2)];
    }""")  # the cell (layer 1, expert_2)
    page.mouse.click(x, y)
    expect(page.get_by_role("combobox", name="Layer")).to_have_value("layer 1")
    idle(page)
    expect(page.get_by_text("||delta||_2 per block of layer 1")).to_be_visible()
    no_exception(page)

    # --- Plan: move the budget slider; the estimated expert I/O and the mask follow ----------------------
    nav(page, "Plan")
    caption = page.locator("[data-testid='stCaptionContainer']", has_text="mask:")
    expect(caption).to_be_visible()
    before_read, before_mask = metric(page, "Estimated expert read"), mask_selected(page)
    slider = page.locator("[data-testid='stSlider'] input[type='range']")
    expect(slider).to_have_value("25")
    slider.focus()
    for _ in range(10):
        slider.press("ArrowRight")
    expect(slider).to_have_value("35")
    idle(page)
    expect(caption).to_contain_text("(35%)")
    after_read, after_mask = metric(page, "Estimated expert read"), mask_selected(page)
    assert after_read != before_read and after_mask > before_mask, (before_read, after_read, before_mask, after_mask)
    slider.focus()
    slider.press("ArrowLeft")
    expect(slider).to_have_value("34")
    idle(page)
    expect(caption).to_contain_text("(34%)")
    assert mask_selected(page) <= after_mask
    assert "budget=34" in page.url  # the settings are in the URL
    no_exception(page)
    shot(page, "plan")
    # load a mergekit YAML: the settings follow it
    page.get_by_text("Load a mergekit YAML").click()
    yml = server["tmp"] / "merge.yml"
    yml.write_text("merge_method: ties\nbase_model: base\nmodels:\n  - model: expert_1\n"
                   "    parameters: {weight: 0.5}\n  - model: expert_2\n    parameters: {weight: 1.5}\n"
                   "parameters: {density: 0.4}\n")
    page.locator("[data-testid='stFileUploaderDropzoneInput']").set_input_files(str(yml))
    idle(page)
    press(page, "Load settings")
    expect(page.get_by_text("Loaded merge.yml: ties of expert_1, expert_2 on base.")).to_be_visible()
    idle(page)
    expect(page.get_by_role("combobox", name="Operator")).to_have_value("ties")
    expect(page.get_by_role("spinbutton", name="Density")).to_have_value("0.40")
    mask_selected(page)
    no_exception(page)
    # the settings as mergekit YAML: edit the budget in place, validated, then applied to the slider
    page.get_by_text("Settings as mergekit YAML").click()
    area = page.locator("[data-testid='stTextArea'] textarea")
    expect(area).to_contain_text("merge_method: ties")
    text = area.input_value()
    assert "budget: 34%" in text, text
    area.fill(text.replace("budget: 34%", "budget: 30%"))
    area.press("Control+Enter")
    idle(page)
    expect(page.get_by_text("Valid: ties of expert_1, expert_2 on base, budget 30%.")).to_be_visible()
    press(page, "Apply to the settings")
    expect(page.get_by_text("Applied the YAML: ties of expert_1, expert_2 on base, budget 30%.")).to_be_visible()
    expect(slider).to_have_value("30")
    idle(page)
    expect(caption).to_contain_text("(30%)")
    no_exception(page)
    press(page, "Save plan")
    expect(page.get_by_text(re.compile(r"Saved plan-[0-9a-f]{16}\."))).to_be_visible()
    plan_id = re.search(r"plan-[0-9a-f]{16}", page.get_by_text(re.compile(r"Saved plan-")).inner_text()).group(0)
    assert cat.query("SELECT budget_bytes FROM plans WHERE id = ?", [plan_id])
    saved = json.loads(cat.query("SELECT json FROM plans WHERE id = ?", [plan_id])[0]["json"])
    assert saved["operator"] == "ties" and [(e["id"], e["weight"], e["density"]) for e in saved["experts"]] == [
        ("expert_1", 0.5, 0.4), ("expert_2", 1.5, 0.4)]

    # --- Run: launch the saved plan as a separate process and watch it complete --------------------------
    nav(page, "Run")
    expect(page.get_by_role("combobox", name="Saved plan")).to_have_value(re.compile(plan_id))
    page.get_by_role("textbox", name="Model id of the merged model").fill("merged-e2e")
    page.get_by_role("textbox", name="Model id of the merged model").press("Enter")
    idle(page)
    press(page, "Launch merge")
    settled(page, page.get_by_text(re.compile(r"Published snap-[0-9a-f]+ as model merged-e2e")))
    expect(page.get_by_role("combobox", name="Run")).to_have_value(re.compile(r"run \d+ · merged-e2e"))
    expect(settled(page, page.locator("[data-testid='stMetric']", has_text="Status"))).to_contain_text("succeeded")
    snap = re.search(r"snap-[0-9a-f]+", page.get_by_text(re.compile("Published snap-")).first.inner_text()).group(0)
    row = cat.query("SELECT status, snapshot_id FROM runs WHERE kind = 'merge'")[0]
    assert row == {"status": "succeeded", "snapshot_id": snap}
    shot(page, "run")

    # --- Snapshots: the snapshot, its manifest, verify -------------------------------------------------------
    nav(page, "Snapshots")
    expect(page.get_by_role("combobox", name="Snapshot")).to_have_value(re.compile(snap))
    press(page, "Verify")
    expect(page.get_by_text(f"OK: {snap}")).to_be_visible()
    page.get_by_text("Model card (README.md)").click()
    expect(page.get_by_role("heading", name="Recipe")).to_be_visible()
    expect(page.get_by_text("library_name: transformers")).to_be_visible()
    no_exception(page)
    # Evaluate: the snapshot, its base and experts on a held-out text and a task suite, in the background
    held = server["tmp"] / "heldout.txt"
    held.write_text("t5 t6 t7 t8 t9 t10 t11 t12 " * 20)
    suite = server["tmp"] / "suite.jsonl"
    suite.write_text("".join(json.dumps({"task": "pick", "prompt": f"t{5 + i} t{6 + i}", "choices": ["t50", "t60"],
                                         "answer": i % 2}) + "\n" for i in range(4)))
    page.get_by_text("Evaluate: perplexity on a held-out text").click()
    for label, path in (("Held-out text file (UTF-8): perplexity", held), ("Task suite (JSONL): accuracy", suite)):
        box = page.get_by_role("textbox", name=label)
        box.fill(str(path))
        box.press("Enter")
        idle(page)
    press(page, "Evaluate 4 models")
    expect(page.get_by_text(re.compile(r"evaluate run \d+ succeeded")).first).to_be_visible(timeout=120_000)
    idle(page)
    quality = page.locator("[data-testid='stAlertContentSuccess']", has_text="accuracy").first
    expect(quality).to_contain_text("perplexity")
    expect(quality).to_contain_text("on suite.jsonl")
    stored = {(r["model_id"], r["metric"]) for r in cat.query("SELECT model_id, metric FROM evaluations")}
    assert stored == {(m, k) for m in ("merged-e2e", "base", "expert_1", "expert_2")
                      for k in ("perplexity", "accuracy", "accuracy:pick")}
    # export the recipe: the mergekit YAML of what this snapshot did
    with page.expect_download() as got:
        press(page, "Download the recipe (mergekit YAML)")
    recipe = Path(got.value.path()).read_text()
    assert "merge_method: ties" in recipe and f"snapshot {snap}" in recipe and "budget: 30%" in recipe, recipe
    no_exception(page)
    shot(page, "snapshots")

    # --- Compare: a second snapshot (linear 60 %, merged through the API) against the first -------------------
    from mergepipe.api import merge
    _, snap2, _ = merge(cat, "base", list(EXPERTS), server["tmp"] / "merged-2", operator="linear",
                        model_id="merged-lin", budget="60%")
    nav(page, "Compare")
    choose(page, "A: snapshot or plan", snap)
    choose(page, "B: snapshot or plan", snap2)
    expect(page.get_by_role("heading", name="Quality")).to_be_visible()
    expect(page.locator("[data-testid='stDataFrame']").first).to_be_visible()
    expect(page.get_by_text(re.compile(r"\d+ of \d+ tensors read differently"))).to_be_visible()
    expect(page.get_by_text("Shared inputs: base, expert_1, expert_2.")).to_be_visible()
    no_exception(page)
    shot(page, "compare")

    # --- Lineage: the merged node, then open its manifest -------------------------------------------------
    nav(page, "Lineage")
    expect(page.locator("[data-testid='stGraphVizChart'] svg")).to_contain_text("merged-e2e")
    choose(page, "Node", "merged-e2e")
    shot(page, "lineage")
    press(page, f"Open the manifest of {snap}")
    expect(page.locator("h1", has_text="Snapshots")).to_be_visible()
    idle(page)
    expect(page.get_by_role("combobox", name="Snapshot")).to_have_value(re.compile(snap))
    page.get_by_text("Raw manifest (JSON)").click()
    manifest = json.loads(cat.query("SELECT json FROM manifests WHERE snapshot_id = ?", [snap])[0]["json"])
    expect(page.locator("[data-testid='stJson']")).to_contain_text(manifest["manifest_hash"])
    no_exception(page)

    # --- Home: totals and the last runs ---------------------------------------------------------------------
    nav(page, "Home", "MergePipe")
    assert metric(page, "Snapshots") == "2" and metric(page, "Experts analyzed") == "3"
    shot(page, "home")

    # --- Snapshots: delete it (confirmation first): files and catalog rows go ---------------------------------
    out = Path(cat.query("SELECT out FROM snapshots WHERE id = ?", [snap])[0]["out"])
    assert (out / "README.md").is_file()
    nav(page, "Snapshots")
    choose(page, "Snapshot", snap)
    page.get_by_text("Delete this snapshot").click()
    delete = page.get_by_role("button", name="Delete", exact=True)
    expect(delete).to_be_disabled()
    page.get_by_text(f"Yes, delete {snap} for good").click()
    idle(page)
    expect(delete).to_be_enabled()
    delete.click()
    expect(page.get_by_text(f"Deleted {snap} (merged-e2e)")).to_be_visible()
    expect(page.get_by_role("combobox", name="Snapshot")).to_have_value(re.compile(snap2))  # the other one stays
    assert not out.exists() and cat.query("SELECT id FROM snapshots") == [{"id": snap2}]
    no_exception(page)
    cat.close()
    assert hosts == {"127.0.0.1"}, hosts
    assert time.monotonic() - t0 < 400
