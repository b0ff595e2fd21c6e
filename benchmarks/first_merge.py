"""The first merge, side by side with mergekit in one run, cold cache (issue 12).

What a new user waits for, from no catalog to a merged model: `init-db`, `register` of the base, one
`register` of the K experts (the batch form), `merge` (experts registered but not analyzed are analyzed
during the merge, at full read). Each step is its own process, typed as a user types it; the first-merge
time is the sum of their walls. Then, on the same catalog (now analyzed), the second merge at 10 % and
100 %; ANALYZE against a plain cold read of the same files; `register` time per model; CLI start-up.

    python benchmarks/first_merge.py                                 # qwen3-0.6b bf16, K = 4 and 16
    python benchmarks/first_merge.py --work /work/main/benchmarks/work --runs 3
    python benchmarks/first_merge.py --with-analyze-step             # also today's register, analyze, merge
    python benchmarks/first_merge.py --profile ci                    # small family, K=2, no mergekit
    python benchmarks/first_merge.py --analyze-only --runs 3         # ANALYZE vs cold read alone -> analyze.md
    python benchmarks/first_merge.py --profile medium --analyze-only --runs 3   # K=4,16,64 -> analyze-medium.md
    python benchmarks/first_merge.py --profile medium --ks 4 --runs 3           # first merge vs mergekit, medium

A family with at least max(--ks) experts already under --work is reused (the first K experts of it),
never rewritten. Each K starts with one unmeasured read of its files (the virtual disk's host cache
favours files read before: every contender then meets the same host cache), and each contender then
starts with every input file evicted from the page cache; the steps of one first merge follow each other
with no eviction between them, as for a user (today's analyze step leaves the files cached for the merge).
Bytes and peak RSS come from the rusage of each child (benchmarks/child.py through run.measure).
Writes first-merge.{md,json} to --out (first-merge-ci.* for the ci profile).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import run  # noqa: E402
from benchmarks.report import medians  # noqa: E402
from mergepipe.storage.safetensors import open_checkpoint  # noqa: E402

ROOT = run.ROOT
PROFILES = {
    "ci": dict(size="small", dtype="bf16", ks=[2], ops=["linear", "ties"], mergekit=False, cli_reps=1),
    "full": dict(size="qwen3-0.6b", dtype="bf16", ks=[4, 16], ops=["linear", "task_arithmetic", "ties"],
                 mergekit=True, cli_reps=5),
    # the medium family (80 MB a model): ANALYZE against a cold read up to K=64 (5.2 GB on disk) fits the disk
    "medium": dict(size="medium", dtype="bf16", ks=[4, 16, 64], ops=["linear", "task_arithmetic", "ties"],
                   mergekit=True, cli_reps=5),
}
# analyze-only reports: the full profile's is docs/benchmarks/analyze.md (as before), others analyze-<profile>.md
ANALYZE_STEM = {"full": "analyze"}
DENSITY_OPS = ("ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear")
BUDGETS = ("10%", "100%")
FIRST = "mergepipe first merge"
LEGACY = "mergepipe first merge, analyze step"
SECOND = "mergepipe second merge "
MB = 1e6


# --- commands ---------------------------------------------------------------------------------------
def mp(*args) -> list[str]:
    """``mergepipe ARGS`` as a user types it."""
    return [run.PY, "-m", "mergepipe.cli", *map(str, args)]


def merge_cmd(db: Path, fam: dict, op: str, out: Path, budget: str | None = None) -> list[str]:
    cmd = mp("--db", db, "merge", "--base", "base", "--experts", *(p.name for p in fam["experts"]), "--op", op)
    if op in DENSITY_OPS:
        cmd += ["--density", str(run.DENSITY)]
    if budget:
        cmd += ["--budget", budget]
    return cmd + ["--out", str(out), "--model-id", out.name]


def fresh(db: Path) -> Path:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    return db


def inputs(fam: dict) -> list[Path]:
    return [fam["base"], *fam["experts"]]


def step(name: str, cmd: list[str], must: bool = True) -> dict:
    """One process, measured; with must=False a failure is recorded (run.attempt), not raised."""
    r = run.measure(cmd) if must else run.attempt(cmd, name)
    r.pop("stdout", None)
    return {"step": name, **r}


def combine(name: str, parts: list[dict]) -> dict:
    """Steps run one after another: walls and bytes add up, the peak RSS is the largest; one failed step
    fails them all."""
    failed = next((p["failed"] for p in parts if "failed" in p), None)
    if failed:
        return {"step": name, "failed": failed}
    return {"step": name, **{m: sum(p[m] for p in parts) for m in ("wall_s", "read_bytes", "write_bytes")},
            "peak_rss_bytes": max(p["peak_rss_bytes"] for p in parts)}


# --- the family ---------------------------------------------------------------------------------------
def find_family(work: Path, size: str, dtype: str, k: int) -> dict:
    """The smallest complete family under ``work`` with at least ``k`` experts, else a new one of ``k``."""
    have = []
    for d in work.glob(f"{size}-{dtype}-K*"):
        n = d.name.rsplit("-K", 1)[1]
        if d.is_dir() and n.isdigit() and int(n) >= k and (d / f"expert_{n}" / "config.json").exists():
            have.append(int(n))
    return run.ensure_family(work, size, dtype, min(have, default=k))  # present: returned as it is


def first_k(fam: dict, k: int) -> dict:
    return {**fam, "experts": fam["experts"][:k]}


def fam_bytes(fam: dict) -> int:
    """One model's bytes (the base's)."""
    return open_checkpoint(fam["base"]).nbytes


# --- contenders ---------------------------------------------------------------------------------------
def register_experts(db: Path, fam: dict) -> tuple[list[dict], str]:
    """The batch form: one process, ids = directory names. Today's CLI lacks it: on a non-zero exit,
    one `register --model-id --uri` process per expert (the fallback, marked in the report)."""
    batch = step(f"register {len(fam['experts'])} experts",
                 mp("register", "--db", db, "--base", "base", *fam["experts"]), must=False)
    if "failed" not in batch:
        return [batch], "batch"
    each = [step(p.name, mp("register", "--db", db, "--model-id", p.name, "--uri", p, "--base", "base"))
            for p in fam["experts"]]
    return [combine(f"register {len(each)} experts (fallback: one process each)", each)], "fallback"


def first_merge(fam: dict, op: str, db: Path, out: Path, analyze_step: bool) -> dict:
    """Fresh catalog, cold cache, then the user's commands one process each."""
    fresh(db)
    shutil.rmtree(out, ignore_errors=True)
    run.cold(inputs(fam))
    steps = [step("init-db", mp("init-db", "--db", db)),
             step("register base", mp("register", "--db", db, "--model-id", "base", "--uri", fam["base"]))]
    reg, path = register_experts(db, fam)
    steps += reg
    if analyze_step:
        steps.append(step("analyze", mp("--db", db, "analyze")))
    steps.append(step("merge", merge_cmd(db, fam, op, out), must=False))
    total = combine("total", steps)
    total.pop("step")
    return {"contender": LEGACY if analyze_step else FIRST, "op": op, **total, "steps": steps,
            "register_path": path, "db": str(db), "out": str(out)}


