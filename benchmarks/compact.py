"""The compact delta tier (issue 27), side by side in one run: ANALYZE time with and without compacts per codec,
catalog growth and stored error per level, and budgeted merges exact-only vs tiered (bytes, time, bound, the
realized deviation from the full merge).

    python -m benchmarks.compact              # qwen3-0.6b-shaped bf16 family, base + 4 experts, 1 MiB grid
    python -m benchmarks.compact --smoke      # tiny family, one repeat (under a minute): the code path only

ANALYZE: one catalog per configuration (no compacts; sign1, q2, q4, progressive at groups of 128; progressive
at 64 and 256), each ``mergepipe analyze --force`` of the K experts a process of its own on a cold page cache
(posix_fadvise DONTNEED on the family), rotating the order each repeat; a plain cold read of the same files
is the floor. Merges: ``api.merge`` in a child process per merge (the family and the compact files evicted
first) on the progressive catalog, with ``compact="off"`` (exact-only: today's plans), ``"progressive"``
(1, 2 or 4 bits per block, as the planner chooses) and ``"q4"`` (4 bits only). Wall time, disk bytes and peak
RSS come from os.wait4 of the child (benchmarks/child.py: ru_inblock x 512, the kernel's read_bytes of
/proc/<pid>/io for the child and what it waited for); exact/compact/base bytes from the manifest's realized
counters. Writes compact.{md,json} (compact-smoke.* with --smoke) to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROFILES = {
    "full": dict(size="qwen3-0.6b", dtype="bf16", k=4, block=1 << 20, repeats=3, merge_repeats=3),
    # merge time exact-only vs tiered with the engine of today, on a smaller family (no ANALYZE codec sweep)
    "merges": dict(size="medium", dtype="bf16", k=4, block=1 << 20, repeats=1, merge_repeats=3,
                   configs=("none", "progressive"), ops=("linear", "ties"), budgets=("10%", "25%", "100%"),
                   modes=("off", "progressive"), fp32_check=False),
    # the code path only, in as few processes as it takes (each one imports torch)
    "smoke": dict(size="tiny", dtype="bf16", k=4, block=4 << 10, repeats=1, merge_repeats=1,
                  configs=("none", "progressive"), ops=("linear",), budgets=("10%", "100%"),
                  modes=("off", "progressive"), warm=False, fp32_check=False),
}
# (label, codec, group): the ANALYZE configurations, one catalog each
CONFIGS = [("none", None, None), ("sign1", "sign1", 128), ("q2", "q2", 128), ("q4", "q4", 128),
           ("progressive", "progressive", 128), ("progressive-g64", "progressive", 64),
           ("progressive-g256", "progressive", 256)]
MERGE_CATALOG = "progressive"  # the catalog the merges plan on (its record serves 1, 2 and 4 bits)
MODES = ("off", "progressive", "q4")
OPS = ("linear", "ties")
BUDGETS = ("10%", "25%", "100%")
DENSITY = 0.2  # ties, as benchmarks/run.py
MB = 1e6


# --- child modes ----------------------------------------------------------------------------------------
def merge_child(spec_path: str) -> int:
    """One merge through the API; its plan, bound and realized counters go to the spec's result file."""
    from mergepipe import api
    from mergepipe.catalog.db import Catalog
    spec = json.loads(Path(spec_path).read_text())
    cat = Catalog(spec["db"])
    kw = {"density": DENSITY} if spec["op"] == "ties" else {}
    plan, snap, man = api.merge(cat, "base", spec["experts"], spec["out"], operator=spec["op"],
                                budget=spec["budget"], compact=spec["compact"], model_id=spec["model_id"], **kw)
    core = man.core if hasattr(man, "core") else man["core"]
    Path(spec["result"]).write_text(json.dumps({
        "plan_id": plan.id, "digest": plan["digest"], "estimate": plan["estimate"], "tiers": plan.data.get("tiers"),
        "error_bound": plan["error_bound"], "full_expert_bytes": plan["full_expert_bytes"],
        "realized": core.get("realized"), "snapshot": snap}, default=str))
    cat.close()
    return 0


