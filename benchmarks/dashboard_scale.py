"""Dashboard responsiveness on a large catalog: 16 experts at qwen3-0.6b scale on a 1 MiB grid.

Generating and analyzing 17 real qwen3-0.6b-sized checkpoints would take many minutes and ~20 GB,
so the catalog is synthetic where that does not matter to the dashboard:

* each checkpoint is a *sparse* safetensors file: a real header with the qwen3-0.6b tensor shapes
  (mergepipe.research.family.tensor_shapes) in bf16, the data region a hole (no disk space, never read);
  models are registered normally (headers only), so fingerprints and checks are real;
* the block statistics are inserted directly: the real 1 MiB grid (mergepipe.storage.grid.tensor_grid),
  random norms that depend on expert and layer, ~10 % frozen tensors, and random 2048-sample
  sketches with a shared component (so conflicts and cosines vary), plus per-tensor statistics and
  TIES thresholds; the ``analyses`` rows make every expert count as analyzed;
* one budgeted plan is saved and a snapshot with a manifest (touched blocks = the plan's access set)
  is recorded, so that the Snapshots and Lineage pages have something to show.

Then it times (1) every mergepipe.dashboard.views function the pages use (first call; the pages cache the
expensive ones with st.cache_data / st.cache_resource, so a cached call costs a dictionary lookup),
(2) each page rendered by Streamlit's AppTest, cold and then warm (server-side script time including
Plotly/Arrow serialization), and (3) with ``--browser`` the same pages in headless chromium through a
real server (navigation until the script is idle and the charts are drawn), plus a budget-slider
step on the Plan page; with ``--baseline TREE`` another checkout's app is served beside this one and
both are timed page by page, side by side. Results go to docs/dashboard-scale.md.

    .venv/bin/python benchmarks/dashboard_scale.py [--experts 16] [--browser [--baseline TREE]] [--out docs/dashboard-scale.md]
    .venv/bin/python benchmarks/dashboard_scale.py --experts 64 --out /tmp/k64.md   # the 64-expert section
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mergepipe.dashboard import plan as _plan, plan_frontier as _frontier, snapshots as _snapshots  # noqa: E402
from mergepipe.dashboard import views as _views  # noqa: E402
from mergepipe.dashboard.figures import layer_of  # noqa: E402
from mergepipe.catalog.db import Catalog, now  # noqa: E402
from mergepipe.research.family import hf_config, tensor_shapes  # noqa: E402
from mergepipe.storage.grid import tensor_grid  # noqa: E402
from mergepipe.manifest.build import Manifest  # noqa: E402
from mergepipe.planner.plan import save_plan  # noqa: E402
from mergepipe.catalog.models import register  # noqa: E402
from mergepipe.storage.safetensors import TensorInfo  # noqa: E402



class _Views:
    """mergepipe.dashboard.views and the page modules whose functions it no longer re-exports (the plan's mask,
    frontier and snapshot figures), under one name as the pages reach them."""

    def __getattr__(self, name):
        for module in (_views, _plan, _frontier, _snapshots):
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(name)


views = _Views()
SIZE = "qwen3-0.6b"
SKETCH = 2048
DENSITIES = (0.3, 0.5)


# --- building the synthetic catalog ----------------------------------------------------------------------
def write_sparse_checkpoint(out: Path, shapes: dict, config: dict) -> int:
    """A safetensors file with a real header and a hole where the data would be."""
    out.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = out / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    (out / "config.json").write_text(json.dumps(config))
    return offset


def build(root: Path, experts: int, block_bytes: int, seed: int = 0) -> dict:
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(SIZE)
    config = hf_config(SIZE, "bf16")
    db = root / "catalog.sqlite"
    if db.exists():
        db.unlink()
    ids = [f"expert_{i}" for i in range(1, experts + 1)]
    for name in ["base", *ids]:
        write_sparse_checkpoint(root / "models" / name, shapes, config)
    cat = Catalog(db)
    register(cat, "base", str(root / "models" / "base"))
    for e in ids:
        register(cat, e, str(root / "models" / e), base_id="base")
    tensors = cat.tensors("base")
    n_layers = 28
    blocks_per_expert = 0
    shared = {}
    for ei, e in enumerate(ids):
        block_rows, stat_rows = [], []
        focus = (ei * 0.37 % 1.0) * (n_layers - 1)
        for t in tensors:
            info = TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), t["file"], t["offset"], t["nbytes"])
            spans = tensor_grid(info, block_bytes)
            layer = layer_of(t["name"])
            frozen = rng.random() < (0.7 if layer_of(t["name"]) is None else 0.1)
            scale = 0.02 * math.exp(-6 * abs((layer if layer is not None else n_layers) - focus) / n_layers)
            numel_per_byte = 1 / 2
            tot_sq = tot_l1 = tot_max = 0.0
            tot_nnz = 0
            if t["name"] not in shared:
                shared[t["name"]] = rng.standard_normal((len(spans), SKETCH)).astype(np.float32)
            rho = rng.uniform(-0.3, 0.9)
            own = rng.standard_normal((len(spans), SKETCH)).astype(np.float32)
            sk = rho * shared[t["name"]] + math.sqrt(1 - rho * rho) * own
            for s, row_sk in zip(spans, sk):
                numel = int(s.nbytes * numel_per_byte)
                if frozen:
                    l2 = l1 = mx = 0.0
                    nnz = 0
                    blob = np.zeros(min(SKETCH, numel), np.float16).tobytes()
                else:
                    per = scale * math.exp(rng.normal(0, 0.8))
                    l2 = per * math.sqrt(numel)
                    l1 = per * numel * 0.8
                    mx = per * 4.5
                    nnz = numel
                    v = row_sk[:min(SKETCH, numel)] * per
                    blob = (v / mx).astype(np.float16).tobytes()
                tot_sq += l2 * l2
                tot_l1 += l1
                tot_max = max(tot_max, mx)
                tot_nnz += nnz
                block_rows.append({"model_id": e, "tensor": t["name"], "block": s.index, "row_start": s.row_start,
                                   "row_end": s.row_end, "offset": t["offset"] + s.rel_offset, "nbytes": s.nbytes,
                                   "delta_l2": l2, "delta_l1": l1, "delta_max_abs": mx, "delta_nnz": nnz,
                                   "sketch": blob})
            numel = math.prod(t["shape"])
            thresholds = {str(d): (tot_max / 4.5) * 0.6745 * (1 - d) * 2 for d in DENSITIES} if tot_nnz else {}
            stat_rows.append({"model_id": e, "tensor": t["name"], "numel": numel, "delta_l2": math.sqrt(tot_sq),
                              "delta_l1": tot_l1, "delta_max_abs": tot_max, "delta_nnz": tot_nnz,
                              "thresholds": json.dumps(thresholds)})
        blocks_per_expert = len(block_rows)
        m = cat.model(e)
        base = cat.model("base")
        with cat.transaction():
            cat.db["blocks"].insert_all(block_rows, batch_size=2000)
            cat.db["tensor_stats"].insert_all(stat_rows, batch_size=2000)
            cat.db["analyses"].upsert({"model_id": e, "base_id": "base", "fingerprint": m["fingerprint"],
                                       "base_fingerprint": base["fingerprint"], "block_bytes": block_bytes,
                                       "sketch_size": SKETCH, "densities": json.dumps(list(DENSITIES)),
                                       "n_blocks": len(block_rows), "bytes_read": 0, "seconds": 0.0,
                                       "analyzed_at": now()}, pk="model_id")
            if ei == 0:
                cat.db["grids"].upsert({"base_id": "base", "block_bytes": block_bytes, "n_blocks": len(block_rows),
                                        "created_at": now()}, pk="base_id")
    built = time.perf_counter() - t0
    # one saved plan and a recorded snapshot of it (touched = the plan's access set)
    ctx = views.plan_context(cat, "base", ids, "linear")
    plan = views.make_plan(ctx, budget_pct=25)
    save_plan(cat, plan)
    snapshot_id = "snap-" + "5ca1e0000000"
    core = {"format": "mergepipe.manifest/1", "plan_id": plan.id, "plan_digest": plan.digest,
            "operator": plan["operator"], "params": plan["params"], "seed": 0, "strategy": "norm",
            "grid": plan["grid"], "inputs": {"base": plan["base"], "experts": plan["experts"]},
            "budget": plan["budget"], "full_expert_bytes": plan["full_expert_bytes"], "estimated": plan["estimate"],
            "estimated_by_expert": plan["expert_read_by_expert"], "realized": plan["estimate"],
            "realized_by_expert": plan["expert_read_by_expert"], "realized_by_tensor": plan["expert_read_by_tensor"],
            "touched": plan["access"], "error_bound": plan["error_bound"], "outputs": {},
            "software": {"mergepipe": "bench"},
            "parents": [{"id": "base", "role": "base", "weight": None}]
            + [{"id": e["id"], "role": "expert", "weight": e["weight"]} for e in plan["experts"]]}
    manifest = Manifest(core, {"snapshot_id": snapshot_id, "model_id": "merged-scale", "out": str(root / "merged"),
                               "created_at": now(), "seconds": 0.0, "timing": {}})
    base_row = cat.model("base")
    with cat.transaction():
        row = {k: v for k, v in base_row.items()}
        row.update({"id": "merged-scale", "uri": str(root / "models" / "base"), "base_id": "base",
                    "snapshot_id": snapshot_id, "registered_at": now()})
        cat.db["models"].insert(row)
        cat.db["snapshots"].insert({"id": snapshot_id, "model_id": "merged-scale", "plan_id": plan.id,
                                    "out": str(root / "merged"), "manifest_hash": manifest.manifest_hash,
                                    "created_at": now()})
        cat.db["manifests"].insert({"snapshot_id": snapshot_id, "manifest_hash": manifest.manifest_hash,
                                    "json": manifest.to_json()})
        cat.db["lineage"].insert_all([{"child_id": "merged-scale", "parent_id": p["id"], "role": p["role"],
                                       "weight": p["weight"]} for p in core["parents"]])
    cat.close()
    return {"db": db, "experts": ids, "blocks_per_expert": blocks_per_expert, "tensors": len(tensors),
            "build_s": built, "snapshot_id": snapshot_id, "plan_id": plan.id,
            "db_mb": db.stat().st_size / 1e6}


# --- timing ------------------------------------------------------------------------------------------------
def timed(fn, *a, **kw):
    t = time.perf_counter()
    res = fn(*a, **kw)
    return res, time.perf_counter() - t


def time_views(db: Path, experts: list[str], snapshot_id: str) -> list[tuple[str, float, str]]:
    out = []

    def rec(label, fn, *a, note="", **kw):
        res, s = timed(fn, *a, **kw)
        out.append((label, s, note))
        return res

    cat = Catalog(db)
    rec("models_df", views.models_df, cat)
    rec("stats_version", views.stats_version, cat)
    rec("totals", views.totals, cat)
    rec("runs_df", views.runs_df, cat)
    layout = rec("block_layout", views.block_layout, cat, "base")
    ts = rec("tensor_stats_df (all experts)", views.tensor_stats_df, cat, experts, note=f"{len(experts)} experts")
    bs = rec("block_stats_df (all experts)", views.block_stats_df, cat, experts)
    m = rec("norm_matrix layer", views.norm_matrix, ts, "layer", experts)
    rec("norm_matrix tensor", views.norm_matrix, ts, "tensor", experts)
    mb = rec("norm_matrix block", views.norm_matrix, bs, "block", experts, note="cells: %d" % (len(bs)))
    rec("norm_heatmap layer + to_json", lambda: views.norm_heatmap(m, "layer").to_json())
    rec("norm_heatmap block + to_json", lambda: views.norm_heatmap(mb, "block").to_json(),
        note=f"{mb.shape[0]}x{mb.shape[1]} cells")
    group = "layer 10"
    tens = views.tensors_in_group(layout, group)
    lb = rec("block_stats_df (one layer)", views.block_stats_df, cat, experts, tens)
    rec("norm_matrix block (one layer)", views.norm_matrix, lb, "block", experts)
    rec("conflict_matrix (one layer)", views.conflict_matrix, cat, experts, tens, "conflict",
        note=f"{len(tens)} tensors")
    rec("conflict_matrix (embed, cosine)", views.conflict_matrix, cat, experts, ["model.embed_tokens.weight"], "cosine")
    ctx = rec("plan_context linear (cached per settings)", views.plan_context, cat, "base", experts, "linear")
    rec("plan_context ties density 0.5", views.plan_context, cat, "base", experts, "ties", density=0.5)
    plan = rec("make_plan 25%", views.make_plan, ctx, budget_pct=25)
    rec("plan_summary", views.plan_summary, plan)
    mask = rec("mask_matrix", views.mask_matrix, ctx, plan, note="%dx%d" % (len(experts), ctx.layout["blocks"].sum()))
    rec("mask_heatmap + to_json", lambda: views.mask_heatmap(mask).to_json())
    fr = rec("frontier_df", views.frontier_df, ctx)
    x, y = rec("current_point", views.current_point, ctx, plan, True)
    rec("frontier_figure + to_json", lambda: views.frontier_figure(fr, x, y, True, "linear").to_json())
    rec("plan_yaml (settings as mergekit YAML)", views.plan_yaml, cat, plan)

    def slider_step():
        p = views.make_plan(ctx, budget_pct=26)
        views.mask_heatmap(views.mask_matrix(ctx, p)).to_json()
        views.current_point(ctx, p, True)
        views.plan_summary(p)
    rec("slider step (plan + mask + point + summary)", slider_step)
    rec("plans_df", views.plans_df, cat)
    rec("snapshots_df", views.snapshots_df, cat)
    man = rec("load_manifest", views.load_manifest, cat, snapshot_id)
    rec("manifest_summary", views.manifest_summary, man)
    rec("bytes_by_expert_df", views.bytes_by_expert_df, man)
    rec("bytes_by_tensor_df", views.bytes_by_tensor_df, man, views.manifest_plan(cat, man))
    bt = views.bytes_by_tensor_df(man, views.manifest_plan(cat, man))
    rec("top_tensors + bytes_bars + to_json", lambda: views.bytes_bars(views.top_tensors(bt, 20, "|difference|")[0],
                                                                       "tensor").to_json())
    rec("model_card", views.model_card, man)
    rec("expert_warnings", views.expert_warnings, cat)
    tm = rec("touched_matrix", views.touched_matrix, cat, man)
    rec("touched_heatmap + to_json", lambda: views.touched_heatmap(tm).to_json())
    rec("lineage_dot", views.lineage_dot, cat)
    rec("lineage_nodes_df", views.lineage_nodes_df, cat)
    cat.close()
    return out


APPTEST_PAGES = [
    ("home", {}), ("models", {}), ("catalog", {}), ("catalog", {"rows": "block"}),
    ("catalog", {"view": "Tensors"}), ("catalog", {"view": "Blocks", "layer": "layer 10"}),
    ("catalog", {"view": "Conflicts", "clayer": "layer 10"}), ("plan", {}), ("plan", {"budget": "60"}),
    ("catalog", {"scale": "log", "norm": "per expert"}), ("plan", {"op": "ties"}),
    ("run", {}), ("snapshots", {}), ("compare", {}), ("lineage", {}),
]


def page_label(name, q):
    return name + ("?" + "&".join(f"{k}={v}" for k, v in q.items()) if q else "")


def time_apptest(db: Path, pages=None) -> list[tuple[str, float, float]]:
    from streamlit.testing.v1 import AppTest
    os.environ["MERGEPIPE_DB"] = str(db)
    out = []
    for name, q in pages or APPTEST_PAGES:
        times = []
        for _ in range(2):
            at = AppTest.from_file(str(REPO / "app.py"), default_timeout=600)
            for k, v in q.items():
                at.query_params[k] = v
            if name != "home":
                at.switch_page(f"pages/{name}.py")
            t = time.perf_counter()
            at.run()
            times.append(time.perf_counter() - t)
            if at.exception or at.error:
                raise RuntimeError(f"{name}: {[e.value for e in at.exception]} {[e.value for e in at.error]}")
        out.append((page_label(name, q), times[0], times[1]))
    return out


def start_server(db: Path, app_repo: Path, log_path: Path):
    """`streamlit run app_repo/app.py` on a free port, importing mergepipe from ``app_repo``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MERGEPIPE_DB=str(db), PYTHONPATH=str(app_repo))
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(app_repo / "app.py"), "--server.port",
                             str(port), "--server.address", "127.0.0.1", "--server.headless", "true"], env=env,
                            cwd=str(app_repo), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/_stcore/health", timeout=2)
            return proc, log, url
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)


