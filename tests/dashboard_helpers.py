"""Helpers for the dashboard tests: a tiny analyzed family with one merge, catalog copies, ports."""

from __future__ import annotations

import signal
import socket
import sqlite3
import subprocess
import time
from contextlib import contextmanager
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mergepipe.analyze.runner import analyze
from mergepipe.api import merge
from mergepipe.catalog.db import Catalog
from mergepipe.research.family import make_family
from mergepipe.catalog.models import register

BLOCK_BYTES = 4096
EXPERTS = ("expert_1", "expert_2", "expert_3")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Built:
    root: Path
    db: Path
    family: Path
    experts: tuple[str, ...]
    snapshot_id: str
    plan_id: str
    merged: Path


def build_catalog(root: Path, merged: bool = True) -> Built:
    """make_family(tiny, fp32, 3 experts), register, analyze on a 4 KiB grid, one linear 30 % merge."""
    root = Path(root)
    fam = root / "family"
    make_family(fam, experts=len(EXPERTS), size="tiny", dtype="fp32")
    db = root / "catalog.sqlite"
    cat = Catalog(db)
    try:
        register(cat, "base", str(fam / "base"))
        for e in EXPERTS:
            register(cat, e, str(fam / e), base_id="base")
        analyze(cat, list(EXPERTS), block_bytes=BLOCK_BYTES)
        sid = plan_id = ""
        out = root / "merged" / "m1"
        if merged:
            out.parent.mkdir(parents=True, exist_ok=True)
            plan, sid, _ = merge(cat, "base", list(EXPERTS), out, operator="linear", model_id="merged-1", budget="30%")
            plan_id = plan.id
    finally:
        cat.close()
    return Built(root, db, fam, EXPERTS, sid, plan_id, out)


def copy_catalog(src: Path, dst: Path) -> Path:
    """A consistent copy of a catalog (sqlite backup API: includes what is still in the WAL)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    s = sqlite3.connect(str(src))
    d = sqlite3.connect(str(dst))
    try:
        s.backup(d)
    finally:
        d.close()
        s.close()
    return dst


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, timeout: float = 60.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError as exc:
            last = exc
        time.sleep(0.25)
    raise TimeoutError(f"{url} not healthy after {timeout} s ({last})")


def wait_until(pred, timeout: float = 60.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


# --- AppTest ------------------------------------------------------------------------------------
PAGE_TIMEOUT = 60


def page_env(built: Built, tmp_path: Path, monkeypatch) -> dict:
    """A private copy of the built catalog, shown by the app; checkpoints and tmp_path are allowed roots."""
    db = copy_catalog(built.db, tmp_path / "catalog.sqlite")
    monkeypatch.setenv("MERGEPIPE_DB", str(db))
    monkeypatch.setenv("MERGEPIPE_ALLOWED_ROOTS", f"{built.root}:{tmp_path}")
    return {"db": db, "tmp": tmp_path, "built": built}


def open_page(name: str, query: dict | None = None):
    """The app at page ``name`` (``home`` or pages/<name>.py) after one run, with no exception."""
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=PAGE_TIMEOUT)
    for k, v in (query or {}).items():
        at.query_params[k] = v
    at.run()
    if name != "home":
        at.switch_page(f"pages/{name}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# --- browser tests: the dashboard's server and a chromium page ------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def dashboard_server(db: Path, tmp_path: Path):
    """`mergepipe dashboard`'s server on a free port, healthy; yields its URL; stopped (SIGTERM, then kill) after."""
    from mergepipe.dashboard.server import run_dashboard
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = run_dashboard(db, port=port, extra_roots=[tmp_path], wait=False, stdout=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, timeout=90, proc=proc)  # /_stcore/health runs no script
        yield url
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def chromium_page(profile: Path, timeout_ms: int = 60_000, init_script: str | None = None):
    """A page of Debian's chromium driven by Playwright, in a fresh profile folder (1400 x 1000)."""
    import playwright.sync_api as playwright_sync
    with playwright_sync.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                   args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(timeout_ms)
        if init_script:
            ctx.add_init_script(init_script)
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()