def deviation(a: str, f: str) -> dict:
    """||A - F||_2 over every tensor (float64 of the stored values), and ||F||_2."""
    import torch
    from safetensors import safe_open
    from mergepipe.storage.safetensors import open_checkpoint
    ca, cf = open_checkpoint(a), open_checkpoint(f)
    if set(ca.tensors) != set(cf.tensors):
        return {"same_names": False}
    sq = ra = rf = 0.0
    for name in sorted(ca.tensors):
        with safe_open(str(ca.path_of(ca.tensors[name])), "pt") as fa, \
                safe_open(str(cf.path_of(cf.tensors[name])), "pt") as ff:
            x, y = fa.get_tensor(name), ff.get_tensor(name)
        sq += float(torch.sum(torch.square(x.double() - y.double())))
        if x.dtype == torch.bfloat16:  # half an ulp of each stored value: the most its output rounding moved it
            ra += float(torch.sum(torch.square(_half_ulp(x)), dtype=torch.float64))
            rf += float(torch.sum(torch.square(_half_ulp(y)), dtype=torch.float64))
    return {"same_names": True, "deviation": math.sqrt(sq), "rounding": math.sqrt(ra) + math.sqrt(rf)}


def _half_ulp(x):
    """Half the bfloat16 spacing at each value (0 at 0): |rounding error| of a bf16 output is at most this."""
    import torch
    _, e = torch.frexp(x.float())  # |x| = m 2^e, m in [0.5, 1): bf16 spacing 2^(e - 8)
    return torch.where(x == 0, 0.0, torch.exp2((e - 9).float()))


# --- helpers ----------------------------------------------------------------------------------------------
def run_mod():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmarks import run
    return run


def catalog_of(run, work: Path, label: str, fam: dict, ids: list[str]) -> Path:
    db = work / f"cat-{label}.sqlite"
    if not db.exists():
        cat = run.Catalog(db)
        run.register(cat, "base", str(fam["base"]))
        for eid, path in zip(ids, fam["experts"]):
            run.register(cat, eid, str(path), base_id="base")
        cat.close()
    return db


def compact_dir(db: Path) -> Path:
    return db.with_name(db.stem + ".compacts")


def catalog_stats(db: Path) -> dict:
    """Compact bytes, expert bytes and the stored error per level relative to the blocks' delta norms."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT codec, group_size, nbytes, expert_bytes FROM compacts").fetchall()
        out = {"compact_bytes": sum(r[2] for r in rows), "expert_bytes": sum(r[3] for r in rows),
               "codec": rows[0][0] if rows else None, "group": rows[0][1] if rows else None,
               "catalog_bytes": db.stat().st_size, "rel_error": {}, "rel_error_l2": {}}
        if rows:
            agg = con.execute(
                "SELECT SUM(b.delta_l2), SUM(b.delta_l2 * b.delta_l2), SUM(c.err1), SUM(c.err1 * c.err1), "
                "SUM(c.err2), SUM(c.err2 * c.err2), SUM(c.err4), SUM(c.err4 * c.err4), COUNT(*) "
                "FROM compact_blocks c JOIN blocks b ON b.model_id = c.model_id AND b.tensor = c.tensor "
                "AND b.block = c.block").fetchone()
            l1, l2sq = agg[0] or 0.0, agg[1] or 0.0
            out["blocks"] = agg[8]
            for lv, (s, ssq) in zip((1, 2, 4), ((agg[2], agg[3]), (agg[4], agg[5]), (agg[6], agg[7]))):
                if s is not None and l1 > 0:
                    out["rel_error"][lv] = s / l1  # sum of stored err / sum of block delta l2
                    out["rel_error_l2"][lv] = math.sqrt(ssq / l2sq)  # ||all errors|| / ||all deltas||
    finally:
        con.close()
    out["compact_files_bytes"] = sum(p.stat().st_size for p in compact_dir(db).glob("*.mpc")) \
        if compact_dir(db).is_dir() else 0
    return out


def sha_files(folder: Path) -> dict:
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
        out[p.name] = h.hexdigest()
    return out


def warm_numba(run, work: Path) -> None:
    """Compile (and cache) the compact encoder once, untimed, on a tiny family: no run pays numba's compile."""
    fam = run.ensure_family(work, "tiny", "bf16", 1)
    catalog_of(run, work, "warm", fam, ["e1"])
    run.measure([run.PY, "-m", "mergepipe.cli", "--db", str(work / "cat-warm.sqlite"), "analyze", "--force",
                 "--block-bytes", str(4 << 10), "--compact", "progressive", "--model-id", "e1"])


