"""Engine wall time and peak RSS against the I/O floor, for code trees side by side (e.g. the main
checkout before the fused kernels and this one), cold cache, each run its own process.

    python benchmarks/engine_kernels.py --db CAT.sqlite --work DIR --ops ties dare_ties --ks 2 16 \\
        --trees before=/path/to/old/checkout after=.

The catalog must hold a base registered as ``base`` and experts ``e1..eK`` (make-family, register,
analyze with the CLI). Every run executes the same stored plan (100 % budget unless --budget) with
``python -m mergepipe.cli execute`` under ``PYTHONPATH=TREE``; before each run the inputs are evicted
from the page cache. The floor (benchmarks/floor.py) reads the same bytes and writes the output size.
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

from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.planner.context import Planner  # noqa: E402
from mergepipe.storage.local import evict  # noqa: E402

PY = sys.executable


def measure(cmd: list[str], env=None, cwd=None) -> dict:
    # cwd outside any checkout: ``python -m`` puts the working directory first on sys.path
    proc = subprocess.run([PY, str(ROOT / "benchmarks" / "child.py"), *map(str, cmd)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    lines = proc.stderr.decode().strip().splitlines()
    usage = json.loads(lines[-1])
    if usage.pop("rc") != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n" + "\n".join(lines[-30:-1]))
    return usage


def cold(paths) -> None:
    os.sync()
    evict([p for p in paths if Path(p).exists()])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True)
    ap.add_argument("--work", required=True, help="scratch directory (outside any checkout)")
    ap.add_argument("--ops", nargs="+", default=["ties", "dare_ties"])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 16])
    ap.add_argument("--budget", default="100%")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--trees", nargs="+", default=[f"this={ROOT}"], help="NAME=PATH of mergepipe checkouts")
    ap.add_argument("--json", help="write all runs here")
    a = ap.parse_args(argv)
    work = Path(a.work).resolve()
    a.db = str(Path(a.db).resolve())
    work.mkdir(parents=True, exist_ok=True)
    trees = dict(t.split("=", 1) for t in a.trees)
    cat = Catalog(a.db)
    runs = []
    for k in a.ks:
        ids = [f"e{i}" for i in range(1, k + 1)]
        inputs = [cat.model(i)["uri"] for i in ["base", *ids]]
        for op in a.ops:
            plan = Planner(cat).plan("base", ids, op, budget=a.budget, density=a.density)
            pj = work / f"{plan.id}.json"
            pj.write_text(plan.to_json())
            for rep in range(a.reps):
                for name, tree in trees.items():
                    out = work / f"out-{name}-{op}-{k}"
                    shutil.rmtree(out, ignore_errors=True)
                    cold(inputs)
                    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                    mid = f"{out.name}-{rep}-{time.time_ns()}"
                    r = measure([PY, "-m", "mergepipe.cli", "--db", a.db, "execute", plan.id, "--out", out,
                                 "--model-id", mid], env=env, cwd=work)
                    row = cat.query("SELECT m.json FROM manifests m JOIN snapshots s ON s.id = m.snapshot_id "
                                    "WHERE s.model_id = ?", [mid])
                    run = json.loads(row[0]["json"])["run"]  # the merge itself, without interpreter start-up
                    runs.append({"tree": name, "op": op, "k": k, "rep": rep, "execute_s": run["seconds"],
                                 "timing": run.get("timing"), **r})
                    shutil.rmtree(out, ignore_errors=True)
                fl = work / "floor.bin"
                fl.unlink(missing_ok=True)
                cold(inputs)
                r = measure([PY, str(ROOT / "benchmarks" / "floor.py"), pj, fl], cwd=work)
                runs.append({"tree": "floor", "op": op, "k": k, "rep": rep, **r})
                fl.unlink(missing_ok=True)
    cat.close()
    print(f"budget {a.budget}, density {a.density}, medians of {a.reps}, cold cache")
    print("wall: the whole process (interpreter start-up and imports included); execute: the merge itself")
    print(f"{'op':<11}{'K':>3}  {'contender':<10}{'wall s':>8}{'vs floor':>9}{'execute s':>10}{'peak RSS MB':>13}"
          f"{'read MB':>9}")
    table = []
    for k in a.ks:
        for op in a.ops:
            sel = [r for r in runs if r["k"] == k and r["op"] == op]
            floor = statistics.median(r["wall_s"] for r in sel if r["tree"] == "floor")
            for name in [*trees, "floor"]:
                rs = [r for r in sel if r["tree"] == name]
                wall = statistics.median(r["wall_s"] for r in rs)
                rss = statistics.median(r["peak_rss_bytes"] for r in rs) / 1e6
                rd = statistics.median(r["read_bytes"] for r in rs) / 1e6
                ex = statistics.median(r["execute_s"] for r in rs) if name != "floor" else float("nan")
                table.append({"op": op, "k": k, "contender": name, "wall_s": wall, "vs_floor": wall / floor,
                              "execute_s": ex, "peak_rss_mb": rss, "read_mb": rd})
                print(f"{op:<11}{k:>3}  {name:<10}{wall:>8.2f}{wall / floor:>8.2f}x{ex:>10.2f}{rss:>13.0f}{rd:>9.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
