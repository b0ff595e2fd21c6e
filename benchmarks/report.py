"""Turn benchmark results into docs/benchmarks/: results JSON, a markdown table, Plotly HTML charts."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def medians(runs: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in runs:
        if "failed" in r:
            continue
        groups[(r["op"], r["contender"])].append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {m: statistics.median(r[m] for r in rs) for m in ("wall_s", "read_bytes", "write_bytes", "peak_rss_bytes")}
        out[key]["n"] = len(rs)
        for extra in ("planned_expert_bytes", "full_expert_bytes", "base_bytes", "budget"):
            if extra in rs[0]:
                out[key][extra] = rs[0][extra]
    return out


def targets(results: dict) -> list[dict]:
    """P1-P6 of the benchmark issue, each met or not with its measured ratio (where measurable)."""
    rows = []
    fams = {f["K"]: f for f in results["families"]}
    kmax = max(fams)
    f = fams[kmax]
    m = medians(f["runs"])
    mk_k = max((k for k, fk in fams.items() if ("ties", "mergekit") in medians(fk["runs"])), default=None)
    if mk_k is not None:
        mm = medians(fams[mk_k]["runs"])
        mk = mm[("ties", "mergekit")]
        note = "" if mk_k == kmax else f" (mergekit ran up to K={mk_k}; measured there)"
        for b, target, label in (("10%", 12, "P1"), ("100%", 1.5, "P2")):
            mp = mm.get(("ties", f"mergepipe {b}"))
            if mp:
                ratio = mk["wall_s"] / mp["wall_s"]
                rows.append({"target": f"{label} ties d=0.2 budget {b}, K={kmax}: >= {target}x faster than mergekit{note}",
                             "measured": f"{ratio:.2f}x at K={mk_k}", "met": ratio >= target and mk_k == kmax})
    worst = None
    for (op, c), v in m.items():
        if c.startswith("mergepipe "):
            fl = m.get((op, "floor " + c.split(" ")[1]))
            if fl:
                r = v["wall_s"] / fl["wall_s"]
                if worst is None or r > worst[0]:
                    worst = (r, op, c)
    if worst:
        rows.append({"target": "P3 MergePipe wall <= 1.3x the I/O floor at every budget",
                     "measured": f"worst {worst[0]:.2f}x ({worst[1]}, {worst[2]})", "met": worst[0] <= 1.3})
    rss = {k: max(v["peak_rss_bytes"] for (op, c), v in medians(fams[k]["runs"]).items() if c.startswith("mergepipe"))
           for k in fams}
    rows.append({"target": "P4 peak RSS <= 1.5 GB, flat in K",
                 "measured": ", ".join(f"K={k}: {v / 1e9:.2f} GB" for k, v in sorted(rss.items())),
                 "met": max(rss.values()) <= 1.5e9 and (len(rss) < 2 or max(rss.values()) <= 1.25 * min(rss.values()))})
    plan_s = max(f.get("planning_s", {}).values() or [0])
    an_rec = results["analyze"]
    cat_frac = an_rec["catalog_bytes"] / an_rec["family_bytes"]
    rows.append({"target": f"P5 planning < 0.5 s at K={kmax}; catalog <= 1% of family bytes",
                 "measured": f"planning {plan_s * 1000:.0f} ms (slowest op/budget); catalog {cat_frac * 100:.2f}%",
                 "met": plan_s < 0.5 and cat_frac <= 0.01})
    am = medians(an_rec["runs"])
    an, cr = am.get(("-", "analyze")), am.get(("-", "cold-read"))
    if an and cr:
        ratio = cr["wall_s"] / an["wall_s"]
        rows.append({"target": "P6 ANALYZE >= 0.8x the speed of a plain cold read", "measured": f"{ratio:.2f}x",
                     "met": ratio >= 0.8})
    return rows


def table(results: dict) -> str:
    lines = []
    for f in results["families"]:
        m = medians(f["runs"])
        lines += [f"### {f['family']}, K={f['K']} ({f['family_bytes'] / 1e9:.2f} GB of checkpoints)", "",
                  "| op | contender | wall s | disk read MB | expert read planned MB | write MB | peak RSS MB | vs mergekit | vs floor |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for (op, c), v in sorted(m.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
            mk = m.get((op, "mergekit"))
            fl = m.get((op, "floor " + c.split(" ")[1])) if c.startswith("mergepipe ") else None
            lines.append(
                f"| {op} | {c} | {v['wall_s']:.2f} | {v['read_bytes'] / 1e6:.0f} | "
                f"{v.get('planned_expert_bytes', 0) / 1e6:.0f} | {v['write_bytes'] / 1e6:.0f} | "
                f"{v['peak_rss_bytes'] / 1e6:.0f} | {(mk['wall_s'] / v['wall_s']) if mk else float('nan'):.2f}x | "
                f"{(v['wall_s'] / fl['wall_s']) if fl else float('nan'):.2f}x |")
        failed = [r for r in f["runs"] if "failed" in r]
        for r in failed:
            lines.append(f"- {r['op']} / {r['contender']} failed: `{r['failed'].splitlines()[0][-160:]}`")
        lines.append("")
        if f.get("checks"):
            lines += ["Output checks:", ""]
            for name, c in f["checks"].items():
                if c.get("same_names"):
                    lines.append(f"- {name}: {c['differing']} of {c['total']} values differ "
                                 f"({c['fraction'] * 100:.3f}%), max |diff| {c['max_abs']:.3g}")
                else:
                    lines.append(f"- {name}: tensor names differ")
            lines.append("")
        plan = f.get("planning_s", {})
        if f is results["families"][0]:
            am = medians(results["analyze"]["runs"])
            lines.append(f"ANALYZE of {results['analyze'].get('timed_experts', results['analyze']['experts'])} experts: "
                         + ", ".join(f"{c} {v['wall_s']:.2f} s ({v['read_bytes'] / 1e6:.0f} MB read)" for (_, c), v in am.items())
                         + f"; catalog {results['analyze']['catalog_bytes'] / 1e6:.1f} MB "
                         f"({results['analyze']['catalog_bytes'] / results['analyze']['family_bytes'] * 100:.2f}% of the family)")
            lines.append("")
        if plan:
            lines.append(f"Planning (median of 5): {', '.join(f'{k} {v * 1000:.0f} ms' for k, v in plan.items())}")
            lines.append("")
    return "\n".join(lines)


def _order(c: str) -> tuple:
    kind, _, b = c.partition(" ")
    return ({"analyze": 0, "cold-read": 1, "mergepipe": 2, "floor": 3, "naive": 4, "mergekit": 5}.get(kind, 9),
            float(b.rstrip("%")) if b else 0)


def charts(results: dict, out: Path) -> list[Path]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fams = sorted(results["families"], key=lambda f: f["K"])
    paths, figs = [], []
    for op in sorted({r["op"] for f in fams for r in f["runs"] if r["op"] != "-"}):
        fig = make_subplots(rows=1, cols=2, subplot_titles=("expert + base bytes read from disk (GB)", "wall time (s)"))
        colors = {"naive": "#7f7f7f", "mergekit": "#d62728", "mergepipe 10%": "#1f77b4", "mergepipe 25%": "#17becf",
                  "mergepipe 100%": "#2ca02c"}
        for contender, color in colors.items():
            xs, reads, walls = [], [], []
            for f in fams:
                v = medians(f["runs"]).get((op, contender))
                if v:
                    xs.append(f["K"])
                    reads.append(v["read_bytes"] / 1e9)
                    walls.append(v["wall_s"])
            if xs:
                style = dict(mode="lines+markers", name=contender, legendgroup=contender, line=dict(color=color))
                fig.add_trace(go.Scatter(x=xs, y=reads, **style), 1, 1)
                fig.add_trace(go.Scatter(x=xs, y=walls, showlegend=False, **style), 1, 2)
        fig.update_xaxes(title_text="experts K")
        fig.update_layout(title=f"{op}: bytes read and wall time vs K ({results['profile']} profile)", height=420)
        p = out / f"{results['profile']}-{op}-vs-K.html"
        fig.write_html(p, include_plotlyjs="cdn")
        paths.append(p)
        figs.append((fig, p.with_suffix(".png")))
    return paths + figures_to_png(figs)


def figures_to_png(figs) -> list[Path]:
    """Render each figure to PNG with the local chromium (offline: plotly.js from the installed package)."""
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        return []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return []
    import tempfile
    pngs = []
    with tempfile.TemporaryDirectory() as profile, tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=str(chromium), headless=True, viewport={"width": 1100, "height": 460},
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        page = ctx.new_page()
        for i, (fig, png) in enumerate(figs):
            html = Path(tmp) / f"fig{i}.html"
            fig.write_html(html, include_plotlyjs="directory")
            page.goto(html.as_uri())
            page.wait_for_selector(".main-svg", timeout=20000)
            page.screenshot(path=str(png), full_page=True)
            pngs.append(png)
        ctx.close()
    return pngs


def write_report(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    prof = results["profile"]
    rows = targets(results)
    js = out / f"{prof}.json"
    js.write_text(json.dumps({**results, "targets": rows}, indent=2, default=str))
    md = out / f"{prof}.md"
    mach = results["machine"]
    md.write_text(
        f"# Benchmark: {prof} profile\n\nRun {results['started']} on {mach['cpus']} CPUs, {mach['memory_gib']} GiB RAM, "
        f"torch {mach['torch']}; cold cache before every run; medians of {results['repeats']} run(s). "
        f"Operators with a density use {results['density']}. Reproduce: `python benchmarks/run.py --profile {prof}`.\n\n"
        "## Targets\n\n| target | measured | met |\n|---|---|---|\n"
        + "".join(f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else 'no'} |\n" for r in rows)
        + "\n## Results\n\n" + table(results))
    return [js, md, *charts(results, out)]


if __name__ == "__main__":
    import sys
    res = json.loads(Path(sys.argv[1]).read_text())
    print("\n".join(map(str, write_report(res, Path(sys.argv[2])))))