# --- the benchmark ------------------------------------------------------------------------------------------
def configs(prof) -> list:
    return [c for c in CONFIGS if c[0] in prof.get("configs", [c[0] for c in CONFIGS])]


def bench_analyze(run, prof, fam, work, ids, res) -> None:
    inputs = [fam["base"], *fam["experts"]]
    CONFIGS = configs(prof)
    dbs = {label: catalog_of(run, work, label, fam, ids) for label, _, _ in CONFIGS}
    runs = res["analyze_runs"]
    for rep in range(prof["repeats"]):
        run.cold(inputs)
        r = run.measure([run.PY, str(ROOT / "benchmarks" / "coldread.py"), *map(str, inputs)])
        runs.append({"config": "cold-read", "rep": rep, **{k: r[k] for k in ("wall_s", "read_bytes", "peak_rss_bytes")}})
        order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)]
        for label, codec, group in order:
            cmd = [run.PY, "-m", "mergepipe.cli", "--db", str(dbs[label]), "analyze", "--force",
                   "--block-bytes", str(prof["block"])]
            if codec:
                cmd += ["--compact", codec, "--compact-group", str(group)]
            run.cold(inputs)
            r = run.measure(cmd + ["--model-id", *ids])
            runs.append({"config": label, "rep": rep, **{k: r[k] for k in ("wall_s", "read_bytes", "write_bytes",
                                                                          "peak_rss_bytes")}})
            print(f"[compact] analyze {label} rep {rep}: {r['wall_s']:.1f} s, read {r['read_bytes'] / MB:.0f} MB",
                  flush=True)
    for label, codec, group in CONFIGS:
        res["catalogs"][label] = {"codec": codec, "group": group, **catalog_stats(dbs[label])}


def bench_merges(run, prof, fam, work, ids, res) -> None:
    db = work / f"cat-{MERGE_CATALOG}.sqlite"
    inputs = [fam["base"], *fam["experts"], compact_dir(db)]
    outdir = work / "out"
    outdir.mkdir(exist_ok=True)
    keep = {}  # (op, budget, mode) -> output folder kept for the checks (rep 0)
    OPS, BUDGETS, MODES = (prof.get(k, d) for k, d in (("ops", globals()["OPS"]), ("budgets", globals()["BUDGETS"]),
                                                        ("modes", globals()["MODES"])))
    for rep in range(prof["merge_repeats"]):
        for op in OPS:
            for budget in BUDGETS:
                modes = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
                for mode in modes:
                    tag = f"{op}-{budget[:-1]}-{mode}"
                    out = outdir / f"{tag}-r{rep}"
                    shutil.rmtree(out, ignore_errors=True)
                    spec = {"db": str(db), "experts": ids, "out": str(out), "op": op, "budget": budget,
                            "compact": mode, "model_id": f"{tag}-r{rep}-{time.time_ns()}",
                            "result": str(work / f"{tag}-r{rep}.json")}
                    sp = work / f"{tag}-r{rep}.spec.json"
                    sp.write_text(json.dumps(spec))
                    run.cold(inputs)
                    r = run.measure([run.PY, str(Path(__file__).resolve()), "--merge-child", str(sp)])
                    info = json.loads(Path(spec["result"]).read_text())
                    row = {"op": op, "budget": budget, "mode": mode, "rep": rep,
                           **{k: r[k] for k in ("wall_s", "read_bytes", "write_bytes", "peak_rss_bytes")}, **info}
                    res["merge_runs"].append(row)
                    real = info["realized"] or {}
                    print(f"[compact] {tag} rep {rep}: {r['wall_s']:.1f} s, exact {real.get('expert_read', 0) / MB:.0f} MB, "
                          f"compact {real.get('compact_read', 0) / MB:.1f} MB, disk {r['read_bytes'] / MB:.0f} MB",
                          flush=True)
                    if rep == 0:
                        keep[(op, budget, mode)] = out
                    else:
                        shutil.rmtree(out, ignore_errors=True)
            if rep == 0:
                checks_for(op, keep, res, MODES)
    shutil.rmtree(outdir, ignore_errors=True)