def stop_server(proc, log) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def time_browser(db: Path, trees: dict[str, Path], pages=None, repeat: int = 2) -> dict[str, list[tuple[str, float, float]]]:
    """Each page in headless chromium, on one server per tree (``{label: repository}``) at once, the trees
    taking turns page by page (so that a change in the machine's load hits them alike): the first visit,
    then the best of ``repeat`` more (cached); ``pages``: the APPTEST_PAGES to visit (default all)."""
    from urllib.parse import quote

    from playwright.sync_api import sync_playwright
    idle = "[data-testid='stApp'][data-test-script-state='notRunning']"
    servers = {label: start_server(db, repo, db.parent / f"server-{label}.log") for label, repo in trees.items()}
    out: dict[str, list] = {label: [] for label in trees}
    try:
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
        with sync_playwright() as p, tempfile.TemporaryDirectory() as prof:
            ctx = p.chromium.launch_persistent_context(prof, executable_path="/usr/bin/chromium", headless=True,
                                                       args=args, viewport={"width": 1400, "height": 1000})
            page = ctx.pages[0]

            def visit(url, path):
                t = time.perf_counter()
                page.goto(url + path)
                page.wait_for_selector("h1", timeout=300_000)
                page.wait_for_selector(idle, timeout=300_000)
                # every chart drawn
                page.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')]"
                                       ".every(c => c.querySelector('.js-plotly-plot') && "
                                       "c.querySelector('.js-plotly-plot')._fullData)", timeout=300_000)
                return time.perf_counter() - t

            for name, q in pages or APPTEST_PAGES:
                path = "/" + ("" if name == "home" else name)
                if q:
                    path += "?" + "&".join(f"{k}={quote(v)}" for k, v in q.items())
                first = {label: visit(servers[label][2], path) for label in trees}
                warm: dict[str, list] = {label: [] for label in trees}
                for _ in range(repeat):
                    for label in trees:
                        warm[label].append(visit(servers[label][2], path))
                for label in trees:
                    out[label].append((page_label(name, q), first[label], min(warm[label])))
            for label in trees:  # one budget-slider step on the Plan page
                visit(servers[label][2], "/plan")
                slider = page.locator("[data-testid='stSlider'] input[type='range']").first  # the budget
                steps = []
                for _ in range(3):
                    v = int(slider.input_value())
                    slider.focus()
                    t = time.perf_counter()
                    slider.press("ArrowRight")
                    page.wait_for_function(f"() => [...document.querySelectorAll(\"[data-testid='stCaptionContainer']\")]"
                                           f".some(c => c.innerText.includes('mask:') && c.innerText.includes('({v + 1}%)'))",
                                           timeout=120_000)
                    page.wait_for_selector(idle, timeout=120_000)
                    steps.append(time.perf_counter() - t)
                out[label].append(("plan: one slider step (ArrowRight until redrawn)", steps[0], min(steps[1:])))
            ctx.close()
    finally:
        for proc, log, _ in servers.values():
            stop_server(proc, log)
    return out


