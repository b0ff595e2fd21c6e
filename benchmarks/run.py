"""MergePipe benchmark runner: MergePipe at several budgets vs the naive full-read baseline vs mergekit
vs the I/O floor, side by side, cold cache, each contender its own process.

    python benchmarks/run.py --profile quick            # medium bf16 family, K=4 (a few minutes)
    python benchmarks/run.py --profile full             # qwen3-0.6b-shaped bf16, K = 2, 4, 8, 16
    python benchmarks/run.py --profile ci --no-mergekit # tiny sanity run used by the test suite
    python benchmarks/run.py --profile k64              # 40M bf16 family, K = 2, 16, 32, 64 (benchmarks/scale_k.py)
    python benchmarks/run.py --profile 3b               # Llama-3.2-3B-shaped bf16, K=4 (benchmarks/large.py)

Before every run each input and output file is evicted from the page cache (posix_fadvise DONTNEED).
Wall time, bytes read/written (getrusage of the child: ru_inblock/ru_oublock x 512) and peak RSS are
taken from os.wait4 of the child. Results go to docs/benchmarks/ as JSON, a markdown table and Plotly
HTML charts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mergepipe.analyze.runner import analyze  # noqa: E402
from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.research.family import make_family  # noqa: E402
from mergepipe.planner.context import Planner  # noqa: E402
from mergepipe.catalog.models import register  # noqa: E402
from mergepipe.storage.local import evict  # noqa: E402
from mergepipe.storage.safetensors import open_checkpoint

PROFILES = {
    "ci": dict(size="small", dtype="bf16", ks=[4], ops=["linear", "ties"], budgets=["10%", "100%"], block=256 << 10),
    "quick": dict(size="medium", dtype="bf16", ks=[4], ops=["linear", "task_arithmetic", "ties", "dare_ties"],
                  budgets=["10%", "25%", "50%", "100%"], block=1 << 20),
    # mergekit's peak RSS grows with K (13.5 GB at K=4 for ties on this shape) and the naive whole-tensor
    # baseline was killed for memory at K=8 (24 GiB machine): both run up to K=4 here.
    "full": dict(size="qwen3-0.6b", dtype="bf16", ks=[2, 4, 8, 16], ops=["ties", "linear"],
                 budgets=["10%", "25%", "100%"], block=1 << 20, mergekit_max_k=4, naive_max_k=4,
                 analyze_runs=1, analyze_k=4),
}
# profiles run by a module of their own (its flags follow the profile's name)
DELEGATED = {"k64": "scale_k", "3b": "large"}
DENSITY = 0.2
PY = sys.executable


def measure(cmd: list[str], env=None) -> dict:
    """Run ``cmd`` under benchmarks/child.py: wall time, its own disk bytes and peak RSS (rusage)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "child.py"), *map(str, cmd)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    lines = proc.stderr.decode().strip().splitlines()
    usage = json.loads(lines[-1])
    if usage.pop("rc") != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n" + "\n".join(lines[-30:-1])
                           + proc.stdout.decode()[-2000:])
    return {**usage, "stdout": proc.stdout.decode()[-2000:]}