def checks_for(op: str, keep: dict, res: dict, MODES=MODES) -> None:
    """Rep 0 outputs of one operator: 100 % tiered vs exact-only byte for byte, and each budgeted merge's
    deviation from the exact-only 100 % merge (M_full); the outputs are removed after."""
    full = keep[(op, "100%", "off")]
    full_sha = sha_files(full)
    for mode in MODES:
        if mode == "off":
            continue
        other = keep[(op, "100%", mode)]
        sha = sha_files(other)
        res["checks"][f"{op} 100%: {mode} vs off"] = {"byte_identical": sha == full_sha and bool(sha),
                                                       "files": len(sha)}
    for (o, budget, mode), out in list(keep.items()):
        if o != op or budget == "100%":
            continue
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--deviation", str(out), str(full)],
                              capture_output=True, text=True)
        if proc.returncode:
            res["deviations"][f"{op}|{budget}|{mode}"] = {"failed": proc.stderr[-500:]}
        else:
            res["deviations"][f"{op}|{budget}|{mode}"] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"[compact] deviation {op} {budget} {mode}: {res['deviations'][f'{op}|{budget}|{mode}']}", flush=True)
    for key in [k for k in keep if k[0] == op]:
        shutil.rmtree(keep.pop(key), ignore_errors=True)


def fp32_bound_check(run, work: Path, res: dict) -> None:
    """The bound against the realized deviation where output rounding cannot hide it: a small fp32 family
    (K = 4, 64 KiB grid, progressive compacts), merged in this process (unmeasured) at 10/25 % exact-only and
    tiered and at 100 % exact-only; fp32 outputs, so the deviation is the merge's own."""
    from mergepipe import api
    fam = run.ensure_family(work, "small", "fp32", 4)
    ids = ["e1", "e2", "e3", "e4"]
    db = catalog_of(run, work, "fp32", fam, ids)
    cat = run.Catalog(db)
    run.analyze(cat, ids, block_bytes=64 << 10, compact="progressive")
    rows = res.setdefault("fp32_bound", [])
    for op in OPS:
        kw = {"density": DENSITY} if op == "ties" else {}
        outs = {}
        for budget, mode in (("100%", "off"), ("10%", "off"), ("10%", "progressive"), ("25%", "off"),
                             ("25%", "progressive")):
            out = work / f"fp32-{op}-{budget[:-1]}-{mode}"
            plan, _, _ = api.merge(cat, "base", ids, out, operator=op, budget=budget, compact=mode,
                                   model_id=out.name, **kw)
            outs[(budget, mode)] = out
            if budget == "100%":
                continue
            dev = deviation(str(out), str(outs[("100%", "off")]))
            eb = plan["error_bound"] or {}
            rows.append({"op": op, "budget": budget, "mode": mode, "bound": eb.get("absolute"),
                         "kind": eb.get("kind"), "deviation": dev.get("deviation"),
                         "compact_read": plan["estimate"].get("compact_read", 0),
                         "expert_read": plan["estimate"]["expert_read"]})
            print(f"[compact] fp32 {op} {budget} {mode}: {rows[-1]}", flush=True)
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
    cat.close()
    shutil.rmtree(fam["root"], ignore_errors=True)


# --- report -------------------------------------------------------------------------------------------------
def decode_check(res: dict, repeats: int = 20) -> None:
    """Decoding one 1 MiB bf16 block's record (524,288 entries, groups of 128) at each level: the numpy decoder
    (storage/compact.decode, the written definition, which the engine used when the merge rows above were
    measured) against the compiled one the engine uses since (analyze/compact.decode_block); median ms."""
    import numpy as np
    from mergepipe.analyze.compact import decode_block
    from mergepipe.storage import compact as C
    n = 1 << 19
    d = (np.random.default_rng(0).standard_normal(n) * 1e-3).astype(np.float32)
    record, _ = C.encode(d, 128, 4)
    rows = []
    for level in (1, 2, 4):
        prefix = record[:C.level_bytes(n, 128, level)]
        decode_block(prefix, n, 128, level)  # compile / load from numba's cache
        times = {}
        for name, f in (("numpy", C.decode), ("compiled", decode_block)):
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f(prefix, n, 128, level)
                ts.append(time.perf_counter() - t0)
            times[name] = 1000 * med(ts)
        rows.append({"level": level, "numpy_ms": times["numpy"], "compiled_ms": times["compiled"]})
    res["decode"] = {"rows": rows, "added": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                     "machine": run_mod().machine_info()}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f} %"


def fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def report(res: dict) -> str:
    m = res["machine"]
    smoke = res["profile"] == "smoke"
    L = [f"# Compact delta tier (issue 27): ANALYZE cost, catalog growth, tiered merges", "",
         f"Reproduce: `python -m benchmarks.compact`{' --smoke' if smoke else ''} (`--smoke`: a tiny family, one "
         "repeat, seconds; the code path only). Raw runs: "
         f"[{res['stem']}.json]({res['stem']}.json).", "",
         f"Run {res['started']} ({m['cpus']} CPUs, {m['memory_gib']} GiB RAM, torch {m['torch']}, Python "
         f"{m['python']}; the machine was shared with two other jobs: compare the ratios, each from this one run). "
         f"Family {res['family']} (base + K={res['k']} experts, {res['family_bytes'] / MB:.0f} MB, "
         f"{res['expert_bytes'] / MB:.0f} MB of expert weights), grid {res['block_bytes'] >> 10} KiB. Every "
         "measured command is a process of its own started on a cold page cache (posix_fadvise DONTNEED on the "
         "family and, for merges, the compact files); wall, disk read (ru_inblock x 512 of the child: the "
         "kernel's /proc read_bytes) and peak RSS from os.wait4 (benchmarks/child.py).", ""]
    # ANALYZE
    runs = res["analyze_runs"]
    by = {}
    for r in runs:
        by.setdefault(r["config"], []).append(r)
    base_wall = med([r["wall_s"] for r in by.get("none", [])])
    floor = med([r["wall_s"] for r in by.get("cold-read", [])])
    L += [f"## ANALYZE of {res['k']} experts, with and without compacts (median of {res['repeats']}, order rotated "
          "each repeat)", "",
          "| compacts | codec | group | wall s | runs s | vs without compacts | paired | disk read MB | peak RSS MB "
          "| compact MB | catalog growth | rel. error 1 bit | 2 bits | 4 bits |",
          "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    goal = []
    for label, codec, group in CONFIGS:
        rs = by.get(label, [])
        if not rs:
            continue
        w = med([r["wall_s"] for r in rs])
        ratio = w / base_wall if base_wall else None
        paired = med([r["wall_s"] / n["wall_s"] for r in rs for n in by.get("none", []) if n["rep"] == r["rep"]])
        cs = res["catalogs"].get(label, {})
        growth = cs.get("compact_bytes", 0) / cs["expert_bytes"] if cs.get("expert_bytes") else None
        err = cs.get("rel_error", {})
        errs = [fmt(err.get(lv) if lv in err else err.get(str(lv)), ".4f") for lv in (1, 2, 4)]
        L.append(f"| {label} | {codec or '-'} | {group or ''} | {w:.1f} | "
                 f"{', '.join(format(r['wall_s'], '.1f') for r in sorted(rs, key=lambda r: r['rep']))} | "
                 f"{fmt(ratio)}x | {fmt(paired)}x | {med([r['read_bytes'] for r in rs]) / MB:.0f} | "
                 f"{med([r['peak_rss_bytes'] for r in rs]) / MB:.0f} | "
                 f"{fmt(cs.get('compact_bytes', 0) / MB, '.1f') if codec else ''} | "
                 f"{('+' + pct(growth)) if codec and growth is not None else ''} | {' | '.join(errs)} |")
        if codec and ratio is not None:
            goal.append((label, ratio, paired))
    if floor:
        L.append(f"| plain cold read (floor) | - | | {floor:.1f} | "
                 f"{', '.join(format(r['wall_s'], '.1f') for r in by['cold-read'])} | {fmt(floor / base_wall)}x | | "
                 f"{med([r['read_bytes'] for r in by['cold-read']]) / MB:.0f} | | | | | | |")
    met = [lab for lab, r, _ in goal if r <= 1.2]
    miss = [f"{lab} ({r:.2f}x)" for lab, r, _ in goal if r > 1.2]
    pooled = med([r["wall_s"] / n["wall_s"] for lab, c, _ in CONFIGS if c for r in by.get(lab, [])
                  for n in by.get("none", []) if n["rep"] == r["rep"]])
    L += ["", "`vs without compacts`: median wall over median wall without; `paired`: the median over repeats of "
          "the ratio to the run without compacts in the same repeat. Goal ANALYZE with compacts <= 1.2x without "
          "(by the medians): "
          + ("**met** by every codec." if not miss else
             f"**not met** by {', '.join(miss)}" + (f"; met by {', '.join(met)}." if met else "."))
          + (f" Every compact run against the run without compacts of its repeat, pooled over codecs: median "
             f"{pooled:.2f}x." if pooled else "")]
    L += ["", "Catalog growth = compact bytes / expert bytes of the analyzed experts (the compact files beside the "
          "catalog; the SQLite rows per block are in the catalog itself). Relative error per level = sum of the "
          "stored error norms / sum of the blocks' delta l2 (catalog `compact_blocks` joined with `blocks`); "
          "a record at L bits holds the prefixes of the lower levels, so the catalog stores the error of every level "
          "up to its codec's (sign1: 1; q2: 1, 2; q4 and progressive: 1, 2, 4), while plans read only the codec's "
          "levels (sign1 1 bit, q2 2 bits, q4 4 bits, progressive any). The encoder computes every plane whatever "
          "the codec (analyze/compact.py); codecs differ in the bytes written. ||all errors|| / ||all deltas||: "
          + "; ".join(f"{lab} " + ", ".join(f"{lv} bit{'s' if int(lv) > 1 else ''} {v:.4f}"
                                             for lv, v in res["catalogs"][lab].get("rel_error_l2", {}).items())
                      for lab, c, _ in CONFIGS if c and lab in res["catalogs"]) + "."]
    # merges
    mr = res["merge_runs"]
    L += ["", f"## Merges, K={res['k']}: exact-only vs tiered (median of {res['merge_repeats']}, order of the modes "
          "rotated each repeat)", "",
          f"Planned on the `{MERGE_CATALOG}` catalog (groups of 128): `compact=\"off\"` is exact-only (today's plans), "
          "`\"progressive\"` reads each compact block at 1, 2 or 4 bits as the planner chooses, `\"q4\"` at 4 bits "
          f"only. ties at density {DENSITY}. Exact and compact MB are the manifest's realized counters; disk read "
          "is everything the child process read from the disk (base, experts, compact files, catalog, libraries). "
          "Deviation = ||M_budget - M_full|| over all output tensors (float64 of the stored bf16), M_full the "
          "exact-only 100 % merge of the same operator; bound = the plan's `error_bound.absolute` (its kind in "
          "brackets; empty: the plan states none). The bound is on the merge before its output is rounded to bf16; "
          "the rounding allowance ||ulp(M_budget)/2|| + ||ulp(M_full)/2|| is the most both outputs' rounding can "
          "add to the measured deviation, so a sound bound satisfies deviation <= bound + allowance.", "",
          "| op | budget | mode | wall s | vs exact-only | exact MB | compact MB | base MB | disk read MB "
          "| peak RSS MB | blocks exact / compact (1/2/4 bits) / omitted | bound | deviation | bf16 rounding "
          "allowance | deviation / bound | deviation / exact-only's |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    groups = {}
    for r in mr:
        groups.setdefault((r["op"], r["budget"], r["mode"]), []).append(r)
    for op in OPS:
        for budget in BUDGETS:
            off = groups.get((op, budget, "off"))
            off_w = med([r["wall_s"] for r in off]) if off else None
            dev_off = res["deviations"].get(f"{op}|{budget}|off", {}).get("deviation")
            for mode in MODES:
                rs = groups.get((op, budget, mode))
                if not rs:
                    continue
                r0 = next(r for r in rs if r["rep"] == 0)
                w = med([r["wall_s"] for r in rs])
                real = r0.get("realized") or {}
                t = r0.get("tiers") or {}
                bits = (t.get("compact") or {}).get("by_bits") or {}
                blocks = (f"{t.get('exact', {}).get('blocks', '')} / {t.get('compact', {}).get('blocks', 0)} "
                          f"({'/'.join(str(bits.get(str(b), bits.get(b, 0))) for b in (1, 2, 4))}) / "
                          f"{t.get('omitted', {}).get('blocks', '')}")
                eb = r0.get("error_bound") or {}
                bound = eb.get("absolute") if isinstance(eb, dict) else None
                dev = res["deviations"].get(f"{op}|{budget}|{mode}", {}).get("deviation")
                rnd = res["deviations"].get(f"{op}|{budget}|{mode}", {}).get("rounding")
                if budget == "100%":
                    dev = 0.0 if res["checks"].get(f"{op} 100%: {mode} vs off", {}).get("byte_identical") \
                        or mode == "off" else None
                L.append(
                    f"| {op} | {budget} | {mode} | {w:.2f} | {fmt(w / off_w if off_w else None)}x | "
                    f"{real.get('expert_read', 0) / MB:.1f} | {real.get('compact_read', 0) / MB:.1f} | "
                    f"{real.get('base_read', 0) / MB:.1f} | {med([r['read_bytes'] for r in rs]) / MB:.0f} | "
                    f"{med([r['peak_rss_bytes'] for r in rs]) / MB:.0f} | {blocks} | "
                    f"{fmt(bound, '.4g')}{' (' + eb['kind'] + ')' if isinstance(eb, dict) and eb.get('kind') else ''} | "
                    f"{fmt(dev, '.4g')} | {fmt(rnd, '.4g')} | "
                    f"{fmt(dev / bound if dev is not None and bound else None, '.3f')} | "
                    f"{fmt(dev / dev_off if dev is not None and dev_off and budget != '100%' else None, '.3f')} |")
    dec = res.get("decode")
    if dec:
        L += ["", "### Decoding compact records (added " + dec["added"] + ")", "",
              "The merge rows above were measured when the engine decoded compact records with numpy "
              "(storage/compact.decode): a tiered plan decodes every compact block it reads, about 4x the blocks an "
              "exact-only plan merges (the likely bulk of its extra time; the rest is inherent: a tiered merge merges "
              "nearly every block, where an exact-only one copies the omitted ones from the base). The engine now "
              "decodes with a compiled kernel (analyze/compact.decode_block, the same float32 values, tested). One 1 MiB bf16 block's record "
              "(524,288 entries, groups of 128), median of 20 (`python -m benchmarks.compact --report "
              "docs/benchmarks/compact.json --add-decode-check`); the merge table has not been re-run since:", "",
              "| bits read | numpy ms | compiled ms | speed-up |", "|---:|---:|---:|---:|"]
        for r in dec["rows"]:
            L.append(f"| {r['level']} | {r['numpy_ms']:.2f} | {r['compiled_ms']:.2f} | "
                     f"{r['numpy_ms'] / r['compiled_ms']:.1f}x |")
    fb = res.get("fp32_bound")
    if fb:
        L += ["", "### The bound where output rounding cannot hide the deviation (small fp32 family, K = 4, 64 KiB grid)",
              "", "A bf16 output rounds every value to 8 bits of mantissa, so on the family above the measured "
              "deviation carries the two outputs' rounding. Here (benchmarks/compact.py `fp32_bound_check`, same "
              "operators and modes, progressive compacts at groups of 128, outputs in fp32) it does not."
              + (f" Added to this run's results on {res['fp32_bound_added']} with `python -m benchmarks.compact "
                 "--report docs/benchmarks/compact.json --add-fp32-check` (a full run includes it)."
                 if res.get("fp32_bound_added") else ""), "",
              "| op | budget | mode | exact MB | compact MB | bound | deviation | deviation / bound |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in fb:
            L.append(f"| {r['op']} | {r['budget']} | {r['mode']} | {r['expert_read'] / MB:.2f} | "
                     f"{r['compact_read'] / MB:.2f} | {fmt(r['bound'], '.4g')}"
                     f"{' (' + r['kind'] + ')' if r.get('kind') else ''} | {fmt(r['deviation'], '.4g')} | "
                     f"{fmt(r['deviation'] / r['bound'] if r['bound'] else None, '.3f')} |")
    L += ["", "Checks:"]
    for name, c in res["checks"].items():
        L.append(f"- {name}: " + ("byte-identical" if c.get("byte_identical") else "**differ**")
                 + f" ({c.get('files')} safetensors files compared by sha256).")
    for name, d in res["deviations"].items():
        if "failed" in d or not d.get("same_names", True):
            L.append(f"- deviation {name}: **failed** {d}")
    same_plan = [(op, mode) for op in OPS for mode in MODES[1:]
                 if groups.get((op, "100%", mode)) and groups.get((op, "100%", "off"))
                 and groups[(op, "100%", mode)][0]["plan_id"] == groups[(op, "100%", "off")][0]["plan_id"]]
    L.append(f"- 100 % plans with the same id as exact-only's: {', '.join(f'{o} {m}' for o, m in same_plan) or 'none'}.")
    for r in mr:
        e, rl = r.get("estimate") or {}, r.get("realized") or {}
        if r["rep"] == 0 and (e.get("expert_read") != rl.get("expert_read")
                              or e.get("compact_read") != rl.get("compact_read")):
            L.append(f"- {r['op']} {r['budget']} {r['mode']}: realized {rl} differs from the estimate {e}.")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny family, one repeat: under a minute")
    ap.add_argument("--profile", choices=sorted(PROFILES), help="a profile by name (merges: merge time exact-only "
                    "vs tiered on a medium family, written to compact-merges.md)")
    ap.add_argument("--repeats", type=int, help="ANALYZE repeats (default: 3; smoke 1)")
    ap.add_argument("--merge-repeats", type=int, help="merge repeats (default: 3; smoke 1)")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--keep-family", action="store_true", help="keep the family this run wrote (default: delete)")
    ap.add_argument("--report", metavar="JSON", help="only rewrite the markdown of an earlier run's JSON")
    ap.add_argument("--add-fp32-check", action="store_true", help="with --report: run the fp32 bound check alone "
                    "and add it to that JSON")
    ap.add_argument("--add-decode-check", action="store_true", help="with --report: time the numpy and compiled "
                    "decoders and add them to that JSON")
    ap.add_argument("--merge-child", help=argparse.SUPPRESS)
    ap.add_argument("--deviation", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.merge_child:
        return merge_child(args.merge_child)
    if args.deviation:
        print(json.dumps(deviation(*args.deviation)))
        return 0
    if args.report:
        res = json.loads(Path(args.report).read_text())
        if args.add_fp32_check:  # run the fp32 bound check alone and add it to an earlier run's results
            run = run_mod()
            work = Path(args.work) / "compact-fp32"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            try:
                res.pop("fp32_bound", None)
                res["fp32_bound_added"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
                fp32_bound_check(run, work, res)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            Path(args.report).write_text(json.dumps(res, indent=1, default=str))
        if args.add_decode_check:
            decode_check(res)
            Path(args.report).write_text(json.dumps(res, indent=1, default=str))
        Path(args.report).with_suffix(".md").write_text(report(res))
        return 0
    run = run_mod()
    name = args.profile or ("smoke" if args.smoke else "full")
    prof = dict(PROFILES[name])
    if args.repeats:
        prof["repeats"] = args.repeats
    if args.merge_repeats:
        prof["merge_repeats"] = args.merge_repeats
    work_root = Path(args.work)
    work_root.mkdir(parents=True, exist_ok=True)
    fam_dir = work_root / f"{prof['size']}-{prof['dtype']}-K{prof['k']}"
    made = not (fam_dir / f"expert_{prof['k']}" / "config.json").exists()
    fam = run.ensure_family(work_root, prof["size"], prof["dtype"], prof["k"])
    work = work_root / ("compact" if name == "full" else f"compact-{name}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ids = [f"e{i}" for i in range(1, prof["k"] + 1)]
    stem = "compact" if name == "full" else f"compact-{name}"
    models = [fam["base"], *fam["experts"]]
    res = {"profile": name, "stem": stem, "machine": run.machine_info(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "family": fam["root"].name,
           "k": prof["k"], "block_bytes": prof["block"], "repeats": prof["repeats"],
           "merge_repeats": prof["merge_repeats"], "density": DENSITY,
           "family_bytes": sum(f.stat().st_size for m in models for f in m.glob("*.safetensors")),
           "expert_bytes": sum(f.stat().st_size for m in models[1:] for f in m.glob("*.safetensors")),
           "analyze_runs": [], "catalogs": {}, "merge_runs": [], "deviations": {}, "checks": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write():
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
        (out / f"{stem}.md").write_text(report(res))

    try:
        if prof.get("warm", True):
            warm_numba(run, work)
        bench_analyze(run, prof, fam, work, ids, res)
        write()
        bench_merges(run, prof, fam, work, ids, res)
        if prof.get("fp32_check", True):
            fp32_bound_check(run, work, res)
        res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        write()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made and not args.keep_family:
            shutil.rmtree(fam["root"], ignore_errors=True)
    print(report(res))
    print(f"wrote {out / (stem + '.md')} and {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
