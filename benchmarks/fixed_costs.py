"""Fixed costs of the command line: process start, imports and numba's kernel loading, per command, on a tiny
family (the tensor work is negligible there, so what is measured is what every run of the command pays).

    python benchmarks/fixed_costs.py                       # this checkout -> docs/benchmarks/fixed-costs.{md,json}
    python benchmarks/fixed_costs.py --compare /tmp/old    # and another checkout of MergePipe, side by side
    python benchmarks/fixed_costs.py --runs 3 --out /tmp/x # quicker, elsewhere

Each command runs ``--runs`` times (default 5), each in a fresh interpreter, after one unmeasured run (it
writes Python's bytecode caches and numba's kernel cache, as the first run after an install does), the
checkouts taking turns run by run; reported:
the median wall time and the median CPU time (user + system) of the child, from ``os.wait4``. Bytecode caches
are on for the children (``PYTHONDONTWRITEBYTECODE`` removed), as in a normal install. Commands that change
the catalog or write a snapshot run on a fresh copy of the catalog, made outside the measured time. The
import rows time ``python -c "import X"`` the same way (``numba kernels``: import and load every fused kernel
from numba's cache, ``kernels.warm_up``). The machine is shared: read CPU time before wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
EXPERTS = ["expert_1", "expert_2", "expert_3"]
MERGE = ["--base", "base", "--experts", *EXPERTS, "--op", "ties", "--density", "0.5", "--budget", "50%"]
IMPORTS = {
    "python -c pass": "pass",
    "import mergepipe.cli.app": "import mergepipe.cli.app",
    "import numpy": "import numpy",
    "import numba": "import numba",
    "numba kernels (import + cache load)": "from mergepipe.ops import kernels; kernels.warm_up()",
    "import torch": "import torch",
}


def child_env(src: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "MERGEPIPE_DB")}
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    return env


def timed(argv: list[str], env: dict, cwd: Path) -> dict:
    """Wall and CPU seconds of one child process (rusage from os.wait4); its exit status must be 0."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.decode()[-3000:]}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime}


def setup(work: Path, env: dict) -> dict:
    """A tiny bf16 family (base + 3 experts), a catalog with it registered (``registered.sqlite``) and one
    with the experts analyzed too (``analyzed.sqlite``), and a stored plan and a snapshot to read."""
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "mergepipe"]
    fam = work / "family"
    if not (fam / "expert_3" / "config.json").exists():
        shutil.rmtree(fam, ignore_errors=True)
        subprocess.run([*cli, "make-family", str(fam), "--experts", "3", "--size", "tiny", "--dtype", "bf16"],
                       env=env, check=True, capture_output=True, cwd=work)
    reg, ana = work / "registered.sqlite", work / "analyzed.sqlite"
    for db in (reg, ana):
        for f in work.glob(db.name + "*"):
            f.unlink()
    run = lambda db, *a: subprocess.run([*cli, "--db", str(db), *a], env=env, check=True,  # noqa: E731
                                        capture_output=True, text=True, cwd=work).stdout
    run(reg, "register", str(fam / "base"))
    run(reg, "register", "--base", "base", *(str(fam / e) for e in EXPERTS))
    shutil.copy(reg, ana)
    run(ana, "analyze", *EXPERTS)
    plan_id = json.loads(run(ana, "--json", "plan", *MERGE))["plan_id"]
    shutil.rmtree(work / "snap", ignore_errors=True)
    run(ana, "merge", *MERGE, "--out", str(work / "snap"))
    return {"family": fam, "registered": reg, "analyzed": ana, "plan": plan_id, "snapshot": work / "snap"}


def commands(s: dict) -> dict:
    """name -> (argv after ``mergepipe``, which catalog a fresh copy is made of, or None: the shared one).
    ``{db}`` is the catalog, ``{out}`` a fresh output directory."""
    fam = s["family"]
    return {
        "--help": (["--help"], None),
        "init-db": (["--db", "{new}", "init-db"], None),
        "models": (["--db", "{db}", "models"], None),
        "register (a base)": (["--db", "{new}", "register", str(fam / "base")], None),
        "register --base (an expert)": (["--db", "{db}", "register", "--model-id", "extra", "--base", "base",
                                        str(fam / "expert_1")], "registered"),
        "analyze (3 experts)": (["--db", "{db}", "analyze", *EXPERTS], "registered"),
        "plan": (["--db", "{db}", "plan", *MERGE], "analyzed"),
        "explain (plan)": (["--db", "{db}", "explain", s["plan"]], None),
        "explain (snapshot)": (["--db", "{db}", "explain", "snap"], None),
        "merge (ties, 50 %)": (["--db", "{db}", "merge", *MERGE, "--out", "{out}"], "analyzed"),
        "first merge (unanalyzed)": (["--db", "{db}", "merge", *MERGE, "--out", "{out}"], "registered"),
        "execute (stored plan)": (["--db", "{db}", "execute", s["plan"], "--out", "{out}"], "analyzed"),
        "verify": (["--db", "{db}", "verify", str(s["snapshot"])], None),
        "snapshots": (["--db", "{db}", "snapshots"], None),
    }


