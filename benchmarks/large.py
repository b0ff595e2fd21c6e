"""Model size: a Llama-3.2-3B-shaped bf16 family (a base and 4 experts, 6.4 GB each), MergePipe against
mergekit 0.1.5 side by side in one run, cold cache, every contender its own process.

    python benchmarks/run.py --profile 3b                   # the same as: python benchmarks/large.py
    python benchmarks/large.py --size medium --ops linear   # the same steps on a 40M family (a minute)

For each operator (linear, ties, dare_ties; density 0.2):
- mergekit: `mergekit-yaml CONFIG OUT --lazy-unpickle --copy-tokenizer` (its default shard size), float32
  arithmetic, bfloat16 out, under a memory watchdog: it is stopped when the machine's available memory falls
  under 1.5 GiB (the machine has no swap; the kernel's OOM killer would pick any process);
- MergePipe's first merge from no catalog: init-db, register the base, register the K experts, merge
  (experts not analyzed are analyzed on the way, at full read);
- MergePipe's second merges at 10 %, 25 % and 100 % on that catalog;
- the I/O floor of each budget (benchmarks/floor.py: read exactly the plan's bytes, write the output size);
- output checks: first merge against the second at 100 % (0 differing values expected), MergePipe 100 %
  against mergekit (linear and ties; DARE draws other random masks in mergekit).
Wall, disk bytes (the child's rusage) and peak RSS come from benchmarks/child.py. The family is generated
under --work (about 32 GB for 3b) and deleted after the run unless --keep-family. Writes
scale-<size>.{md,json} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import run  # noqa: E402
from benchmarks.first_merge import DENSITY_OPS, first_merge, merge_cmd, step  # noqa: E402

ROOT = run.ROOT
PROFILE = dict(size="llama-3.2-3b", dtype="bf16", k=4, ops=["linear", "ties", "dare_ties"],
               budgets=["10%", "25%", "100%"])
SHARD_BYTES = 5 * 10**9  # the Hub's and mergekit's default shard size
MIN_AVAILABLE = int(1.5 * 2**30)
MB = 1e6


# --- the family -------------------------------------------------------------------------------------
def ensure_family(work: Path, size: str, dtype: str, k: int) -> dict:
    fam = work / f"{size}-{dtype}-K{k}"
    if not (fam / f"expert_{k}" / "config.json").exists():
        shutil.rmtree(fam, ignore_errors=True)
        from mergepipe.research.family import make_family
        print(f"[scale] writing {fam} ...", flush=True)
        t0 = time.perf_counter()
        make_family(fam, experts=k, size=size, dtype=dtype, shard_bytes=SHARD_BYTES, seed=0,
                    progress=lambda e, n: print(f"[scale] expert {e}/{n} written", flush=True))
        print(f"[scale] family written in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"root": fam, "base": fam / "base", "experts": [fam / f"expert_{i}" for i in range(1, k + 1)]}


def inputs(fam: dict) -> list[Path]:
    return [fam["base"], *fam["experts"]]


# --- a contender under a memory watchdog ---------------------------------------------------------------
def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_rss(pid: int) -> int:
    import psutil
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def guarded(cmd: list, label: str) -> dict:
    """run.measure, but the process group is stopped when the machine's available memory falls under
    MIN_AVAILABLE; the record then says so, with the wall and the largest RSS of its processes until then,
    and the run goes on."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([run.PY, str(ROOT / "benchmarks" / "child.py"), *map(str, cmd)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    least, peak = available_memory(), 0
    while proc.poll() is None:
        least, peak = min(least, available_memory()), max(peak, tree_rss(proc.pid))
        if least < MIN_AVAILABLE:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            wall = time.perf_counter() - t0
            print(f"[scale] {label} stopped after {wall:.0f} s at {peak / 1e9:.1f} GB RSS", flush=True)
            return {"failed": f"stopped after {wall:.0f} s at {peak / 1e9:.1f} GB RSS: the machine's available "
                              f"memory fell to {least / 2**30:.2f} GiB (24 GiB, no swap)",
                    "stopped_after_s": wall, "rss_when_stopped_bytes": peak}
        time.sleep(0.25)
    err = proc.stderr.read().decode().strip().splitlines()
    usage = json.loads(err[-1])
    if usage.pop("rc") != 0:
        print(f"[scale] {label} failed: {err[-2][-200:] if len(err) > 1 else ''}", flush=True)
        return {"failed": "\n".join(err[-6:-1])[-500:]}
    return usage


def mergekit(exe: Path, fam: dict, op: str, outdir: Path) -> dict:
    cfg = outdir / f"mergekit-{op}.yml"
    cfg.write_text(run.mergekit_yaml(op, fam["base"], fam["experts"], run.DENSITY))
    out = outdir / f"mergekit-{op}"
    shutil.rmtree(out, ignore_errors=True)
    run.cold(inputs(fam))
    r = guarded([exe, cfg, out, "--lazy-unpickle", "--copy-tokenizer"], f"mergekit {op}")
    return {"contender": "mergekit", "op": op, **r, "out": str(out)}


