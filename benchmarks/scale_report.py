"""The model-size benchmark's report (benchmarks/large.py): targets, a table per operator, output checks,
and two figures: each operator's wall and peak RSS by contender with the I/O floor of each budget on the
same axes, and wall against model size (this run with the 40M and 0.6B runs already in docs/benchmarks/).

    python benchmarks/scale_report.py docs/benchmarks/scale-3b.json docs/benchmarks   # re-render
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import figures_to_png  # noqa: E402

MB = 1e6
CONTENDERS = ("mergekit", "mergepipe first merge", "mergepipe 10%", "mergepipe 25%", "mergepipe 100%")


def record(res: dict, op: str, contender: str) -> dict | None:
    return next((r for r in res["runs"] if r["op"] == op and r["contender"] == contender), None)


def floor_of(res: dict, budget: str) -> dict | None:
    return next((r for r in res["runs"] if r["contender"] == f"floor {budget}" and "failed" not in r), None)


def ratio(res: dict, op: str, contender: str) -> float | None:
    """mergekit's wall / this contender's; None where either did not finish."""
    mk, ours = record(res, op, "mergekit"), record(res, op, contender)
    if not mk or not ours or "failed" in ours or "failed" in mk:
        return None
    return mk["wall_s"] / ours["wall_s"]


def speed_target(res: dict, op: str, budget: str, goal: float) -> dict:
    r, mk = ratio(res, op, f"mergepipe {budget}"), record(res, op, "mergekit") or {}
    ours = record(res, op, f"mergepipe {budget}") or {}
    text = "not measured" if r is None else f"{r:.1f}x"
    if "failed" in mk and "wall_s" in ours:
        text = (f"no ratio: mergekit did not finish ({mk['failed'].split(':')[0]}); MergePipe took "
                f"{ours['wall_s']:.1f} s at {ours['peak_rss_bytes'] / 1e9:.2f} GB")
    return {"target": f"{op} {budget} >= {goal:g}x mergekit's wall", "measured": text,
            "met": None if r is None else r >= goal}


def targets(res: dict) -> list[dict]:
    rows = []
    if "ties" in res["ops"]:
        rows += [speed_target(res, "ties", "10%", 20), speed_target(res, "ties", "100%", 5)]
    ours = [r for r in res["runs"] if r["contender"].startswith("mergepipe") and "failed" not in r]
    peak = max((r["peak_rss_bytes"] for r in ours), default=0)
    worst = max(ours, key=lambda r: r["peak_rss_bytes"], default=None)
    rows.append({"target": "MergePipe peak RSS <= 2 GB, every step", "met": bool(ours) and peak <= 2e9,
                 "measured": f"{peak / 1e9:.2f} GB ({worst['op']}, {worst['contender']})" if worst else "not measured"})
    for name, c in res["checks"].items():
        if "vs mergekit" in name or "first merge vs" in name:
            rows.append({"target": f"{name}: equal", "measured": check_text(c),
                         "met": bool(c.get("same_dtypes")) and c.get("differing") == 0})
    return rows


def check_text(c: dict) -> str:
    if not c.get("same_dtypes"):
        return "tensor names or dtypes differ"
    return f"{c['differing']} of {c['total']} values differ ({c['fraction']:.4%}), max |diff| {c['max_abs']:.3g}"


def op_table(res: dict, op: str) -> list[str]:
    lines = [f"### {op}", "", "| contender | wall s | disk read MB | peak RSS MB | vs mergekit | I/O floor s |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in CONTENDERS:
        r = record(res, op, c)
        if r is None:
            continue
        if "failed" in r:
            lines.append(f"| {c} | {r['failed'].strip().splitlines()[-1][-400:]} | | | | |")
            continue
        x = ratio(res, op, c)
        fl = floor_of(res, c.split(" ")[1]) if c.startswith("mergepipe ") and "%" in c else None
        vs = "-" if c == "mergekit" else f"{x:.1f}x" if x else "mergekit did not finish"
        floor = f"{fl['wall_s']:.1f}" if fl else "-"
        lines.append(f"| {c} | {r['wall_s']:.1f} | {r['read_bytes'] / MB:.0f} | {r['peak_rss_bytes'] / MB:.0f} | "
                     f"{vs} | {floor} |")
    return lines + [""]


def write_scale_report(res: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = targets(res)
    stem = f"scale-{res['profile']}"
    js = out / f"{stem}.json"
    js.write_text(json.dumps({**res, "targets": rows}, indent=2, default=str))
    md = out / f"{stem}.md"
    md.write_text("\n".join(markdown(res, rows)) + "\n")
    return [js, md, *figures(res, out, stem)]


def markdown(res: dict, rows: list[dict]) -> list[str]:
    mach, cold = res["machine"], record(res, "-", "cold read")
    lines = [f"# Model size: a {res['size']}-shaped bf16 family, side by side with mergekit", "",
             f"Run {res['started']} (commit {res.get('commit', '79abed0')}) on {mach['cpus']} CPUs, {mach['memory_gib']} GiB RAM, Python {mach['python']}. "
             f"A base and {res['k']} experts of {res['model_bytes'] / 1e9:.2f} GB each "
             f"({res['family_bytes'] / 1e9:.1f} GB), generated for the run and deleted after it. Cold cache before "
             f"every contender, each its own process, one run each; density {res['density']}; mergekit 0.1.5 with "
             "`--lazy-unpickle` and its default shard size, float32 arithmetic, bfloat16 out. "
             "Reproduce: `" + ("python benchmarks/run.py --profile 3b" if res["profile"] == "3b" else
                               f"python benchmarks/large.py --size {res['size']} --k {res['k']}") + "`.", ""]
    if cold and "failed" not in cold:
        lines += [f"A plain cold read of the whole family: {cold['wall_s']:.1f} s "
                  f"({cold['read_bytes'] / cold['wall_s'] / MB:.0f} MB/s).", ""]
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|",
              *(f"| {r['target']} | {r['measured']} | {'n/a' if r['met'] is None else 'yes' if r['met'] else 'no'} |"
                for r in rows), "", "## Results", "",
              "The first merge is the sum of init-db, register base, register the experts and merge (analyzing on "
              "the way); the budgeted merges run on the catalog it left. The I/O floor reads exactly the plan's "
              "bytes (all of the base, the chosen expert blocks) and writes the output's size.", ""]
    for op in res["ops"]:
        lines += op_table(res, op)
    return lines + ["## Output checks", "", *(f"- {n}: {check_text(c)}" for n, c in res["checks"].items()), "",
                    TIE_NOTE]


# why TIES differs from mergekit, and the check that says so (benchmarks/tie_check.py, run 2026-12-07)
TIE_NOTE = ("TIES keeps mergekit's count of entries at its magnitude cut-off, but among entries tied at the cut-off "
            "it keeps the first in flat order where mergekit keeps torch's arbitrary pick ([operators](../operators.md))."
            " On these generated families, whose sparse bf16 deltas often tie at the cut-off, that makes 2-4 % of the "
            "values differ; `benchmarks/tie_check.py` finds every differing value at a position where an expert's "
            "|delta| ties at its cut-off (medium family, K = 4: all 1,099,551 of them; K = 2: all 638,122). DARE's "
            "random masks differ from mergekit's by design, so dare_ties is not compared.")


def figures(res: dict, out: Path, stem: str) -> list[Path]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, subplot_titles=("wall time (s)", "peak RSS (GB)"))
    for op in res["ops"]:
        xs, walls, rss = [], [], []
        for c in CONTENDERS:
            r = record(res, op, c)
            if r and "failed" not in r:
                xs.append(c.replace("mergepipe ", "mp "))
                walls.append(r["wall_s"])
                rss.append(r["peak_rss_bytes"] / 1e9)
        fig.add_trace(go.Bar(x=xs, y=walls, name=op, legendgroup=op), 1, 1)
        fig.add_trace(go.Bar(x=xs, y=rss, name=op, legendgroup=op, showlegend=False), 1, 2)
    fx = [f"mp {b}" for b in res["budgets"] if floor_of(res, b)]
    fig.add_trace(go.Scatter(x=fx, y=[floor_of(res, b)["wall_s"] for b in res["budgets"] if floor_of(res, b)],
                             mode="markers+lines", name="I/O floor", line=dict(color="black", dash="dot")), 1, 1)
    fig.update_layout(barmode="group", height=440, title=f"{res['size']}: wall and peak RSS by contender "
                                                          f"(K={res['k']}, cold cache)")
    html = out / f"{stem}.html"
    fig.write_html(html, include_plotlyjs="cdn")
    return [html, *figures_to_png([(fig, html.with_suffix(".png"))])]


def size_figure(out: Path) -> list[Path]:
    """Wall against model size for every scale-*.json under ``out`` (one figure per operator present in all
    of them): mergekit, MergePipe at 10 % and 100 %, and the I/O floors of those budgets, log-log."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    runs = sorted((json.loads(p.read_text()) for p in out.glob("scale-*.json")), key=lambda r: r["model_bytes"])
    if len(runs) < 2:
        return []
    ops = [op for op in ("linear", "ties") if all(op in r["ops"] for r in runs)]
    fig = make_subplots(rows=1, cols=len(ops), subplot_titles=[f"{op}: wall (s)" for op in ops])
    styles = {"mergekit": "#d62728", "mergepipe 10%": "#1f77b4", "mergepipe 100%": "#2ca02c",
              "floor 10%": "#1f77b4", "floor 100%": "#2ca02c"}
    for col, op in enumerate(ops, 1):
        for c, color in styles.items():
            pts = [(r["model_bytes"] / 2e9, rec["wall_s"]) for r in runs
                   for rec in [floor_of(r, c.split(" ")[1]) if c.startswith("floor") else record(r, op, c)]
                   if rec and "failed" not in rec]
            dash = "dot" if c.startswith("floor") else "solid"
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=c,
                                     legendgroup=c, showlegend=col == 1, line=dict(color=color, dash=dash)), 1, col)
        for r in runs:  # a mergekit that did not finish: where and why, instead of a point
            mk = record(r, op, "mergekit")
            if mk and "failed" in mk:
                fig.add_annotation(x=math.log10(r["model_bytes"] / 2e9), y=math.log10(mk.get("stopped_after_s", 60)),
                                   text=f"mergekit stopped:<br>{mk.get('rss_when_stopped_bytes', 0) / 1e9:.1f} GB RSS",
                                   showarrow=True, font=dict(color="#d62728"), row=1, col=col)
    fig.update_xaxes(type="log", title_text="parameters (billions, bf16)")
    fig.update_yaxes(type="log")
    fig.update_layout(height=440, title="Wall time against model size, K=4, cold cache (dotted: the I/O floor)")
    html = out / "scale-vs-size.html"
    fig.write_html(html, include_plotlyjs="cdn")
    return [html, *figures_to_png([(fig, html.with_suffix(".png"))])]


if __name__ == "__main__":
    target = Path(sys.argv[2])
    paths = write_scale_report(json.loads(Path(sys.argv[1]).read_text()), target) + size_figure(target)
    print("\n".join(map(str, paths)))