def second_merges(fam: dict, op: str, db: Path, outdir: Path) -> list[dict]:
    recs = []
    for b in BUDGETS:
        out = outdir / f"second-{op}-{b.rstrip('%')}"
        shutil.rmtree(out, ignore_errors=True)
        run.cold(inputs(fam))
        r = step("merge", merge_cmd(db, fam, op, out, b), must=False)
        recs.append({"contender": SECOND + b, "op": op, "budget": b, **r, "steps": [r], "out": str(out)})
    return recs


def mergekit(exe: Path, fam: dict, op: str, outdir: Path) -> dict:
    cfg = outdir / f"mergekit-{op}.yml"
    cfg.write_text(run.mergekit_yaml(op, fam["base"], fam["experts"], run.DENSITY))
    out = outdir / f"mergekit-{op}"
    shutil.rmtree(out, ignore_errors=True)
    run.cold(inputs(fam))
    r = step("mergekit-yaml", [exe, cfg, out, "--copy-tokenizer"], must=False)
    return {"contender": "mergekit", "op": op, **r, "steps": [r], "out": str(out)}


def bench_op(args, fam, op, outdir, mk_exe) -> tuple[list[dict], dict]:
    """--runs rounds of every contender for one operator; output checks on the last round's outputs."""
    recs = []
    for rep in range(args.runs):
        rnd = []
        if mk_exe:
            rnd.append(mergekit(mk_exe, fam, op, outdir))
        new = first_merge(fam, op, outdir / f"first-{op}.sqlite", outdir / f"first-{op}", False)
        rnd.append(new)
        if args.with_analyze_step:
            rnd.append(first_merge(fam, op, outdir / f"legacy-{op}.sqlite", outdir / f"legacy-{op}", True))
        analyzed = next((r for r in rnd if r["contender"] in (FIRST, LEGACY) and "failed" not in r), None)
        if analyzed:  # the second merge, on the catalog the first merge analyzed
            rnd += second_merges(fam, op, Path(analyzed["db"]), outdir)
        recs += [{**r, "rep": rep} for r in rnd]
    return recs, output_checks(rnd, op)


