"""Where MergePipe's TIES differs from mergekit's, is it only where an expert's |delta| ties at its top-k cut-off?

Both keep exactly k = int(density n) entries of each delta; among entries tied at the cut-off MergePipe keeps the
first in flat order and mergekit whatever torch.topk picks (docs/operators.md). This script merges a generated
family with both at 100 % (density 0.2) and counts the differing output values, and those at a position where
some expert has more entries at or above its cut-off than k and its |delta| there equals the cut-off.

    python benchmarks/tie_check.py [--size medium] [--experts 2] [--work /tmp/tie-check]

Prints one JSON line; ``differ_elsewhere`` > 0 would mean a difference the tie rule does not explain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import run  # noqa: E402

DENSITY = 0.2


def merge_both(fam: Path, k: int, work: Path) -> tuple[Path, Path]:
    from mergepipe import api
    experts = [fam / f"expert_{i}" for i in range(1, k + 1)]
    cfg = work / "mergekit.yml"
    cfg.write_text(run.mergekit_yaml("ties", fam / "base", experts, DENSITY))
    mk, mp = work / "mergekit-out", work / "mergepipe-out"
    for out in (mk, mp):
        shutil.rmtree(out, ignore_errors=True)
    subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(cfg), str(mk), "--lazy-unpickle"],
                   check=True, capture_output=True)
    db = work / "catalog.sqlite"
    db.unlink(missing_ok=True)
    cat = api.Catalog(db)
    try:
        api.register(cat, "base", str(fam / "base"))
        for i, e in enumerate(experts, 1):
            api.register(cat, f"e{i}", str(e), base_id="base")
        api.merge(cat, "base", [f"e{i}" for i in range(1, k + 1)], mp, operator="ties", density=DENSITY,
                  budget="100%")
    finally:
        cat.close()
    return mk, mp


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def tied_at_cut(deltas: list, n: int):
    """Positions where some delta's |value| equals its top-k cut-off and the cut-off is tied (more than k entries
    at or above it)."""
    import torch
    k = max(1, int(DENSITY * n))
    mask = torch.zeros(n, dtype=torch.bool)
    for d in deltas:
        thr = torch.topk(d, k).values[-1]
        if int((d >= thr).sum()) > k:
            mask |= d == thr
    return mask


def count(fam: Path, k: int, mk: Path, mp: Path) -> dict:
    base = tensors(fam / "base")
    experts = [tensors(fam / f"expert_{i}") for i in range(1, k + 1)]
    ref, ours = tensors(mk), tensors(mp)
    res = {"values": 0, "differ": 0, "differ_at_a_tied_cut": 0}
    for name, a in ref.items():
        if not a.dtype.is_floating_point:
            continue
        differ = (a != ours[name]).flatten()
        res["values"] += a.numel()
        res["differ"] += int(differ.sum())
        if differ.any():
            deltas = [(e[name].float() - base[name].float()).flatten().abs() for e in experts]
            res["differ_at_a_tied_cut"] += int((differ & tied_at_cut(deltas, a.numel())).sum())
    res["differ_elsewhere"] = res["differ"] - res["differ_at_a_tied_cut"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--work", default="/tmp/tie-check")
    args = ap.parse_args(argv)
    from mergepipe.research.family import make_family
    work = Path(args.work)
    fam = work / f"family-{args.size}-K{args.experts}"
    if not (fam / f"expert_{args.experts}" / "config.json").exists():
        make_family(fam, experts=args.experts, size=args.size, dtype="bf16", seed=0)
    mk, mp = merge_both(fam, args.experts, work)
    print(json.dumps({"size": args.size, "experts": args.experts, "density": DENSITY, **count(fam, args.experts, mk, mp)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
