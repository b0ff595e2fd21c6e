"""The Ray executor (issue 20): its overhead against the local executor on this machine, and a simulated
multi-node run, side by side in one run.

    python benchmarks/ray_executor.py                       # Qwen3-0.6B-shaped bf16 family, K=8, linear 25 %
    python benchmarks/ray_executor.py --k 4 --budget 10%    # smaller
    python benchmarks/ray_executor.py --profile ci          # tiny family, seconds (used by nothing timed)

1. Overhead: the same plan merged by the local executor (threads in this process) and by the Ray executor
   (range tasks on a local Ray cluster of 2 CPUs, started before and timed apart), each from a cold page
   cache (inputs evicted with posix_fadvise DONTNEED). Outputs must be byte-identical (sha256 of every file).
2. Simulated nodes: every process that reads gets its own token-bucket reader limited to --node-mbps
   (installed in Ray workers by a worker_process_setup_hook): a "node" is a process with its own disk.
   The local executor with the same limit is one node; Ray with N one-CPU workers is N nodes. The inputs
   are warm in the page cache, so the simulated per-node bandwidth (not this machine's one virtual disk)
   is what limits, as it would with N real disks. On 2 cores, compute does not scale past 2 workers: the
   merge operator is linear, whose compute is far cheaper than the simulated reads.

Writes ray.{md,json} to --out (docs/benchmarks by default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sqlite3
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.engine.engine import Engine  # noqa: E402
from mergepipe.planner.context import Planner  # noqa: E402
from mergepipe.planner.request import MergeRequest  # noqa: E402
from mergepipe.storage.local import evict  # noqa: E402

BW_ENV = "MERGEPIPE_BENCH_NODE_BPS"
WORK = Path("/work/main/benchmarks/work")
PROFILES = {
    "full": dict(family=WORK / "qwen3-0.6b-bf16-K16", catalog=WORK / "first-merge-K16" / "fm-analyze-K16.sqlite",
                 k=8, budget="25%", op="linear", node_mbps=100.0, nodes=[1, 2, 4]),
    "ci": dict(family=None, catalog=None, k=2, budget="50%", op="linear", node_mbps=2.0, nodes=[1, 2]),
}


# --- the simulated per-node disk --------------------------------------------------------------------
class _Bucket:
    """Reads of this process at most ``rate`` bytes/s on average (sleeps after each read as needed)."""

    def __init__(self, rate: float):
        self.rate, self.lock, self.t0, self.total = rate, threading.Lock(), None, 0

    def take(self, nbytes: int) -> None:
        with self.lock:
            now = time.perf_counter()
            if self.t0 is None or now - (self.t0 + self.total / self.rate) > 0.5:  # idle: restart the clock
                self.t0, self.total = now, 0
            self.total += nbytes
            due = self.t0 + self.total / self.rate
        if due > now:
            time.sleep(due - now)


def install_throttle(rate: float) -> None:
    """Limit this process's checkpoint reads (mergepipe.storage.local.RangeReader) to ``rate`` bytes/s."""
    from mergepipe.storage import local
    bucket, state = _Bucket(rate), threading.local()
    for name in ("read", "read_into", "read_ranges"):
        original = getattr(local.RangeReader, name)

        def wrapped(self, *a, _original=original, **kw):
            outer = not getattr(state, "inside", False)
            before = self.bytes_read
            state.inside = True
            try:
                return _original(self, *a, **kw)
            finally:
                if outer:
                    state.inside = False
                    bucket.take(self.bytes_read - before)
        setattr(local.RangeReader, name, wrapped)


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: every worker process is a node with its own limited disk."""
    rate = os.environ.get(BW_ENV)
    if rate:
        install_throttle(float(rate))


# --- runs -------------------------------------------------------------------------------------------
def dir_hashes(path: Path) -> dict[str, str]:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != "mergepipe_manifest.json":  # its run section (ids, timings) differs
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
            out[p.relative_to(path).as_posix()] = h.hexdigest()
    return out


def start_ray(num_cpus: int, node_bps: float | None = None) -> float:
    import ray
    from mergepipe.engine.ray_executor import runtime_env
    env = runtime_env()
    env["env_vars"]["PYTHONPATH"] = os.pathsep.join([str(ROOT), env["env_vars"]["PYTHONPATH"]])
    if node_bps:
        env["env_vars"][BW_ENV] = str(node_bps)
        env["worker_process_setup_hook"] = "benchmarks.ray_executor.setup_worker"
    t0 = time.perf_counter()
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=False)
    return time.perf_counter() - t0


def merge_once(cat: Catalog, plan, out: Path, executor=None, tasks: int | None = None) -> dict:
    engine = Engine(cat, executor=executor) if executor is not None else Engine(cat)
    t0 = time.perf_counter()
    _, manifest = engine.execute(plan, out=out)
    wall = time.perf_counter() - t0
    realized = manifest.core["realized"]
    return {"wall_s": round(wall, 3), "expert_read": realized["expert_read"], "base_read": realized["base_read"],
            "tasks": manifest.run.get("range_tasks"), "snapshot": manifest.snapshot_id,
            "manifest_hash": manifest.manifest_hash}


def drop_output(cat: Catalog, out: Path, snapshot_id: str) -> None:
    from mergepipe.engine.delete import delete_snapshot
    delete_snapshot(cat, snapshot_id, force=True)
    shutil.rmtree(out, ignore_errors=True)


def inputs(plan) -> list[Path]:
    files = []
    for m in [plan["base"], *plan["experts"]]:
        files += [p for p in Path(m["uri"]).iterdir() if p.suffix == ".safetensors"]
    return files


def prepare(args, work: Path):
    """A private catalog copy and the plan (base + the first K experts)."""
    if args.profile == "ci":
        from mergepipe.analyze.runner import analyze
        from mergepipe.catalog.models import register
        from mergepipe.research.family import make_family
        fam = make_family(work / "fam", experts=args.k, size="small", dtype="bf16", shard_bytes=4 << 20)
        cat = Catalog(work / "bench.sqlite")
        register(cat, "base", fam["base"])
        for i, e in enumerate(fam["experts"], 1):
            register(cat, f"expert_{i}", e, base_id="base")
        analyze(cat, block_bytes=256 << 10)
    else:
        src, dst = sqlite3.connect(str(args.catalog)), sqlite3.connect(str(work / "bench.sqlite"))
        src.backup(dst)
        src.close()
        dst.close()
        cat = Catalog(work / "bench.sqlite")
    experts = [f"expert_{i}" for i in range(1, args.k + 1)]
    plan = Planner(cat).plan(MergeRequest.build("base", experts, args.op, budget=args.budget), save=False)
    return cat, plan


def run(args) -> dict:
    import ray
    from mergepipe.engine.ray_executor import RayExecutor
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cat, plan = prepare(args, work)
    files = inputs(plan)
    res = {"k": args.k, "op": args.op, "budget": args.budget, "plan_expert_read": plan["estimate"]["expert_read"],
           "input_files_bytes": sum(f.stat().st_size for f in files), "cpus": os.cpu_count(), "overhead": [],
           "nodes": []}
    print(f"[plan] K={args.k} {args.op} {args.budget}: expert read {plan['estimate']['expert_read'] / 1e9:.2f} GB",
          flush=True)
    res["ray_start_s"] = round(start_ray(2), 3)
    res["ray_warm_s"] = round(RayExecutor().warm_up(), 3)
    try:
        hashes = {}
        for rep in range(args.runs):
            for name in ("local", "ray"):
                os.sync()
                evict(files)
                out = work / f"{name}-{rep}"
                r = merge_once(cat, plan, out, RayExecutor() if name == "ray" else None)
                hashes[name] = {**dir_hashes(out), "manifest core": r.pop("manifest_hash")}
                drop_output(cat, out, r.pop("snapshot"))
                res["overhead"].append({"executor": name, "run": rep, **r})
                print(f"[overhead] {name} run {rep}: {r}", flush=True)
        res["identical"] = hashes["local"] == hashes["ray"]
        res["differing_files"] = sorted(k for k in hashes["local"] if hashes["local"][k] != hashes["ray"].get(k))
    finally:
        ray.shutdown()
    rate = args.node_mbps * 1e6
    res["node_bps"] = rate
    install_throttle(rate)  # this process: the local executor is one node with the same disk
    out = work / "nodes-local"
    r = merge_once(cat, plan, out)
    drop_output(cat, out, r.pop("snapshot"))
    r.pop("manifest_hash")
    res["nodes"].append({"executor": "local", "nodes": 1, **r})
    print(f"[nodes] local 1 node: {r}", flush=True)
    for n in args.nodes:
        start_ray(n, rate)
        try:
            out = work / f"nodes-{n}"
            executor = RayExecutor(tasks=4 * n)
            warm = executor.warm_up()
            r = merge_once(cat, plan, out, executor)
            drop_output(cat, out, r.pop("snapshot"))
            r.pop("manifest_hash")
        finally:
            ray.shutdown()
        res["nodes"].append({"executor": "ray", "nodes": n, "warm_up_s": round(warm, 3), **r})
        print(f"[nodes] ray {n} node(s): {r}", flush=True)
    cat.close()
    shutil.rmtree(work, ignore_errors=True)
    return res


def report(res: dict) -> str:
    med = {}
    for name in ("local", "ray"):
        walls = sorted(r["wall_s"] for r in res["overhead"] if r["executor"] == name)
        med[name] = walls[len(walls) // 2]
    lines = [f"K={res['k']}, {res['op']} at {res['budget']}: plan reads {res['plan_expert_read'] / 1e9:.2f} GB of "
             f"experts; {res['cpus']} CPUs. Ray cluster start {res['ray_start_s']:.1f} s and worker warm-up "
             f"{res['ray_warm_s']:.1f} s (once per cluster, not in the merge walls).",
             "", "| executor | run | wall (s) | expert read (GB) | base read (GB) | range tasks |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["overhead"]:
        lines.append(f"| {r['executor']} | {r['run']} | {r['wall_s']:.2f} | {r['expert_read'] / 1e9:.3f} | "
                     f"{r['base_read'] / 1e9:.3f} | {r['tasks'] or '-'} |")
    lines += ["", f"Median wall: local {med['local']:.2f} s, Ray {med['ray']:.2f} s (Ray / local = "
                  f"{med['ray'] / med['local']:.2f}). Outputs byte-identical: {res['identical']}"
                  + (f" (differ: {', '.join(res['differing_files'])})" if res["differing_files"] else "") + ".", "",
              f"Simulated nodes, {res['node_bps'] / 1e6:.0f} MB/s per node, warm inputs:", "",
              "| executor | nodes | wall (s) | speed-up vs 1 node (local) | range tasks | warm-up (s) |",
              "| --- | --- | --- | --- | --- | --- |"]
    base = res["nodes"][0]["wall_s"]
    for r in res["nodes"]:
        lines.append(f"| {r['executor']} | {r['nodes']} | {r['wall_s']:.2f} | {base / r['wall_s']:.2f} | "
                     f"{r['tasks'] or '-'} | {r.get('warm_up_s', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=list(PROFILES), default="full")
    ap.add_argument("--k", type=int)
    ap.add_argument("--budget")
    ap.add_argument("--op")
    ap.add_argument("--node-mbps", type=float)
    ap.add_argument("--nodes", type=int, nargs="+")
    ap.add_argument("--runs", type=int, default=1, help="overhead runs per executor (default 1)")
    ap.add_argument("--catalog", type=Path)
    ap.add_argument("--work", default="/tmp/mergepipe-ray-bench")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--report-only", action="store_true", help="rewrite ray-results.md from ray.json")
    args = ap.parse_args(argv)
    if args.report_only:
        (args.out / "ray-results.md").write_text(report(json.loads((args.out / "ray.json").read_text())))
        return 0
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    res = run(args)
    text = report(res)
    print(text)
    if args.profile != "ci":
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ray.json").write_text(json.dumps(res, indent=2))
        (args.out / "ray-results.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