def output_checks(rnd: list[dict], op: str) -> dict:
    """First merge (analyzed in flight) vs the second merge at 100 % (expect 0 differing values), and
    MergePipe vs mergekit."""
    done = {r["contender"]: Path(r["out"]) for r in rnd if "failed" not in r}
    checks = {}
    full = done.get(SECOND + "100%")
    for first in (FIRST, LEGACY):
        if first in done and full:
            checks[f"{op}: {first} vs {SECOND}100%"] = run.compare_outputs(done[first], full)
    ours = done.get(FIRST) or done.get(LEGACY)
    if ours and "mergekit" in done:
        checks[f"{op}: {FIRST if FIRST in done else LEGACY} vs mergekit"] = run.compare_outputs(ours, done["mergekit"])
    return checks


# --- ANALYZE, register, start-up ------------------------------------------------------------------------
def analyze_vs_coldread(fam: dict, work: Path, runs: int) -> list[dict]:
    """`mergepipe analyze` on a fresh catalog with the experts registered vs benchmarks/coldread.py over
    the same files (base + K experts), each cold."""
    db = work / f"fm-analyze-K{len(fam['experts'])}.sqlite"
    recs = []
    for rep in range(runs):
        run._family_catalog(fresh(db), fam, [p.name for p in fam["experts"]]).close()
        run.cold(inputs(fam))
        recs.append({"contender": "cold-read", "op": "-", "rep": rep,
                     **step("coldread", [run.PY, ROOT / "benchmarks" / "coldread.py", *inputs(fam)])})
        run.cold(inputs(fam))
        recs.append({"contender": "analyze", "op": "-", "rep": rep, **step("analyze", mp("--db", db, "analyze"))})
    return recs


def register_times(fam: dict, db: Path) -> list[float]:
    """`register` of each expert in a fresh process, into a fresh catalog holding the base, cold cache."""
    fresh(db)
    run.cold(inputs(fam))
    step("init-db", mp("init-db", "--db", db))
    step("register base", mp("register", "--db", db, "--model-id", "base", "--uri", fam["base"]))
    return [step(p.name, mp("register", "--db", db, "--model-id", p.name, "--uri", p, "--base", "base"))["wall_s"]
            for p in fam["experts"]]


def cli_startup(work: Path, models_db: Path, reps: int) -> dict:
    """Median wall of commands that do no tensor work; `models` lists a catalog holding a family."""
    x = work / "fm-cli.sqlite"
    cmds = {"mergepipe --help": mp("--help"), "mergepipe init-db --db X": mp("init-db", "--db", x),
            "mergepipe --db X models": mp("--db", models_db, "models")}
    out = {}
    for name, cmd in cmds.items():
        walls = []
        for _ in range(reps):
            fresh(x)
            walls.append(step(name, cmd)["wall_s"])
        out[name] = statistics.median(walls)
    return out


# --- the report ----------------------------------------------------------------------------------------
def first_contender(m: dict, op: str) -> str | None:
    """The first merge the targets judge: the new flow, or today's (with an analyze step) if it failed."""
    return next((c for c in (FIRST, LEGACY) if (op, c) in m), None)


def vs_mergekit_row(fams: dict, op: str, k: int, limit: float, faster: bool) -> dict:
    what = f">= {limit:g}x faster than mergekit" if faster else f"<= {limit:g}x mergekit's wall"
    row = {"target": f"{op} first merge {what}, K={k}", "measured": "not measured", "met": None}
    if k not in fams:
        return {**row, "measured": f"K={k} not run"}
    m = medians(fams[k]["runs"])
    c, mk = first_contender(m, op), m.get((op, "mergekit"))
    if not (c and mk):
        return {**row, "measured": "mergekit not run" if c else "first merge failed"}
    ratio = mk["wall_s"] / m[(op, c)]["wall_s"] if faster else m[(op, c)]["wall_s"] / mk["wall_s"]
    note = "" if c == FIRST else " (today's flow, with an analyze step)"
    return {**row, "measured": f"{ratio:.2f}x {'faster' if faster else 'the wall of mergekit'}{note}",
            "met": ratio >= limit if faster else ratio <= limit}