def one_run(argv: list[str], fresh: str | None, s: dict, env: dict, work: Path) -> dict:
    scratch = work / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    db = scratch / "c.sqlite" if fresh else s["analyzed"]
    if fresh:
        shutil.copy(s[fresh], db)
    args = [a.format(db=db, new=scratch / "new.sqlite", out=scratch / "out") for a in argv]
    return timed([sys.executable, "-m", "mergepipe", *args], env, work)


def summary(samples: list[dict]) -> dict:
    return {"wall_s": round(statistics.median(x["wall_s"] for x in samples), 3),
            "cpu_s": round(statistics.median(x["cpu_s"] for x in samples), 3), "runs": len(samples)}


def measure(checkouts: dict, runs: int) -> dict:
    """label -> (source, work dir): every command and import timed ``runs`` times per checkout after one
    warm-up, the checkouts taking turns run by run, so that a machine growing busier or quieter weighs on
    every checkout alike."""
    ready = {label: (child_env(src), work) for label, (src, work) in checkouts.items()}
    setups = {label: setup(work, env) for label, (env, work) in ready.items()}

    def command(name: str):
        return lambda label: one_run(*commands(setups[label])[name], setups[label], *ready[label])

    def import_of(code: str):
        return lambda label: timed([sys.executable, "-c", code], *ready[label])

    steps = {"commands": {name: command(name) for name in commands(next(iter(setups.values())))},
             "imports": {name: import_of(code) for name, code in IMPORTS.items()}}
    results = {label: {"src": str(src), "commands": {}, "imports": {}} for label, (src, _) in checkouts.items()}
    for kind, named in steps.items():
        for name, step in named.items():
            samples = {label: [] for label in checkouts}
            for i in range(runs + 1):  # the first round is a warm-up
                for label in checkouts:
                    sample = step(label)
                    if i:
                        samples[label].append(sample)
            for label in checkouts:
                results[label][kind][name] = summary(samples[label])
            print(f"  {name:36s} " + "  ".join(f"{lab}: {results[lab][kind][name]['wall_s']:.3f} s"
                                              for lab in checkouts), flush=True)
    return results


def table(results: dict, key: str, names: list[str]) -> list[str]:
    labels = list(results)
    head = "| " + " | ".join(["", *(f"{lab}: wall s" for lab in labels), *(f"{lab}: CPU s" for lab in labels)]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(labels))]
    for name in names:
        vals = [results[lab][key][name] for lab in labels]
        lines.append("| " + " | ".join([name, *(f"{v['wall_s']:.3f}" for v in vals),
                                          *(f"{v['cpu_s']:.3f}" for v in vals)]) + " |")
    return lines


def write_docs(results: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fixed-costs.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    first = next(iter(results.values()))
    lines = ["# Fixed costs of the command line", "",
             "What every run of a command pays before and around its work: the interpreter's start, imports, and "
             "for the commands that merge, loading the fused kernels from numba's on-disk cache. Measured on a "
             "tiny family (base + 3 bf16 experts of ~107k parameters, so the tensor work is negligible) by "
             "`python benchmarks/fixed_costs.py`: the median of "
             f"{meta['runs']} fresh processes per command after one unmeasured run, wall and CPU (user + system, "
             "from `os.wait4`) of the child, bytecode caches on; the checkouts take turns run by run, so that a machine "
             "growing busier or quieter weighs on each alike. CPU time is the steadier number.", "",
             f"Measured {meta['date']} on {meta['machine']}; columns: {', '.join(f'`{k}` = {v}' for k, v in meta['labels'].items())}.",
             "", "## Commands", "", *table(results, "commands", list(first["commands"])), "",
             "## Imports", "", *table(results, "imports", list(first["imports"])), "",
             "## Reading it", "",
             "A merge of bf16/fp32 safetensors with linear, task arithmetic, TIES, DARE, breadcrumbs or DELLA never "
             "imports torch (the fused kernels do the tensor work; `tests/test_no_torch.py`). What remains of its "
             "fixed cost is mostly numba: importing it and building its CPU target before the first cached kernel "
             "loads, which no cache avoids. The commands that do no tensor work import neither torch nor numba."]
    (out / "fixed-costs.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another MergePipe checkout, measured side by side (run by run)")
    ap.add_argument("--compare-label", default="before")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", type=Path, default=DOCS)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "fixed-costs")
    args = ap.parse_args(argv)
    pairs = ([(args.compare_label, args.compare)] if args.compare else []) + [(args.label, ROOT)]
    checkouts = {label: (src.resolve(), args.work / "".join(c if c.isalnum() else "-" for c in label))
                 for label, src in pairs}
    results = measure(checkouts, args.runs)
    labels = {label: str(src) for label, src in pairs}
    meta = {"runs": args.runs, "date": time.strftime("%Y-%m-%d"), "labels": labels,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"}
    write_docs(results, meta, args.out)
    print(f"wrote {args.out / 'fixed-costs.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