def compare_outputs(a: Path, b: Path) -> dict:
    """Tensor-by-tensor comparison, in a child process so the runner stays small."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), str(a), str(b)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def resident_bytes(paths) -> int:
    """Bytes of these files now in the page cache (util-linux fincore). Right after a run on evicted
    inputs this is what the run read from them, free of the noise in the process-wide counters
    (library pages that memory pressure evicted, the catalog, ...)."""
    files = [str(f) for p in paths for f in (Path(p).rglob("*") if Path(p).is_dir() else [Path(p)]) if Path(f).is_file()]
    out = subprocess.run(["fincore", "--bytes", "--raw", "--noheadings", "--output", "RES", *files],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def cold(paths) -> None:
    os.sync()
    evict([p for p in paths if Path(p).exists()])


def ensure_family(work: Path, size: str, dtype: str, k: int) -> dict:
    fam = work / f"{size}-{dtype}-K{k}"
    marker = fam / f"expert_{k}" / "config.json"
    if not marker.exists():
        shutil.rmtree(fam, ignore_errors=True)
        print(f"[family] writing {fam} ...", flush=True)
        make_family(fam, experts=k, size=size, dtype=dtype, shard_bytes=1 << 30, seed=0)
    return {"root": fam, "base": fam / "base", "experts": [fam / f"expert_{i}" for i in range(1, k + 1)]}


def ensure_mergekit(venv: Path) -> Path:
    exe = venv / "bin" / "mergekit-yaml"
    if not exe.exists():
        print(f"[mergekit] installing into its own venv {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = str(venv / "bin" / "pip")
        subprocess.run([pip, "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([pip, "install", "-q", "mergekit"], check=True)
    return exe


def mergekit_yaml(op: str, base: Path, experts: list[Path], density: float) -> str:
    lines = [f"merge_method: {op}"]
    if op != "linear":
        lines.append(f"base_model: {base}")
    lines.append("models:")
    for e in experts:
        params = "{weight: 1.0" + (f", density: {density}" if op in ("ties", "dare_ties") else "") + "}"
        lines += [f"  - model: {e}", f"    parameters: {params}"]
    lines += ["dtype: float32", "out_dtype: bfloat16"]
    return "\n".join(lines) + "\n"


def analyze_family(args, prof, fam, work, analyze_runs: int) -> tuple[Path, dict]:
    """Register the whole family in one catalog and analyze it (reused when already analyzed on this
    grid); time ANALYZE of the first ``analyze_k`` experts, in a catalog of their own, against a plain
    cold read of the same files."""
    db = work / f"{fam['root'].name}.sqlite"
    ids = [f"e{i}" for i in range(1, len(fam["experts"]) + 1)]
    cat = _family_catalog(db, fam, ids)
    if cat.grid_block_bytes("base") != prof["block"] or _stale(cat, ids):
        print(f"[bench] analyzing {len(ids)} experts into {db} ...", flush=True)
        analyze(cat, ids, block_bytes=prof["block"], force=True)
    cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    family_bytes = sum(open_checkpoint(p).nbytes for p in [fam["base"], *fam["experts"]])
    rec = {"experts": len(ids), "family_bytes": family_bytes, "catalog_bytes": db.stat().st_size, "runs": []}
    cat.close()
    k = min(len(ids), prof.get("analyze_k", len(ids)))
    timing_db = work / f"{fam['root'].name}-analyze-timing.sqlite"
    for s in ("", "-wal", "-shm"):
        Path(str(timing_db) + s).unlink(missing_ok=True)
    _family_catalog(timing_db, fam, ids[:k]).close()
    inputs = [fam["base"], *fam["experts"][:k]]
    rec["timed_experts"] = k
    for rep in range(analyze_runs):
        cold(inputs)
        r = measure([PY, str(ROOT / "benchmarks" / "coldread.py"), *map(str, inputs)])
        rec["runs"].append({"contender": "cold-read", "op": "-", "rep": rep, **r})
        cold(inputs)
        r = measure([PY, "-m", "mergepipe.cli", "--db", str(timing_db), "analyze", "--force",
                     "--block-bytes", str(prof["block"]), "--model-id", *ids[:k]])
        rec["runs"].append({"contender": "analyze", "op": "-", "rep": rep, **r})
    return db, rec


def _stale(cat: Catalog, ids: list[str]) -> bool:
    """Statistics to (re)gather: an expert not analyzed, or analyzed by an older MergePipe without what a
    benchmark plan needs (e.g. the exact top-k at DENSITY): such a plan would be a first merge."""
    if not all(cat.is_analyzed(e) for e in ids):
        return True
    plan = Planner(cat).plan("base", ids, "ties", density=DENSITY, save=False)
    return any(e.get("analyze") for e in plan["experts"])


def _family_catalog(db: Path, fam: dict, ids: list[str]) -> Catalog:
    cat = Catalog(db)
    register(cat, "base", str(fam["base"]))
    for eid, path in zip(ids, fam["experts"]):
        register(cat, eid, str(path), base_id="base")
    return cat


def attempt(cmd, label: str) -> dict:
    """measure(), but a contender that fails (e.g. killed for memory) is recorded, not fatal."""
    try:
        return measure(cmd)
    except RuntimeError as exc:
        print(f"[bench] {label} failed: {str(exc).splitlines()[0][-200:]}", flush=True)
        return {"failed": str(exc)[-500:]}


def bench_family(args, prof, k, fam, work, results, mk_exe, db):
    cat = Catalog(db)
    ids = [f"e{i}" for i in range(1, k + 1)]
    inputs = [fam["base"], *fam["experts"][:k]]
    family_bytes = sum(open_checkpoint(p).nbytes for p in inputs)
    rec = {"K": k, "family": fam["root"].name, "family_bytes": family_bytes, "runs": []}
    outdir = work / "out"
    outdir.mkdir(exist_ok=True)
    for op in prof["ops"]:
        plans = {}
        for b in prof["budgets"]:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                plan = Planner(cat).plan("base", ids, op, budget=b, density=DENSITY if op in ("ties", "dare_ties") else None)
                times.append(time.perf_counter() - t0)
            plans[b] = plan
            rec.setdefault("planning_s", {})[f"{op}@{b}"] = statistics.median(times)
            pj = work / f"{plan.id}.json"
            pj.write_text(plan.to_json())
        for rep in range(args.repeats):
            for b, plan in plans.items():
                out = outdir / f"mp-{op}-{b.rstrip('%')}"
                shutil.rmtree(out, ignore_errors=True)
                cat.conn.execute("DELETE FROM models WHERE id = ?", [out.name])  # benchmark outputs are transient
                cold(inputs)
                r = measure([PY, "-m", "mergepipe.cli", "--db", str(db), "execute", plan.id, "--out", str(out),
                             "--model-id", f"{out.name}-{rep}-{time.time_ns()}"])
                r["input_bytes_read"] = resident_bytes(inputs)
                rec["runs"].append({"contender": f"mergepipe {b}", "op": op, "rep": rep, "budget": b,
                                    "planned_expert_bytes": plan["estimate"]["expert_read"],
                                    "full_expert_bytes": plan["full_expert_bytes"],
                                    "base_bytes": plan["estimate"]["base_read"], **r})
                fl = work / "floor.bin"
                fl.unlink(missing_ok=True)
                cold(inputs)
                r = measure([PY, str(ROOT / "benchmarks" / "floor.py"), str(work / f"{plan.id}.json"), str(fl)])
                rec["runs"].append({"contender": f"floor {b}", "op": op, "rep": rep, "budget": b, **r})
                fl.unlink(missing_ok=True)
            out = outdir / f"naive-{op}"
            shutil.rmtree(out, ignore_errors=True)
            if k <= prof.get("naive_max_k", 10**6):
                cold(inputs)
                r = attempt([PY, "-m", "mergepipe.research.baselines", str(fam["base"]), str(out), "--experts",
                             *map(str, fam["experts"][:k]), "--op", op,
                             "--density", str(DENSITY if op in ("ties", "dare_ties") else 1.0),
                             "--block-bytes", str(prof["block"]), "--expert-ids", *ids], f"naive {op} K={k}")
                rec["runs"].append({"contender": "naive", "op": op, "rep": rep, **r})
            if mk_exe and k <= args.mergekit_max_k:
                cfg = work / f"mk-{op}.yml"
                cfg.write_text(mergekit_yaml(op, fam["base"], fam["experts"][:k], DENSITY))
                mko = outdir / f"mergekit-{op}"
                shutil.rmtree(mko, ignore_errors=True)
                cold(inputs)
                r = attempt([str(mk_exe), str(cfg), str(mko), "--copy-tokenizer"], f"mergekit {op} K={k}")
                rec["runs"].append({"contender": "mergekit", "op": op, "rep": rep, **r})
        # fidelity: MergePipe at 100% vs the naive baseline (exact) and vs mergekit
        full = outdir / f"mp-{op}-100"
        if full.exists() and (outdir / f"naive-{op}").exists():
            rec.setdefault("checks", {})[f"{op}: mergepipe-100% vs naive"] = compare_outputs(full, outdir / f"naive-{op}")
        if full.exists() and (outdir / f"mergekit-{op}").exists():
            if op != "dare_ties":  # DARE draws different random masks in mergekit
                rec["checks"][f"{op}: mergepipe-100% vs mergekit"] = compare_outputs(full, outdir / f"mergekit-{op}")
    results["families"].append(rec)
    shutil.rmtree(outdir, ignore_errors=True)


def delegated(argv: list[str]) -> int | None:
    """``--profile k64`` and ``--profile 3b`` hand the rest of the command line to their own module."""
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[1] if arg.startswith("--profile=") else \
            argv[i + 1] if arg == "--profile" and i + 1 < len(argv) else None
        if name in DELEGATED:
            import importlib
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            return importlib.import_module(f"benchmarks.{DELEGATED[name]}").main(rest)
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = delegated(argv)
    if code is not None:
        return code
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted([*PROFILES, *DELEGATED]), default="quick")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", type=int, nargs="*", help="override the profile's expert counts")
    ap.add_argument("--ops", nargs="*", help="override the profile's operators")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--mergekit-venv", default=None, help="venv holding mergekit (default: WORK/mergekit-venv)")
    ap.add_argument("--mergekit-max-k", type=int, default=None,
                    help="largest K mergekit is run at (its RSS grows with K; default: the profile's)")
    ap.add_argument("--budgets", nargs="*", help="override the profile's budgets")
    args = ap.parse_args(argv)
    prof = dict(PROFILES[args.profile])
    if args.ks:
        prof["ks"] = args.ks
    if args.ops:
        prof["ops"] = args.ops
    if args.budgets:
        prof["budgets"] = args.budgets
    if args.mergekit_max_k is None:
        args.mergekit_max_k = prof.get("mergekit_max_k", 10**6)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    mk_exe = None if args.no_mergekit else ensure_mergekit(Path(args.mergekit_venv or work / "mergekit-venv"))
    results = {"profile": args.profile, "machine": machine_info(), "density": DENSITY, "block_bytes": prof["block"],
               "repeats": args.repeats, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "families": []}
    fam = ensure_family(work, prof["size"], prof["dtype"], max(prof["ks"]))
    print(f"[bench] {args.profile}: analyze {len(fam['experts'])} experts", flush=True)
    db, results["analyze"] = analyze_family(args, prof, fam, work, prof.get("analyze_runs", args.repeats))
    from report import write_report
    for k in prof["ks"]:
        print(f"[bench] {args.profile}: K={k}", flush=True)
        bench_family(args, prof, k, fam, work, results, mk_exe, db)
        write_report(results, Path(args.out))  # after every K: a later failure loses nothing
    paths = write_report(results, Path(args.out))
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


def machine_info() -> dict:
    import platform
    import torch
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
