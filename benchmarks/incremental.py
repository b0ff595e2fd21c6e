"""Incremental extend vs from-scratch merge, side by side in one run, cold cache (issue 17).

A published task-arithmetic merge of K experts; one more expert arrives. Contenders, each a `mergepipe`
command in its own process, every input file (base, all experts, the parent snapshot) evicted from the
page cache before it:

* extend:       mergepipe merge --extend PARENT --add expert_{K+1} --out ...
* from scratch: mergepipe merge --base base --experts expert_1 .. expert_{K+1} --budget B --out ...

at 100 % and 10 % budget. Bytes read come from the child's rusage (ru_inblock, benchmarks/child.py), wall
time from the child. Target: the extend reads <= snapshot + the new expert's planned bytes + the base
blocks under them + 1 %, and is >= 5x faster than the from-scratch merge at 100 %.

    python benchmarks/incremental.py --family benchmarks/work/qwen3-0.6b-bf16-K16 \\
        --catalog benchmarks/work/first-merge-K16/fm-analyze-K16.sqlite --k 15 --scratch /tmp/incr

The catalog (with the family registered and analyzed) is copied, never changed. Writes incremental.{md,json}
to --out (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import run  # noqa: E402

ROOT = run.ROOT
MB = 1e6


def mp(db: Path, *args) -> list[str]:
    return [run.PY, "-m", "mergepipe.cli", "--db", str(db), *map(str, args)]


def manifest_core(out: Path) -> dict:
    return json.loads((out / "mergepipe_manifest.json").read_text())["core"]


def bench(args) -> dict:
    fam = Path(args.family)
    work = Path(args.scratch)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    db = work / "catalog.sqlite"
    shutil.copy(args.catalog, db)
    k = args.k
    experts = [f"expert_{i}" for i in range(1, k + 1)]
    new = f"expert_{k + 1}"
    inputs = [fam / "base", *(fam / e for e in experts), fam / new]
    results = {}
    for budget in args.budgets:
        tag = budget.rstrip("%")
        parent, ext, scratch = work / f"parent-{tag}", work / f"extend-{tag}", work / f"scratch-{tag}"
        t0 = time.perf_counter()
        run.measure(mp(db, "merge", "--base", "base", "--experts", *experts, "--op", args.op,
                       "--budget", budget, "--out", parent))
        print(f"[{budget}] parent of {k} experts merged in {time.perf_counter() - t0:.1f} s", flush=True)
        run.cold([*inputs, parent])
        m_ext = run.measure(mp(db, "merge", "--extend", parent.name, "--add", new, "--out", ext))
        # what came from the model files (all evicted before): the rest of the child's reads is the
        # catalog (evicted by the merges' reads), Python's libraries and the like
        m_ext["model_files_read"] = run.resident_bytes([*inputs, parent])
        run.cold([*inputs, parent, ext])
        m_scr = run.measure(mp(db, "merge", "--base", "base", "--experts", *experts, new, "--op", args.op,
                               "--budget", budget, "--out", scratch))
        m_scr["model_files_read"] = run.resident_bytes(inputs)
        core = manifest_core(ext)
        est = core["estimated"]
        planned = est["snapshot_read"] + est["base_read"] + est["expert_read"]
        same = run.compare_outputs(ext, scratch)
        results[budget] = {
            "extend": {k2: m_ext[k2] for k2 in ("wall_s", "read_bytes", "model_files_read", "write_bytes",
                                                 "peak_rss_bytes")},
            "scratch": {k2: m_scr[k2] for k2 in ("wall_s", "read_bytes", "model_files_read", "write_bytes",
                                                  "peak_rss_bytes")},
            "planned": {"snapshot": est["snapshot_read"], "base": est["base_read"], "expert": est["expert_read"],
                        "total": planned},
            "scratch_planned": manifest_core(scratch)["estimated"],
            "realized": core["realized"],
            "compare": same,
        }
        print(json.dumps({budget: results[budget]}, indent=1, default=str), flush=True)
        for d in (parent, ext, scratch):
            shutil.rmtree(d, ignore_errors=True)
    return results


def report(results: dict, args) -> str:
    lines = [
        "# Incremental extend vs from-scratch merge",
        "",
        f"Produced by `python benchmarks/incremental.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): "
        f"{Path(args.family).name}, operator `{args.op}`, a published merge of {args.k} experts, then "
        f"`expert_{args.k + 1}` added. Each contender is one `mergepipe` process, every input file (base, all "
        "experts, the parent snapshot) evicted from the page cache before it; bytes are the child's disk reads "
        "(rusage), side by side in one run. The family on disk has 16 experts, so the parent holds 15 and the "
        "16th is the one that arrives.",
        "",
        "| budget | contender | wall s | read MB (process) | read MB (model files) | planned read MB | write MB | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for budget, r in results.items():
        e, s, p = r["extend"], r["scratch"], r["planned"]
        sp = r["scratch_planned"]
        lines.append(f"| {budget} | extend (snapshot + new expert + base blocks) | {e['wall_s']:.1f} | "
                     f"{e['read_bytes'] / MB:.0f} | {e['model_files_read'] / MB:.0f} | {p['total'] / MB:.0f} ({p['snapshot'] / MB:.0f} + "
                     f"{p['expert'] / MB:.0f} + {p['base'] / MB:.0f}) | {e['write_bytes'] / MB:.0f} | "
                     f"{e['peak_rss_bytes'] / MB:.0f} |")
        lines.append(f"| {budget} | from scratch, {args.k + 1} experts | {s['wall_s']:.1f} | {s['read_bytes'] / MB:.0f} | "
                     f"{s['model_files_read'] / MB:.0f} | "
                     f"{(sp['base_read'] + sp['expert_read']) / MB:.0f} | {s['write_bytes'] / MB:.0f} | "
                     f"{s['peak_rss_bytes'] / MB:.0f} |")
        ratio_t = s["wall_s"] / e["wall_s"]
        ratio_b = s["read_bytes"] / max(e["read_bytes"], 1)
        over = e["read_bytes"] / p["total"] - 1
        over_files = e["model_files_read"] / p["total"] - 1
        verdicts.append(f"- {budget}: extend {ratio_t:.1f}x faster, reads {ratio_b:.1f}x fewer bytes; extend read "
                        f"{over * 100:+.2f} % vs its plan in all (catalog and libraries included), "
                        f"{over_files * 100:+.2f} % from the model files (target <= +1 %: "
                        f"{'met' if over_files <= 0.01 else 'NOT met'} for the model files, "
                        f"{'met' if over <= 0.01 else 'NOT met'} in all)"
                        + (f"; speed target >= 5x: {'met' if ratio_t >= 5 else 'NOT met'}" if budget == "100%" else "")
                        + f"; extend vs scratch: {json.dumps(r['compare'])}")
    lines += ["", "## Ratios and targets", "", *verdicts, ""]
    full = results.get("100%")
    if full:
        e, s = full["extend"], full["scratch"]
        io_ratio = (s["read_bytes"] + s["write_bytes"]) / max(e["read_bytes"] + e["write_bytes"], 1)
        lines += ["## Notes", "",
                  f"- Both contenders write the same {e['write_bytes'] / MB:.0f} MB snapshot: counting reads and "
                  f"writes, the from-scratch merge moves {io_ratio:.1f}x the bytes of the extend at 100 %, which "
                  "bounds the speed-up a disk-bound extend can show on this disk.",
                  "- The machine (2 cores, a virtual disk) was shared with other sessions' tests and benchmarks "
                  "during the run: absolute times swing; compare the ratios of one run.",
                  "- `differing`/`max_abs`: the extend against the from-scratch merge of the same 16 experts. At "
                  "100 % both use the same access sets and differ by bf16 rounding only (the snapshot was "
                  "rounded to bf16 before the update: at most 1 ulp, see docs/incremental.md). At 10 % the "
                  "from-scratch plan re-runs the greedy selection over all 16 experts, so the access sets "
                  "differ (the extend equals the from-scratch merge with the extend's access sets, which the "
                  "tests check).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default=str(ROOT / "benchmarks/work/qwen3-0.6b-bf16-K16"))
    ap.add_argument("--catalog", default=str(ROOT / "benchmarks/work/first-merge-K16/fm-analyze-K16.sqlite"))
    ap.add_argument("--k", type=int, default=15, help="experts in the parent (the next one is added)")
    ap.add_argument("--op", default="task_arithmetic")
    ap.add_argument("--budgets", nargs="+", default=["100%", "10%"])
    ap.add_argument("--scratch", default="/tmp/mergepipe-incremental")
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks"))
    args = ap.parse_args(argv)
    results = bench(args)
    out = Path(args.out)
    (out / "incremental.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "incremental.md").write_text(report(results, args))
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
