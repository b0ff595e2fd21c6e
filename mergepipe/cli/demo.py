"""``mergepipe demo``: build a small family, register and analyze it, run a budgeted merge, and open
the dashboard on the demo catalog."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from mergepipe import api
from mergepipe.dashboard.server import check_port_free, run_dashboard
from mergepipe.research.family import make_family

DEMO_EXPERTS = 4


def build_demo(root: Path, log=print) -> dict:
    """Idempotent: reuses the family and catalog when they are already there."""
    root = Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    fam = root / "family"
    t0 = time.perf_counter()
    if not (fam / f"expert_{DEMO_EXPERTS}" / "config.json").exists():
        log(f"building a small bf16 family (base + {DEMO_EXPERTS} experts) in {fam} ...")
        make_family(fam, experts=DEMO_EXPERTS, size="small", dtype="bf16", shard_bytes=4 << 20, seed=0)
    db = root / "catalog.sqlite"
    cat = api.Catalog(db)
    api.register(cat, "base", str(fam / "base"))
    experts = [f"expert_{i}" for i in range(1, DEMO_EXPERTS + 1)]
    api.register_many(cat, [(e, str(fam / e)) for e in experts], base_id="base")
    results = api.analyze(cat, experts, block_bytes=256 << 10, compact="progressive")
    for r in results:
        log(f"analyze {r.model_id}: " + ("unchanged" if r.skipped else f"{r.n_blocks} blocks, "
                                          f"{api.human_bytes(r.bytes_read)} in {r.seconds:.2f} s"))
    stored = [r.compact for r in results if r.compact]
    if stored:
        log(f"compact deltas (progressive): {api.compact_growth_text(sum(c['bytes'] for c in stored), sum(c['expert_bytes'] for c in stored))}")
    n = api.snapshot_count(cat)
    out = root / "merged" / f"ties-25pct-{n + 1}"
    out.parent.mkdir(exist_ok=True)
    plan, sid, manifest = api.merge(cat, "base", experts, out, operator="ties", model_id=f"demo-ties-25pct-{n + 1}",
                                density=0.3, budget="25%")
    s = api.merge_summary(plan, manifest)
    log(f"merged (ties, density 0.3, budget 25%): read {api.human_bytes(s['realized']['expert_read'])} exactly and "
        f"{api.human_bytes(s['realized']['compact_read'])} of compact deltas, of {api.human_bytes(s['full_expert_bytes'])} "
        f"changed (delta != 0) expert bytes -> {sid} at {out}")
    model_id = s["model_id"]
    cat.close()
    res = {"db": str(db), "snapshot_id": sid, "out": str(out), "base": "base", "experts": experts,
           "model_id": model_id, "plan_id": plan.id}
    log(f"demo ready in {time.perf_counter() - t0:.1f} s")
    for line in next_steps(res):
        log(line)
    return res


def next_steps(res: dict) -> list[str]:
    """What to type next: the model ids and the CLI line for the demo catalog."""
    db = shlex.quote(res["db"])
    return [
        f"catalog:  {res['db']}",
        f"models:   base {res['base']}; experts {', '.join(res['experts'])}; merged {res['model_id']} "
        f"({res['snapshot_id']})",
        "use it from the command line:",
        f"  export MERGEPIPE_DB={db}      # or add --db {db} to each command",
        "  mergepipe snapshots",
        f"  mergepipe explain {res['snapshot_id']}",
        f"  mergepipe plan --base {res['base']} --experts {' '.join(res['experts'])} --op ties --density 0.3 "
        f"--budget 40%",
    ]


def run_demo(root: Path, dashboard: bool = True, port: int = 8501) -> dict:
    if dashboard:  # refuse a taken port before building anything
        check_port_free(port)
    res = build_demo(root)
    if dashboard:
        run_dashboard(res["db"], port=port, extra_roots=[str(Path(root).absolute())])
    return res