def analyze_row(f: dict) -> dict:
    m = medians(f["analyze"])
    an, cr = m[("-", "analyze")], m[("-", "cold-read")]
    ratio = cr["wall_s"] / an["wall_s"]
    return {"target": f"ANALYZE >= 0.8x the throughput of a cold sequential read, K={f['K']}",
            "measured": f"{ratio:.2f}x (cold read {cr['read_bytes'] / cr['wall_s'] / MB:.0f} MB/s over "
                        f"{cr['read_bytes'] / MB:.0f} MB, analyze {an['read_bytes'] / an['wall_s'] / MB:.0f} MB/s "
                        f"over {an['read_bytes'] / MB:.0f} MB)", "met": ratio >= 0.8}


def targets(results: dict) -> list[dict]:
    fams = {f["K"]: f for f in results["families"]}
    rows = [vs_mergekit_row(fams, op, k, 1.1, False)
            for op in ("linear", "task_arithmetic") if op in results["ops"] for k in results["ks"]]
    if "ties" in results["ops"]:
        rows.append(vs_mergekit_row(fams, "ties", 4, 5, True))
    rows += [analyze_row(f) for f in results["families"]]
    reg = {k: statistics.median(f["register_s"]) for k, f in fams.items()}
    rows.append({"target": "register <= 0.5 s wall per model, fresh process",
                 "measured": ", ".join(f"median {v:.2f} s (K={k})" for k, v in reg.items()),
                 "met": max(reg.values()) <= 0.5})
    cli = results.get("cli_startup", {})
    rows.append({"target": "CLI start-up < 0.5 s for commands with no tensor work",
                 "measured": ", ".join(f"`{c}` {v:.2f} s" for c, v in cli.items()) or "not measured",
                 "met": bool(cli) and max(cli.values()) < 0.5})
    return rows


def steps_text(recs: list[dict]) -> str:
    """Median wall of each step over the rounds, in order."""
    names = [s["step"] for s in recs[0]["steps"]]
    return " + ".join(f"{n} {statistics.median(s['wall_s'] for r in recs for s in r['steps'] if s['step'] == n):.2f}"
                      for n in names)


def family_table(f: dict) -> list[str]:
    m = medians(f["runs"])
    lines = [f"## K={f['K']}: base and the first {f['K']} experts of {f['family']} "
             f"({f['family_bytes'] / 1e9:.2f} GB)", "",
             "| op | contender | steps (median wall s) | wall s | disk read MB | peak RSS MB | vs mergekit |",
             "|---|---|---|---:|---:|---:|---:|"]
    order = ["mergekit", FIRST, LEGACY, *(SECOND + b for b in BUDGETS)]
    for op in f["ops"]:
        mk = m.get((op, "mergekit"))
        for c in order:
            recs = [r for r in f["runs"] if r["op"] == op and r["contender"] == c]
            if not recs:
                continue
            if (op, c) not in m:
                lines.append(f"| {op} | {c} | failed: `{recs[-1]['failed'].strip().splitlines()[-1][-140:]}` | | | | |")
                continue
            v = m[(op, c)]
            ok = [r for r in recs if "failed" not in r]
            vs = f"{mk['wall_s'] / v['wall_s']:.2f}x" if mk else "-"
            lines.append(f"| {op} | {c} | {steps_text(ok)} | {v['wall_s']:.2f} | {v['read_bytes'] / MB:.0f} | "
                         f"{v['peak_rss_bytes'] / MB:.0f} | {vs} |")
    return lines + [""] + checks_lines(f["checks"]) + side_lines(f)


def checks_lines(checks: dict) -> list[str]:
    def text(c):
        if not c.get("same_dtypes"):
            return "tensor names or dtypes differ"
        return f"{c['differing']} of {c['total']} values differ, max |diff| {c['max_abs']:.3g}"
    return ["Output checks (last round):", "", *(f"- {n}: {text(c)}" for n, c in checks.items()), ""] if checks else []


