"""Block-size study: how the grid's byte target trades catalog size and ANALYZE time against how
precisely the planner can spend a budget (relative error bound at a fixed budget) and merge time.

    python benchmarks/block_size.py [--size medium] [--sizes 262144 1048576 4194304]

Writes docs/benchmarks/block-size.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mergepipe.analyze.runner import analyze  # noqa: E402
from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.engine.engine import Engine  # noqa: E402
from mergepipe.planner.budget import Budget  # noqa: E402
from mergepipe.planner.context import Planner  # noqa: E402
from mergepipe.catalog.models import register  # noqa: E402
from mergepipe.storage.local import evict  # noqa: E402
from run import ensure_family  # noqa: E402


def l2_distance(a, b) -> float:
    """||A - B||_2 over all tensors (float64)."""
    from safetensors.torch import load_file
    from mergepipe.storage.safetensors import open_checkpoint
    ta, tb = {}, {}
    for ck, dst in ((open_checkpoint(a), ta), (open_checkpoint(b), tb)):
        for f in ck.files:
            dst.update(load_file(str(f)))
    return sum(float(((ta[k].double() - tb[k].double()) ** 2).sum()) for k in ta) ** 0.5


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="*", default=[256 << 10, 1 << 20, 4 << 20])
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "block-size.md"))
    a = ap.parse_args()
    work = Path(a.work)
    fam = ensure_family(work, a.size, "bf16", a.experts)
    ids = [f"e{i}" for i in range(1, a.experts + 1)]
    rows = []
    for bb in a.sizes:
        db = work / f"blocksize-{bb}.sqlite"
        for s in ("", "-wal", "-shm"):
            Path(str(db) + s).unlink(missing_ok=True)
        cat = Catalog(db)
        register(cat, "base", str(fam["base"]))
        for eid, p in zip(ids, fam["experts"]):
            register(cat, eid, str(p), base_id="base")
        evict([fam["root"]])
        t0 = time.perf_counter()
        analyze(cat, ids, block_bytes=bb)
        t_an = time.perf_counter() - t0
        cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        row = {"block_bytes": bb, "analyze_s": t_an, "catalog_mb": db.stat().st_size / 1e6,
               "blocks": cat.conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]}
        full_out = work / "blocksize-full"
        shutil.rmtree(full_out, ignore_errors=True)
        Engine(cat).execute(Planner(cat).plan("base", ids, "linear", budget="100%", save=False), out=full_out,
                            model_id=f"bs-{bb}-full-{time.time_ns()}")
        for budget in ("10%", "25%"):
            ctx = Planner(cat).context("base", ids, "linear")
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                plan = ctx.plan(Budget.parse(budget))
                times.append(time.perf_counter() - t0)
            row[f"bound@{budget}"] = plan["error_bound"]["relative"]
            row[f"plan_ms@{budget}"] = statistics.median(times) * 1000
            out = work / "blocksize-out"
            shutil.rmtree(out, ignore_errors=True)
            evict([fam["root"]])
            t0 = time.perf_counter()
            Engine(cat).execute(plan, out=out, model_id=f"bs-{bb}-{budget}-{time.time_ns()}")
            row[f"merge_s@{budget}"] = time.perf_counter() - t0
            row[f"dev@{budget}"] = l2_distance(full_out, out) / l2_distance(full_out, fam["base"])
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(full_out, ignore_errors=True)
        rows.append(row)
        print(row, flush=True)
    family_mb = sum(p.stat().st_size for d in [fam["base"], *fam["experts"]] for p in Path(d).glob("*.safetensors")) / 1e6
    lines = [f"# Block-size study ({a.size} bf16 family, K={a.experts}, {family_mb:.0f} MB of checkpoints)", "",
             "Reproduce: `python benchmarks/block_size.py`. `linear` merges. Deviation = the realized "
             "||M_full - M_A|| / ||M_full - base|| of the budgeted merge (lower: the budget is spent better). "
             "Bound = the planner's additive bound over the estimated ||M_full - base||; it sums block norms, so it "
             "is looser on finer grids and not comparable across them.", "",
             "| block bytes | blocks | catalog MB (% of family) | analyze s | deviation @10% | deviation @25% | bound @10% | bound @25% | plan ms | merge s @10% | merge s @25% |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['block_bytes']} | {r['blocks']} | {r['catalog_mb']:.2f} ({r['catalog_mb'] / family_mb * 100:.2f}%) | "
                     f"{r['analyze_s']:.2f} | {r['dev@10%']:.3f} | {r['dev@25%']:.3f} | {r['bound@10%']:.3f} | "
                     f"{r['bound@25%']:.3f} | {r['plan_ms@10%']:.1f} | "
                     f"{r['merge_s@10%']:.2f} | {r['merge_s@25%']:.2f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
