"""Remote checkpoints over a bandwidth-limited link (issue 18): MergePipe reading the Hub-shaped URLs
with exact ranges, against "download everything, then merge locally" (what mergekit does), one run.

A local HTTP server (tests/remote_helpers.py's RangeServer, in this process) serves the family under
``/{family}/{model}/resolve/main/{file}`` at a fixed bandwidth shared by all connections (default
100 MB/s), counting every body byte it sends. Each contender is its own process (benchmarks/child.py:
wall, peak RSS) and starts with the served files evicted from the page cache.

Contenders, on the same base and K experts, operator linear (mergekit's linear equals MergePipe's at
100 %, bit for bit; its memory stays small at K = 4):
- ``register`` the base and the K experts as ``hf://`` URIs (headers, index and config only);
- ``analyze`` over the link (once per expert: its statistics serve every later merge);
- MergePipe ``merge --budget 10%`` and ``--budget 100%`` straight from the server, output to local disk;
- baseline: download every file of the base and the K experts (4 parallel connections, as
  ``huggingface-cli download`` does), then ``mergekit-yaml`` on the local copies.

    python benchmarks/remote.py                       # qwen3-0.6b bf16 family, K = 4, 100 MB/s
    python benchmarks/remote.py --profile ci          # small family, K = 2 (a minute)
    python benchmarks/remote.py --mbps 50 --k 4

Writes remote.{md,json} (remote-ci.* for the ci profile) to --out (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks import run  # noqa: E402
from remote_helpers import RangeServer  # noqa: E402

PROFILES = {
    "ci": dict(size="small", dtype="bf16", k=2, family=None),
    "full": dict(size="qwen3-0.6b", dtype="bf16", k=4, family="qwen3-0.6b-bf16-K16"),
}
MB = 1e6
OP = "linear"
COMPACT = "progressive"  # the codec of the tiered rows (issue 27)


def mp(db: Path, *args) -> list[str]:
    return [run.PY, "-m", "mergepipe.cli", *map(str, args[:1]), "--db", str(db), *map(str, args[1:])]


def served_files(model_dir: Path) -> list[Path]:
    return sorted(f for f in model_dir.iterdir() if f.is_file())


def download(urls_and_dests: list[tuple[str, str]], connections: int = 4) -> None:
    """GET each URL whole into its file (what a full download does), ``connections`` at a time."""
    import urllib3

    pool = urllib3.PoolManager(maxsize=connections)

    def one(item):
        url, dest = item
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        resp = pool.request("GET", url, preload_content=False)
        if resp.status != 200:
            raise SystemExit(f"{url}: HTTP {resp.status}")
        with open(dest, "wb") as fh:
            for chunk in resp.stream(1 << 20):
                fh.write(chunk)
        resp.release_conn()

    with ThreadPoolExecutor(connections) as ex:
        list(ex.map(one, urls_and_dests))


def mergekit_exe() -> Path:
    exe = Path(run.PY).parent / "mergekit-yaml"
    return exe if exe.exists() else run.ensure_mergekit(ROOT / "benchmarks" / "work" / "mergekit-venv")


def family_dirs(args, prof) -> tuple[Path, str, list[str]]:
    """(served root, family folder name, model names) -- an existing family is reused, never rewritten."""
    if prof["family"] and (Path(args.family_root) / prof["family"] / f"expert_{prof['k']}" / "config.json").exists():
        root, name = Path(args.family_root), prof["family"]
    else:
        fam = run.ensure_family(Path(args.work), prof["size"], prof["dtype"], prof["k"])
        root, name = fam["root"].parent, fam["root"].name
    return root, name, ["base"] + [f"expert_{i}" for i in range(1, prof["k"] + 1)]


def measured(server: RangeServer, label: str, cmd: list[str], models: list[Path], env: dict, rows: list) -> dict:
    run.cold(models)
    server.reset()
    r = run.measure(cmd, env=env)
    row = {"contender": label, "wall_s": r["wall_s"], "transferred_bytes": server.total_bytes(),
           "requests": server.total_requests(), "peak_rss_bytes": r["peak_rss_bytes"], "stdout": r["stdout"][-600:]}
    rows.append(row)
    print(f"[remote] {label}: {row['wall_s']:.2f} s, {row['transferred_bytes'] / MB:.1f} MB in "
          f"{row['requests']} requests", flush=True)
    return row


def local_merge(work: Path, names: list[str], models: list[Path]) -> Path:
    """The same 100 % merge from the served files on local disk (unmeasured): the bit-for-bit reference."""
    cat = run.Catalog(work / "local.sqlite")
    run.register(cat, "base", str(models[0]))
    for n, m in zip(names[1:], models[1:]):
        run.register(cat, n, str(m), base_id="base")
    run.analyze(cat)
    plan = run.Planner(cat).plan("base", names[1:], OP, budget="100%")
    cat.close()
    out = work / "local-100"
    run.measure(mp(work / "local.sqlite", "execute", plan.id, "--out", out))
    return out


def bench(args) -> dict:
    prof = PROFILES[args.profile]
    root, fam_name, names = family_dirs(args, prof)
    models = [root / fam_name / n for n in names]
    work = Path(tempfile.mkdtemp(prefix="mergepipe-remote-", dir=args.work))
    db = work / "remote.sqlite"
    rows: list[dict] = []
    result = {"profile": args.profile, "family": fam_name, "k": prof["k"], "mb_per_s": args.mbps,
              "family_bytes": sum(f.stat().st_size for m in models for f in served_files(m)),
              "expert_bytes": sum(f.stat().st_size for m in models[1:] for f in m.glob("*.safetensors")),
              "machine": run.machine_info() if hasattr(run, "machine_info") else platform.platform(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    with RangeServer(root, bandwidth=args.mbps * MB) as server:
        env = dict(os.environ, HF_ENDPOINT=server.url, PYTHONPATH=str(ROOT))
        uris = [f"hf://{fam_name}/{n}" for n in names]
        register = [run.PY, "-m", "mergepipe.cli", "register", "--db", str(db)]
        measured(server, "register base", register + [uris[0]], models, env, rows)
        measured(server, f"register {prof['k']} experts", register + ["--base", "base", *uris[1:]], models, env, rows)
        measured(server, "analyze (once per expert)", mp(db, "analyze"), models, env, rows)
        # the compact tier (issue 27): the same analysis storing each block's compact delta in files beside the
        # local catalog; a tiered plan then transfers only its exact blocks (and the base)
        measured(server, f"analyze --compact {COMPACT} (once per expert)", mp(db, "analyze", "--compact", COMPACT),
                 models, env, rows)
        os.environ["HF_ENDPOINT"] = server.url  # this process plans (headers only, from the catalog)
        cat = run.Catalog(db)
        plans = {(b, "off"): run.Planner(cat).plan("base", names[1:], OP, budget=b, compact="off")
                 for b in ("10%", "25%", "100%")}
        plans.update({(b, "auto"): run.Planner(cat).plan("base", names[1:], OP, budget=b, compact="auto")
                      for b in ("10%", "25%")})
        cat.close()
        outs = {}
        for (budget, mode), plan in plans.items():
            tiered = mode != "off"
            out = work / f"mp-{budget[:-1]}{'-tiered' if tiered else ''}"
            if not tiered:
                outs[budget] = out
            row = measured(server, f"mergepipe {'tiered ' if tiered else ''}merge {budget}",
                           mp(db, "execute", plan.id, "--out", out,
                              "--model-id", f"out-{budget[:-1]}{'-tiered' if tiered else ''}"), models, env, rows)
            row["planned_bytes"] = plan["estimate"]["base_read"] + plan["estimate"]["expert_read"]
            row["estimated_transfer_s"] = plan["transfer"]["seconds"]
            row["compact_bytes"] = plan["estimate"].get("compact_read", 0)  # read from local disk, not the link
            row["tiers"] = {t: v.get("blocks") for t, v in (plan.data.get("tiers") or {}).items()}
            row["error_bound"] = (plan["error_bound"] or {}).get("absolute")
            if budget != "100%":
                shutil.rmtree(out, ignore_errors=True)
        local = work / "download"
        items = [(f"{server.url}/{fam_name}/{m.name}/resolve/main/{f.name}", str(local / m.name / f.name))
                 for m in models for f in served_files(m)]
        spec = work / "download.json"
        spec.write_text(json.dumps(items))
        measured(server, "download everything", [run.PY, __file__, "--download", str(spec)], models, env, rows)
    result["checks"] = {}
    if not args.mergekit:
        result["checks"]["mergepipe 100% over HTTP vs mergepipe 100% on local disk"] = \
            run.compare_outputs(outs["100%"], local_merge(work, names, models))
    else:
        cfg = work / "mk.yml"
        cfg.write_text(run.mergekit_yaml(OP, local / "base", [local / n for n in names[1:]], 1.0))
        mko = work / "mergekit"
        run.cold([local])
        r = run.measure([str(mergekit_exe()), str(cfg), str(mko), "--copy-tokenizer"])
        rows.append({"contender": "mergekit-yaml on the local copy", "wall_s": r["wall_s"], "transferred_bytes": 0,
                     "requests": 0, "peak_rss_bytes": r["peak_rss_bytes"]})
        print(f"[remote] mergekit: {r['wall_s']:.2f} s", flush=True)
        result["checks"]["mergepipe 100% over HTTP vs mergekit on the download"] = run.compare_outputs(outs["100%"], mko)
    for row in rows:
        row.pop("stdout", None)
    shutil.rmtree(work, ignore_errors=True)
    return result


def machine_line(m) -> str:
    if isinstance(m, str):
        return m
    return f"{m['cpus']} CPUs, {m['memory_gib']} GiB RAM, torch {m['torch']}, Python {m['python']}"


def report(res: dict) -> str:
    rows = {r["contender"]: r for r in res["rows"]}
    mk = rows.get("mergekit-yaml on the local copy")
    base = rows["download everything"]["wall_s"] + (mk["wall_s"] if mk else 0.0)
    baseline = "download everything, then mergekit" if mk else "download everything (no merge)"
    lines = [f"# Remote checkpoints: merging from a {res['mb_per_s']:g} MB/s HTTP server", "",
             f"Run {res['started']} ({machine_line(res['machine'])}). "
             f"Family {res['family']}, base + K={res['k']} experts, {res['family_bytes'] / MB:.0f} MB served "
             f"({res['expert_bytes'] / MB:.0f} MB of expert weights), operator {OP}. A local HTTP server "
             f"(tests/remote_helpers.py) serves Hub-shaped URLs at {res['mb_per_s']:g} MB/s shared by all "
             "connections and counts the body bytes it sends; every contender is its own process and starts "
             "with the served files evicted from the page cache. One run (this machine is shared and noisy: "
             "compare the ratios).", "",
             f"Reproduce: `python benchmarks/remote.py{' --profile ci' if res['profile'] == 'ci' else ''} "
             f"--mbps {res['mb_per_s']:g}`", "",
             "| step | wall s | transferred MB | planned MB | requests | peak RSS MB | est. transfer s (EXPLAIN) "
             "| vs download+merge |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        vs = ""
        if r["contender"].startswith(("mergepipe merge", "mergepipe tiered merge")):
            vs = f"{base / r['wall_s']:.2f}x faster"
        est = "" if r.get("estimated_transfer_s") is None else f"{r['estimated_transfer_s']:.1f}"
        planned = f"{r['planned_bytes'] / MB:.1f}" if r.get("planned_bytes") else ""
        lines.append(f"| {r['contender']} | {r['wall_s']:.2f} | {r['transferred_bytes'] / MB:.1f} | {planned} | {r['requests']} | "
                     f"{r['peak_rss_bytes'] / MB:.0f} | {est} | {vs} |")
    lines.append(f"| **{baseline}** (sum) | {base:.2f} | "
                 f"{rows['download everything']['transferred_bytes'] / MB:.1f} | "
                 f"| {rows['download everything']['requests']} | | | 1.00x |")
    lines += tiered_section(res, rows)
    lines += ["", "Checks:"]
    lines += [f"- {name}: {c.get('differing')} of {c.get('total')} values differ (max |diff| {c.get('max_abs')})."
              for name, c in res["checks"].items()]
    lines += [
              f"- Expert bytes planned at 10 %: {rows['mergepipe merge 10%']['planned_bytes'] / MB:.1f} MB with the "
              f"base; transferred {rows['mergepipe merge 10%']['transferred_bytes'] / MB:.1f} MB.",
              "- Registration transferred the safetensors headers, the shard index and config.json only.",
              "- The estimated transfer time is EXPLAIN's tier model (storage/tiers.py) with its default http "
              "parameters (50 ms, 100 MB/s), not fitted to this link.",
              "- Coalescing-aware plans (fewer requests at equal bytes) are measured by "
              "benchmarks/remote_coalesce.py: [remote-coalesce.md](remote-coalesce.md)."]
    return "\n".join(lines) + "\n"


def tiered_section(res: dict, rows: dict) -> list[str]:
    """Exact-only vs tiered merges at 10 % and 25 % (issue 27): the compacts are local, only exact blocks move."""
    if not any(name.startswith("mergepipe tiered merge") for name in rows):
        return []
    plain, comp = rows.get("analyze (once per expert)"), rows.get(f"analyze --compact {COMPACT} (once per expert)")
    out = ["", f"Tiered merges (compact deltas, `analyze --compact {COMPACT}`; issue 27): the compact files live "
           "beside the local catalog, so a tiered plan transfers its exact blocks and the base only; its compact "
           "blocks are read from local disk." + (f" ANALYZE over the link with compacts took {comp['wall_s']:.2f} s "
           f"against {plain['wall_s']:.2f} s without ({comp['wall_s'] / plain['wall_s']:.2f}x)."
           if plain and comp else ""), "",
           "| budget | plan | wall s | wall vs exact-only | transferred MB | vs exact-only | planned over the link MB "
           "| compact MB (local) | blocks exact / compact / omitted | error bound |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for budget in ("10%", "25%"):
        exact = rows.get(f"mergepipe merge {budget}")
        for label, r in (("exact-only (`--no-compact`)", exact), ("tiered", rows.get(f"mergepipe tiered merge {budget}"))):
            if not r:
                continue
            t = r.get("tiers") or {}
            out.append(f"| {budget} | {label} | {r['wall_s']:.2f} | "
                       f"{r['wall_s'] / exact['wall_s'] if exact else float('nan'):.2f}x | "
                       f"{r['transferred_bytes'] / MB:.1f} | "
                       f"{r['transferred_bytes'] / exact['transferred_bytes'] if exact else float('nan'):.2f}x | "
                       f"{r['planned_bytes'] / MB:.1f} | {r.get('compact_bytes', 0) / MB:.1f} | "
                       f"{t.get('exact', '')} / {t.get('compact', '')} / {t.get('omitted', '')} | "
                       f"{'' if r.get('error_bound') is None else format(r['error_bound'], '.4g')} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="full")
    ap.add_argument("--mbps", type=float, default=100.0, help="server bandwidth, MB/s (all connections)")
    ap.add_argument("--family-root", default=str(ROOT / "benchmarks" / "work"),
                    help="folder holding an existing qwen3-0.6b-bf16-K16 family (reused read-only)")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--no-mergekit", dest="mergekit", action="store_false",
                    help="baseline: the download alone (no mergekit merge after it)")
    ap.add_argument("--download", help=argparse.SUPPRESS)  # child mode: a JSON list of [url, dest]
    args = ap.parse_args(argv)
    if args.download:
        download([tuple(x) for x in json.loads(Path(args.download).read_text())])
        return 0
    Path(args.work).mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = bench(args)
    stem = "remote" if args.profile == "full" else f"remote-{args.profile}"
    Path(args.out, f"{stem}.json").write_text(json.dumps(res, indent=2, default=str))
    Path(args.out, f"{stem}.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