# --- MergePipe ----------------------------------------------------------------------------------------
def second_merges(fam: dict, op: str, db: Path, outdir: Path, budgets: list[str]) -> list[dict]:
    recs = []
    for b in budgets:
        out = outdir / f"second-{op}-{b.rstrip('%')}"
        shutil.rmtree(out, ignore_errors=True)
        run.cold(inputs(fam))
        r = step("merge", merge_cmd(db, fam, op, out, b), must=False)
        recs.append({"contender": f"mergepipe {b}", "op": op, "budget": b, **r, "out": str(out)})
        if b != "100%":
            shutil.rmtree(out, ignore_errors=True)
    return recs


def floors(fam: dict, op: str, db: Path, work: Path, budgets: list[str]) -> list[dict]:
    """The I/O floor of ``op``'s plan at each budget, on the catalog its first merge analyzed (a budget
    fixes the bytes read whatever the operator's arithmetic)."""
    from mergepipe.catalog.db import Catalog
    from mergepipe.planner.context import Planner
    cat = Catalog(db)
    recs = []
    for b in budgets:
        density = run.DENSITY if op in DENSITY_OPS else None
        plan = Planner(cat).plan("base", [p.name for p in fam["experts"]], op, budget=b, density=density, save=False)
        pj, fl = work / "floor-plan.json", work / "floor.bin"
        pj.write_text(plan.to_json())
        fl.unlink(missing_ok=True)
        run.cold(inputs(fam))
        r = step("floor", [run.PY, ROOT / "benchmarks" / "floor.py", pj, fl])
        fl.unlink(missing_ok=True)
        recs.append({"contender": f"floor {b}", "op": "-", "budget": b, **r})
    cat.close()
    return recs


def bench_op(fam: dict, op: str, outdir: Path, mk_exe: Path | None, budgets: list[str]) -> tuple[list, dict]:
    """MergePipe first, then mergekit: at most two outputs (6.4 GB each at 3B) are on disk at once."""
    first = {**first_merge(fam, op, outdir / f"first-{op}.sqlite", outdir / f"first-{op}", False), "rep": 0}
    recs = [first] + (second_merges(fam, op, Path(first["db"]), outdir, budgets) if "failed" not in first else [])
    full = next((Path(r["out"]) for r in recs if r["contender"] == "mergepipe 100%" and "failed" not in r), None)
    checks = {}
    if full and "failed" not in first:
        checks[f"{op}: first merge vs mergepipe 100%"] = run.compare_outputs(Path(first["out"]), full)
    shutil.rmtree(first["out"], ignore_errors=True)
    if mk_exe:
        recs.insert(0, mergekit(mk_exe, fam, op, outdir))
        if full and "failed" not in recs[0] and op != "dare_ties":
            checks[f"{op}: mergepipe 100% vs mergekit"] = run.compare_outputs(full, Path(recs[0]["out"]))
        shutil.rmtree(recs[0]["out"], ignore_errors=True)
    if full:
        shutil.rmtree(full, ignore_errors=True)
    return recs, checks


# --- the run --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=PROFILE["size"])
    ap.add_argument("--k", type=int, default=PROFILE["k"])
    ap.add_argument("--ops", nargs="+", default=PROFILE["ops"])
    ap.add_argument("--budgets", nargs="+", default=PROFILE["budgets"])
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--mergekit-venv", default=None, help="venv holding mergekit (default: this interpreter's)")
    ap.add_argument("--keep-family", action="store_true", help="keep the generated family (default: delete it)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    outdir = work / f"scale-{args.size}"
    outdir.mkdir(parents=True, exist_ok=True)
    mk_exe = None if args.no_mergekit else mergekit_exe(args.mergekit_venv, work)
    fam = ensure_family(work, args.size, PROFILE["dtype"], args.k)
    from mergepipe.storage.safetensors import open_checkpoint
    res = {"profile": "3b" if args.size == PROFILE["size"] else args.size, "size": args.size, "k": args.k,
           "machine": run.machine_info(), "density": run.DENSITY, "budgets": args.budgets, "ops": args.ops,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(),
           "model_bytes": open_checkpoint(fam["base"]).nbytes,
           "family_bytes": sum(open_checkpoint(p).nbytes for p in inputs(fam)), "runs": [], "checks": {}}
    try:
        run.cold(inputs(fam))
        res["runs"].append({"contender": "cold read", "op": "-",
                            **step("coldread", [run.PY, ROOT / "benchmarks" / "coldread.py", *inputs(fam)])})
        for op in args.ops:
            print(f"[scale] {args.size}: {op}", flush=True)
            recs, checks = bench_op(fam, op, outdir, mk_exe, args.budgets)
            res["runs"] += recs
            res["checks"].update(checks)
            if op == args.ops[0]:
                res["runs"] += floors(fam, op, outdir / f"first-{op}.sqlite", work, args.budgets)
            write(res, Path(args.out))
    finally:
        if not args.keep_family:
            shutil.rmtree(fam["root"], ignore_errors=True)
        shutil.rmtree(outdir, ignore_errors=True)
    for p in write(res, Path(args.out)):
        print(f"wrote {p}")
    return 0


def commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def mergekit_exe(venv: str | None, work: Path) -> Path:
    here = Path(sys.executable).parent / "mergekit-yaml"
    if venv is None and here.exists():
        return here
    return run.ensure_mergekit(Path(venv) if venv else work / "mergekit-venv")


def write(res: dict, out: Path) -> list[Path]:
    from benchmarks.scale_report import size_figure, write_scale_report
    return write_scale_report(res, out) + size_figure(out)


if __name__ == "__main__":
    raise SystemExit(main())
