"""Many experts (K = 2, 16, 32, 64 of one medium bf16 family, 80 MB a model): what grows with K and what must not.

For each K (the first K experts of one 64-expert family, each K its own catalog):

* the catalog's bytes after register + ANALYZE, against the family's (base + K experts) bytes, per table; and the
  same with the Gram statistics (``analyze --gram``) that the interpolation methods need (K^2 pairs);
* planning time of every operator that takes many experts, at 10 % and 100 %, in this process after imports
  (``api.plan`` of a ``MergeRequest``, nothing saved): the first call and the median of the next ``--repeats``,
  wall and CPU (CPU time is the steadier number on a shared machine);
* EXPLAIN's line count for a 10 % linear plan (default: the top 16 experts) and with every expert listed;
* wall time and peak RSS of a 10 % and a 100 % merge (linear and ties), each in a child process started by
  benchmarks/child.py (its own ru_maxrss), cold cache (every input evicted first).

Results: docs/benchmarks/k64.md, k64.json and a figure vs K (k64-vs-K.html, .png with chromium).

    .venv/bin/python benchmarks/run.py --profile k64                 # the same as:
    .venv/bin/python benchmarks/scale_k.py [--ks 2 16 32 64] [--repeats 5] [--no-merge] [--work DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import PY, cold, machine_info, measure  # noqa: E402
from mergepipe import api  # noqa: E402
from mergepipe.analyze.runner import analyze  # noqa: E402
from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.catalog.models import register, register_many  # noqa: E402
from mergepipe.research.family import make_family  # noqa: E402
from mergepipe.storage.safetensors import open_checkpoint  # noqa: E402

KS = (2, 16, 32, 64)
# operators that merge many experts: the task-vector family (plain ANALYZE) and the interpolation methods that
# need the Gram statistics (analyze --gram); nuslerp takes exactly two experts (K = 2 only)
OPS = ("linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della",
       "della_linear", "ram")
GRAM_OPS = ("model_stock", "karcher", "multislerp", "sce", "ramplus_tl", "nuslerp")
MERGE_OPS = ("linear", "ties")
BUDGETS = ("10%", "100%")
DENSITY = 0.2


def ensure_family(work: Path, kmax: int) -> Path:
    fam = work / "family"
    if not (fam / f"expert_{kmax}" / "config.json").exists():
        shutil.rmtree(fam, ignore_errors=True)
        print(f"[k64] writing {fam} ({kmax} experts) ...", flush=True)
        make_family(fam, experts=kmax, size="medium", dtype="bf16", seed=0)
    return fam


def family_bytes(fam: Path, k: int) -> int:
    return sum(open_checkpoint(p).nbytes for p in [fam / "base", *(fam / f"expert_{i}" for i in range(1, k + 1))])


def ids(k: int) -> list[str]:
    return [f"e{i}" for i in range(1, k + 1)]


def build_catalog(fam: Path, k: int, db: Path, gram: bool) -> dict:
    """Register base + the first k experts and ANALYZE them (reused when built before); its bytes per table, as
    measured right after ANALYZE (a reused catalog also holds the plans and snapshots of earlier merges)."""
    done = db.with_suffix(".done")
    if done.exists() and "bytes" in json.loads(done.read_text()):
        return json.loads(done.read_text())
    for s in ("", "-wal", "-shm"):
        Path(str(db) + s).unlink(missing_ok=True)
    cat = Catalog(db)
    register(cat, "base", str(fam / "base"))
    register_many(cat, [(e, str(fam / f"expert_{i}")) for i, e in enumerate(ids(k), 1)], base_id="base")
    t0 = time.perf_counter()
    analyze(cat, ids(k), gram=gram)
    seconds = time.perf_counter() - t0
    cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    tables = dict(cat.conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall())
    cat.close()
    rec = {"bytes": db.stat().st_size, "tables": tables, "analyze_s": seconds}
    done.write_text(json.dumps(rec))
    return rec


def op_settings(op: str) -> dict:
    return {"density": DENSITY} if op in ("ties", "dare_ties", "dare_linear", "della", "della_linear",
                                          "breadcrumbs", "breadcrumbs_ties") else {}


def time_planning(db: Path, k: int, ops, repeats: int) -> dict:
    """op@budget -> first call and median of ``repeats`` more (wall, CPU seconds), digest, or the refusal."""
    cat = Catalog(db)
    out = {}
    try:
        for op in ops:
            for b in BUDGETS:
                try:
                    req = api.merge_request("base", ids(k), op, budget=b, **op_settings(op))
                    walls, cpus, plan = [], [], None
                    for _ in range(repeats + 1):
                        t0, c0 = time.perf_counter(), time.process_time()
                        plan = api.plan(cat, req, save=False)
                        walls.append(time.perf_counter() - t0)
                        cpus.append(time.process_time() - c0)
                    out[f"{op}@{b}"] = {"first_s": walls[0], "first_cpu_s": cpus[0],
                                        "median_s": statistics.median(walls[1:]),
                                        "median_cpu_s": statistics.median(cpus[1:]), "digest": plan.digest}
                except Exception as exc:  # e.g. nuslerp with more than two experts
                    out[f"{op}@{b}"] = {"refused": str(exc).splitlines()[0][:200]}
    finally:
        cat.close()
    return out


def explain_lines(db: Path, k: int) -> dict:
    cat = Catalog(db)
    try:
        plan = api.plan(cat, api.merge_request("base", ids(k), "linear", budget="10%"), save=False)
        return {"default": len(plan.explain().splitlines()), "all": len(plan.explain(experts_top=None).splitlines()),
                "expert_rows_default": min(k, 16), "experts": k}
    finally:
        cat.close()


def merges(db: Path, fam: Path, k: int, work: Path, repeats: int) -> list[dict]:
    """A 10 % and a 100 % merge of each MERGE_OPS, each a child process on a cold cache (wall, peak RSS, bytes)."""
    runs = []
    inputs = [fam / "base", *(fam / f"expert_{i}" for i in range(1, k + 1))]
    cat = Catalog(db)
    try:
        plans = {(op, b): api.plan(cat, api.merge_request("base", ids(k), op, budget=b, **op_settings(op)))
                 for op in MERGE_OPS for b in BUDGETS}
    finally:
        cat.close()
    for rep in range(repeats):
        for (op, b), plan in plans.items():
            (work / "out").mkdir(exist_ok=True)
            out = work / "out" / f"K{k}-{op}-{b.rstrip('%')}"
            shutil.rmtree(out, ignore_errors=True)
            cold(inputs)
            r = measure([PY, "-m", "mergepipe.cli", "--db", str(db), "execute", plan.id, "--out", str(out),
                         "--model-id", f"k{k}-{op}-{b.rstrip('%')}-{rep}-{time.time_ns()}"])
            r.pop("stdout", None)
            runs.append({"op": op, "budget": b, "rep": rep, "planned_expert_bytes": plan["estimate"]["expert_read"],
                         **r})
            shutil.rmtree(out, ignore_errors=True)
            print(f"[k64] K={k} {op} {b}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                  flush=True)
    return runs + floors(plans, inputs, work)


def floors(plans: dict, inputs: list[Path], work: Path) -> list[dict]:
    """The I/O floor of each budget (benchmarks/floor.py over the first MERGE_OPS plan: read exactly its bytes,
    write the output's size), cold, in a child process like the merges."""
    runs = []
    for b in BUDGETS:
        pj, fl = work / "floor-plan.json", work / "floor.bin"
        pj.write_text(plans[(MERGE_OPS[0], b)].to_json())
        fl.unlink(missing_ok=True)
        cold(inputs)
        r = measure([PY, str(ROOT / "benchmarks" / "floor.py"), str(pj), str(fl)])
        r.pop("stdout", None)
        fl.unlink(missing_ok=True)
        runs.append({"op": "floor", "budget": b, "rep": 0, **r})
    return runs


def rss_flat(results: dict) -> list[dict]:
    """Per op and budget: peak RSS at the smallest and the largest K (medians over repeats) and their ratio."""
    by = {}
    for f in results["families"]:
        for r in f.get("merges", []):
            by.setdefault((r["op"], r["budget"]), {}).setdefault(f["K"], []).append(r["peak_rss_bytes"])
    rows = []
    for (op, b), per_k in sorted(by.items()):
        if op == "floor":
            continue
        lo, hi = min(per_k), max(per_k)
        a, z = statistics.median(per_k[lo]), statistics.median(per_k[hi])
        rows.append({"op": op, "budget": b, "k_lo": lo, "k_hi": hi, "rss_lo": a, "rss_hi": z, "ratio": z / a})
    return rows


def markdown(results: dict) -> str:
    fams = sorted(results["families"], key=lambda f: f["K"])
    m = results["machine"]
    lines = [f"# Many experts: K = {', '.join(str(f['K']) for f in fams)}", "",
             f"Run {results['started']} on {m['cpus']} CPUs, {m['memory_gib']} GiB RAM, Python {m['python']} "
             f"(load average at start {results['load']}); medium bf16 family (80 MB a model), the first K of 64 "
             f"experts, 1 MiB blocks, density {DENSITY} where an operator takes one. "
             "Reproduce: `.venv/bin/python benchmarks/run.py --profile k64` (`benchmarks/scale_k.py`).", "",
             "## Catalog bytes (register + ANALYZE) vs the family's bytes", "",
             "| K | family | catalog | % of family | with --gram | % | sketches (blocks table) | tensor_stats | gram |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in fams:
        c, g, fb = f["catalog"], f.get("gram_catalog") or {}, f["family_bytes"]
        gb = g.get("bytes")
        lines.append(f"| {f['K']} | {fb / 1e9:.2f} GB | {c['bytes'] / 1e6:.1f} MB | {100 * c['bytes'] / fb:.2f} % | "
                     + (f"{gb / 1e6:.1f} MB | {100 * gb / fb:.2f} % | " if gb else "- | - | ")
                     + f"{c['tables'].get('blocks', 0) / 1e6:.1f} MB | {c['tables'].get('tensor_stats', 0) / 1e6:.1f} MB"
                     f" | {g.get('tables', {}).get('gram', 0) / 1e6:.1f} MB |")
    lines += ["", "## Planning time (in process, after imports; `api.plan`, nothing saved)", "",
              "Median of the repeats after the first call, wall (CPU) in ms; the goal is < 200 ms at K = 64.", "",
              "| operator | budget | " + " | ".join(f"K={f['K']}" for f in fams) + " | first call at K="
              f"{fams[-1]['K']} |", "|---|---|" + "---:|" * (len(fams) + 1)]
    keys = [k for k in fams[-1]["planning"]]
    for key in keys:
        op, b = key.split("@")
        cells = []
        for f in fams:
            v = f["planning"].get(key, {})
            cells.append("refused" if "refused" in v else f"{1e3 * v['median_s']:.0f} ({1e3 * v['median_cpu_s']:.0f})"
                         if v else "-")
        last = fams[-1]["planning"][key]
        first = "-" if "refused" in last else f"{1e3 * last['first_s']:.0f} ({1e3 * last['first_cpu_s']:.0f})"
        lines.append(f"| {op} | {b} | " + " | ".join(cells) + f" | {first} |")
    lines += ["", "## EXPLAIN (10 % linear plan)", "", "| K | lines (default: top 16 experts) | lines (--all) |",
              "|---:|---:|---:|"]
    lines += [f"| {f['K']} | {f['explain']['default']} | {f['explain']['all']} |" for f in fams]
    lines += merge_section(results, fams)
    return "\n".join(lines) + "\n"


def merge_section(results: dict, fams: list[dict]) -> list[str]:
    if not any(f.get("merges") for f in fams):
        return []
    lines = ["", "## Merges: wall time and peak RSS (child process, cold cache; median of repeats)", ""]
    if results.get("merges_run"):  # merges measured by an earlier run of this script (the same catalogs)
        lines += [f"Measured in the run of {results['merges_run']['started']} (load average at start "
                  f"{results['merges_run']['load']}).", ""]
    lines += ["| K | op | budget | wall s | peak RSS MiB | read from disk GB |", "|---:|---|---|---:|---:|---:|"]
    for f in fams:
        by = {}
        for r in f.get("merges", []):
            by.setdefault((r["op"], r["budget"]), []).append(r)
        for (op, b), rs in sorted(by.items()):
            med = {m: statistics.median(r[m] for r in rs) for m in ("wall_s", "peak_rss_bytes", "read_bytes")}
            lines.append(f"| {f['K']} | {op} | {b} | {med['wall_s']:.1f} | {med['peak_rss_bytes'] / 2**20:.0f} | "
                         f"{med['read_bytes'] / 1e9:.2f} |")
    lines += ["", "Peak RSS flat in K (goal: the largest K within 15 % of the smallest):", "",
              "| op | budget | K lo | RSS MiB | K hi | RSS MiB | ratio | within 15 % |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rss_flat(results):
        lines.append(f"| {r['op']} | {r['budget']} | {r['k_lo']} | {r['rss_lo'] / 2**20:.0f} | {r['k_hi']} | "
                     f"{r['rss_hi'] / 2**20:.0f} | {r['ratio']:.2f} | {'yes' if r['ratio'] <= 1.15 else 'no'} |")
    return lines


def figure(results: dict, out: Path) -> list[Path]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fams = sorted(results["families"], key=lambda f: f["K"])
    ks = [f["K"] for f in fams]
    fig = make_subplots(rows=1, cols=4, subplot_titles=("planning, median ms (10 %)", "catalog % of family",
                                                        "merge peak RSS (MiB)", "merge wall s (dotted: I/O floor)"))
    for key in fams[-1]["planning"]:
        if key.endswith("@10%") and all("median_s" in f["planning"].get(key, {}) for f in fams):
            fig.add_trace(go.Scatter(x=ks, y=[1e3 * f["planning"][key]["median_s"] for f in fams], mode="lines+markers",
                                     name=key.split("@")[0]), 1, 1)
    fig.add_trace(go.Scatter(x=ks, y=[100 * f["catalog"]["bytes"] / f["family_bytes"] for f in fams],
                             mode="lines+markers", name="catalog %"), 1, 2)
    for op in MERGE_OPS:
        for b in BUDGETS:
            ys = [statistics.median([r["peak_rss_bytes"] / 2**20 for r in f.get("merges", [])
                                     if r["op"] == op and r["budget"] == b] or [float("nan")]) for f in fams]
            fig.add_trace(go.Scatter(x=ks, y=ys, mode="lines+markers", name=f"{op} {b} RSS"), 1, 3)
    for op in (*MERGE_OPS, "floor"):
        for b in BUDGETS:
            ys = [statistics.median([r["wall_s"] for r in f.get("merges", []) if r["op"] == op and r["budget"] == b]
                                    or [float("nan")]) for f in fams]
            fig.add_trace(go.Scatter(x=ks, y=ys, mode="lines+markers", name=f"{op} {b} wall",
                                     line=dict(dash="dot" if op == "floor" else "solid")), 1, 4)
    fig.update_xaxes(title_text="experts K")
    fig.update_layout(title="Many experts: planning, catalog size and merge memory vs K", height=440)
    html = out / "k64-vs-K.html"
    fig.write_html(html, include_plotlyjs="cdn")
    from benchmarks.report import figures_to_png
    try:
        return [html, *figures_to_png([(fig, html.with_suffix(".png"))])]
    except Exception as exc:  # no chromium, or it failed: the HTML is the figure
        print(f"[k64] no PNG: {exc}", flush=True)
        return [html]


def write(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "k64.json", out / "k64.md"
    js.write_text(json.dumps({**results, "rss_flat": rss_flat(results)}, indent=2, default=str))
    md.write_text(markdown(results))
    return [js, md]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="*", default=list(KS))
    ap.add_argument("--repeats", type=int, default=5, help="planning calls timed after the first (default 5)")
    ap.add_argument("--merge-repeats", type=int, default=1, help="runs of each merge (default 1)")
    ap.add_argument("--no-merge", action="store_true", help="catalog, planning and EXPLAIN only")
    ap.add_argument("--no-gram", action="store_true", help="skip the --gram catalogs and the interpolation methods")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args, _ = ap.parse_known_args(argv)  # run.py's other options (--profile's siblings) are not ours
    import os
    work = Path(args.work) / "k64"
    work.mkdir(parents=True, exist_ok=True)
    fam = ensure_family(work, max(args.ks))
    results = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "density": DENSITY, "families": []}
    for k in sorted(args.ks):
        print(f"[k64] K={k}: catalog", flush=True)
        rec = {"K": k, "family_bytes": family_bytes(fam, k), "catalog": build_catalog(fam, k, work / f"K{k}.sqlite", False)}
        if not args.no_gram:
            rec["gram_catalog"] = build_catalog(fam, k, work / f"K{k}-gram.sqlite", True)
        print(f"[k64] K={k}: planning", flush=True)
        rec["planning"] = time_planning(work / f"K{k}.sqlite", k, OPS, args.repeats)
        if not args.no_gram:
            rec["planning"].update(time_planning(work / f"K{k}-gram.sqlite", k, GRAM_OPS, args.repeats))
        rec["explain"] = explain_lines(work / f"K{k}.sqlite", k)
        if not args.no_merge:
            rec["merges"] = merges(work / f"K{k}.sqlite", fam, k, work, args.merge_repeats)
        results["families"].append(rec)
        write(results, Path(args.out))  # after every K: a later failure loses nothing
    paths = write(results, Path(args.out)) + figure(results, Path(args.out))
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