def side_lines(f: dict) -> list[str]:
    am, reg = medians(f["analyze"]), f["register_s"]
    return ["ANALYZE of the K experts, fresh catalog, cold: " + ", ".join(
        f"{c} {v['wall_s']:.2f} s ({v['read_bytes'] / MB:.0f} MB read)" for (_, c), v in am.items()) + ".", "",
        f"register, one fresh process per expert: median {statistics.median(reg):.2f} s "
        f"(min {min(reg):.2f}, max {max(reg):.2f}) over {len(reg)}.", ""]


def paths_note(results: dict) -> str:
    recs = [r for f in results["families"] for r in f["runs"] if r["contender"] in (FIRST, LEGACY)]
    reg = sorted({r["register_path"] for r in recs})
    new = [r for r in recs if r["contender"] == FIRST]
    failed = [r for r in new if "failed" in r]
    merge = ("merge over unanalyzed experts: "
             + (f"failed in {len(failed)} of {len(new)} runs (`{failed[0]['failed'].strip().splitlines()[-1][-160:]}`)"
                if failed else "ran (experts analyzed in flight)"))
    return (f"Paths that ran: experts registered by the {' and the '.join(reg) or '-'} form "
            "(batch: one `register --base base E1 ... EK` process; fallback: one `register --model-id` "
            f"process per expert, used only when the batch form exits non-zero); {merge}.")