def report(info, view_times, app_times, browser_times, args) -> str:
    lines = ["# Dashboard at scale", "",
             f"Measured by `benchmarks/dashboard_scale.py` ({time.strftime('%Y-%m-%d')}, {platform.node()}, "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}).", "",
             f"Catalog: base + {len(info['experts'])} experts at {SIZE} scale (tensor shapes from "
             f"`mergepipe.research.family.tensor_shapes('{SIZE}')`, bf16), {args.block_mib:g} MiB grid: {info['tensors']} tensors, "
             f"{info['blocks_per_expert']} blocks per expert, {info['blocks_per_expert'] * len(info['experts']):,} block "
             f"rows with 2048-sample sketches ({info['db_mb']:.0f} MB catalog, built in {info['build_s']:.1f} s). "
             "Checkpoints are sparse files with real headers and block statistics are synthetic (random norms, "
             "sketches with a shared component); see the script's docstring. One plan (linear, 25 %) and one "
             "snapshot of it are recorded.", "",
             "## Pages", "",
             "Server side: Streamlit's AppTest runs the page script (queries, views, Plotly/Arrow serialization) "
             "once (cold: this page's own cache entries are empty; entries shared with an earlier row, e.g. the "
             "per-tensor statistics, may already be there) and again with its st.cache_data / st.cache_resource "
             "entries warm. The first row also pays the imports.", "",
             "| page | cold (s) | cached (s) |", "|---|---:|---:|"]
    for label, cold, warm in app_times:
        lines.append(f"| {label} | {cold:.2f} | {warm:.2f} |")
    if browser_times and len(browser_times) == 1:
        (only,) = browser_times.values()
        lines += ["", "In headless chromium through a real server (navigation until the script is idle and every "
                      f"Plotly chart is drawn; cached = best of {args.repeat} more visits):", "",
                  "| page | first visit (s) | cached (s) |", "|---|---:|---:|"]
        for label, cold, warm in only:
            lines.append(f"| {label} | {cold:.2f} | {warm:.2f} |")
    elif browser_times:
        (bl, before), (al, after) = browser_times.items()
        lines += ["", f"In headless chromium through a real server, **{bl}** (`{args.baseline}`) and **{al}** (this "
                      "tree) side by side in one run: one server per tree on the same catalog, the trees taking turns "
                      "page by page (navigation until the script is idle and every Plotly chart is drawn; cached = "
                      f"best of {args.repeat} more visits):", "",
                  f"| page | {bl} first (s) | {bl} cached (s) | {al} first (s) | {al} cached (s) | cached {al}/{bl} |",
                  "|---|---:|---:|---:|---:|---:|"]
        for (label, c0, w0), (_, c1, w1) in zip(before, after):
            lines.append(f"| {label} | {c0:.2f} | {w0:.2f} | {c1:.2f} | {w1:.2f} | {w1 / w0:.2f} |")
        worst_before = max(w for _, _, w in before)
        lines += ["", f"Slowest cached page in chromium: {bl} **{worst_before:.2f} s**, {al} "
                      f"**{max(w for _, _, w in after):.2f} s**."]
    worst = max([w for _, _, w in app_times] + [w for _, _, w in list(browser_times.values())[-1]]
                if browser_times else [w for _, _, w in app_times])
    lines += ["", f"Slowest cached render of this tree: **{worst:.2f} s** (target: under 2 s).", "",
              "## mergepipe.dashboard.views functions (first call, no cache)", "",
              "| function | seconds | note |", "|---|---:|---|"]
    for label, s, note in view_times:
        lines.append(f"| {label} | {s:.3f} | {note} |")
    lines += ["", "What keeps it fast: the pages cache DataFrames with st.cache_data keyed by the catalog path and a "
                  "statistics version (models, analyses, grids; run progress does not invalidate them), one "
                  "PlanContext per settings with st.cache_resource (a slider step only re-plans from arrays in "
                  "memory), the Plan page keeps each budget's plan, mask, frontier and EXPLAIN (PlanView) and the "
                  "Snapshots page each snapshot's manifest, recipe and figures (SnapshotView) with st.cache_resource, "
                  "so a cached load plans and draws nothing again; heatmap cells go to the browser as float32; "
                  "heatmaps above 100k cells are aggregated into bins (norms combine as the square root "
                  "of summed squares), the per-block detail is one layer at a time, and conflicts are one layer or "
                  "tensor of sketches at a time (vectorised: two matrix products for all expert pairs).", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--block-mib", type=float, default=1.0)
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "work" / "dashboard-scale"))
    ap.add_argument("--browser", action="store_true", help="also time the pages in headless chromium")
    ap.add_argument("--pages", help="comma-separated page labels as in the tables (default: every page)")
    ap.add_argument("--repeat", type=int, default=2, help="cached visits per page in chromium (the best counts)")
    ap.add_argument("--baseline", metavar="TREE",
                    help="with --browser: also serve the app of another checkout (e.g. `git archive REV | tar -x -C "
                         "DIR`) and time both side by side")
    ap.add_argument("--out", default=str(REPO / "docs" / "dashboard-scale.md"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    info = build(work, args.experts, int(args.block_mib * (1 << 20)))
    print(f"built {info['db']} in {info['build_s']:.1f} s: {info['blocks_per_expert']} blocks x {args.experts} experts",
          flush=True)
    view_times = time_views(info["db"], info["experts"], info["snapshot_id"])
    for label, s, note in view_times:
        print(f"  {label:<48} {s:7.3f} s  {note}", flush=True)
    pages = [(n, q) for n, q in APPTEST_PAGES if not args.pages or page_label(n, q) in args.pages.split(",")]
    app_times = time_apptest(info["db"], pages)
    for label, cold, warm in app_times:
        print(f"  apptest {label:<44} cold {cold:6.2f} s  cached {warm:6.2f} s", flush=True)
    trees = ({"before": Path(args.baseline).resolve()} if args.baseline else {}) | {
        ("after" if args.baseline else "this tree"): REPO}
    browser_times = time_browser(info["db"], trees, pages, args.repeat) if args.browser else {}
    for tree, rows in browser_times.items():
        for label, cold, warm in rows:
            print(f"  browser {tree:<9} {label:<44} first {cold:6.2f} s  cached {warm:6.2f} s", flush=True)
    text = report(info, view_times, app_times, browser_times, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