def write_report(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = "first-merge" if results["profile"] == "full" else f"first-merge-{results['profile']}"
    rows = targets(results)
    js = out / f"{stem}.json"
    js.write_text(json.dumps({**results, "targets": rows}, indent=2, default=str))
    mach = results["machine"]
    cli = results.get("cli_startup", {})
    md = out / f"{stem}.md"
    md.write_text("\n".join([
        "# First merge: from no catalog to a merged model, side by side with mergekit", "",
        f"Run {results['started']} on {mach['cpus']} CPUs, {mach['memory_gib']} GiB RAM, torch {mach['torch']}, "
        f"Python {mach['python']}. Cold cache before every contender (every input file evicted; no eviction between "
        "the steps of one first merge, as for a user), each MergePipe "
        f"step its own process; medians of {results['runs']} run(s); density {results['density']} for ties. "
        "The first merge is the sum of its steps' walls; disk read is the children's rusage; vs mergekit is "
        "mergekit's wall / this wall (> 1: faster than mergekit).", "",
        f"Reproduce: `{results['command']}`", "", paths_note(results), "",
        "## Targets", "", "| target | measured | met |", "|---|---|---|",
        *(f"| {r['target']} | {r['measured']} | {'n/a' if r['met'] is None else 'yes' if r['met'] else 'no'} |"
          for r in rows), "",
        *(line for f in results["families"] for line in family_table(f)),
        f"## CLI start-up (median of {results['cli_reps']})", "", "| command | wall s |", "|---|---:|",
        *(f"| `{c}` | {v:.2f} |" for c, v in cli.items()), ""]))
    return [js, md]


# --- main ----------------------------------------------------------------------------------------------
def bench_k(args, prof, fam, k, work, mk_exe) -> dict:
    fam = first_k(fam, k)
    run.measure([run.PY, ROOT / "benchmarks" / "coldread.py", *inputs(fam)])  # the host-cache warm-up
    outdir = work / f"first-merge-K{k}"
    outdir.mkdir(exist_ok=True)
    rec = {"K": k, "family": fam["root"].name, "ops": prof["ops"], "runs": [], "checks": {},
           "family_bytes": sum(open_checkpoint(p).nbytes for p in inputs(fam))}
    for op in prof["ops"]:
        print(f"[first-merge] K={k} {op}", flush=True)
        recs, checks = bench_op(args, fam, op, outdir, mk_exe if k <= args.mergekit_max_k else None)
        rec["runs"] += recs
        rec["checks"].update(checks)
        for r in recs:  # outputs and catalogs are transient
            shutil.rmtree(r.get("out", outdir / "-"), ignore_errors=True)
    print(f"[first-merge] K={k} ANALYZE vs cold read, register, start-up", flush=True)
    rec["analyze"] = analyze_vs_coldread(fam, outdir, args.runs)
    rec["register_s"] = [t for _ in range(args.runs) for t in register_times(fam, outdir / "fm-register.sqlite")]
    return rec


def analyze_only(args, prof, fam, work: Path, results: dict) -> int:
    """ANALYZE against a plain cold read of the same files, alternating, --runs rounds per K."""
    rows, lines = [], []
    for k in prof["ks"]:
        f = first_k(fam, k)
        run.measure([run.PY, ROOT / "benchmarks" / "coldread.py", *inputs(f)])  # the host-cache warm-up
        outdir = work / f"first-merge-K{k}"
        outdir.mkdir(exist_ok=True)
        print(f"[analyze] K={k}", flush=True)
        rec = {"K": k, "analyze": analyze_vs_coldread(f, outdir, args.runs)}
        results["families"].append(rec)
        rows.append(analyze_row(rec))
        for r in rec["analyze"]:
            lines.append(f"| {k} | {r['rep']} | {r['contender']} | {r['wall_s']:.2f} | {r['read_bytes'] / MB:.0f} | "
                         f"{r['read_bytes'] / r['wall_s'] / MB:.0f} | {r['peak_rss_bytes'] / MB:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ANALYZE_STEM.get(args.profile, f"analyze-{args.profile}")
    (out / f"{stem}.json").write_text(json.dumps({**results, "targets": rows}, indent=2, default=str))
    mach = results["machine"]
    (out / f"{stem}.md").write_text("\n".join([
        "# ANALYZE against a plain cold sequential read", "",
        f"Run {results['started']} on {mach['cpus']} CPUs, {mach['memory_gib']} GiB RAM; the {prof['size']} "
        f"{prof['dtype']} family ({fam_bytes(fam) / 1e6:.0f} MB a model). `mergepipe analyze` (a fresh process, "
        "start-up included) on a fresh catalog holding the base and K experts vs benchmarks/coldread.py over the "
        f"same files, alternating, every input evicted before each; {args.runs} round(s), medians in the targets.", "",
        f"Reproduce: `{results['command']}`", "",
        "| target | measured | met |", "|---|---|---|",
        *(f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else 'no'} |" for r in rows), "",
        "| K | round | contender | wall s | read MB | MB/s | peak RSS MB |", "|---:|---:|---|---:|---:|---:|---:|",
        *lines, ""]))
    print(f"wrote {out / f'{stem}.md'}")
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="full")
    ap.add_argument("--ks", type=int, nargs="+", help="expert counts (default: the profile's)")
    ap.add_argument("--ops", nargs="+", help="operators (default: the profile's)")
    ap.add_argument("--runs", type=int, default=1, help="rounds of every measurement; medians are reported")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"), help="families, catalogs, outputs")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="where the report goes")
    ap.add_argument("--with-analyze-step", action="store_true",
                    help="also today's first merge: register, `mergepipe analyze`, merge")
    ap.add_argument("--analyze-only", action="store_true",
                    help="only ANALYZE against a cold read, per K, --runs rounds; writes analyze.{md,json}")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--mergekit-venv", help="venv holding mergekit (default: WORK/mergekit-venv)")
    ap.add_argument("--mergekit-max-k", type=int, default=4, help="largest K mergekit runs at (its RSS grows with K)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    prof = {**PROFILES[args.profile], **{k: v for k, v in (("ks", args.ks), ("ops", args.ops)) if v}}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    mk_exe = None
    if prof["mergekit"] and not args.no_mergekit and not args.analyze_only:
        mk_exe = run.ensure_mergekit(Path(args.mergekit_venv or work / "mergekit-venv"))
    fam = find_family(work, prof["size"], prof["dtype"], max(prof["ks"]))
    results = {"profile": args.profile, "machine": run.machine_info(), "density": run.DENSITY, "runs": args.runs,
               "ks": prof["ks"], "ops": prof["ops"], "cli_reps": prof["cli_reps"],
               "with_analyze_step": args.with_analyze_step, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": shlex.join(["python", "benchmarks/first_merge.py", *argv]), "families": []}
    if args.analyze_only:
        return analyze_only(args, prof, fam, work, results)
    for k in prof["ks"]:
        results["families"].append(bench_k(args, prof, fam, k, work, mk_exe))
        if k == prof["ks"][0]:
            reg_db = work / f"first-merge-K{k}" / "fm-register.sqlite"
            results["cli_startup"] = cli_startup(work, reg_db, prof["cli_reps"])
        paths = write_report(results, Path(args.out))  # after every K: a later failure loses nothing
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
