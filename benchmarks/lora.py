"""LoRA adapters vs full fine-tuned checkpoints as merge inputs, on a Qwen3-0.6B-shaped bf16 family.

Writes K PEFT-format LoRA adapters (r=16, fp32, every linear layer of every block: what
`peft.get_peft_model(..., LoraConfig(target_modules="all-linear"))` saves) for the family's base,
registers and analyzes them next to K full experts of the same family, and merges each set with TIES
at several budgets, cold cache, each merge its own process. Reports wall time, disk bytes read
(getrusage of the child), the planned expert bytes and the input bytes left in the page cache.

    python benchmarks/lora.py                      # K=4 (builds the K=4 family if missing, ~6 GB)
    python benchmarks/lora.py --family-k 16        # reuse the full profile's K=16 family
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.run import PY, cold, ensure_family, measure, resident_bytes  # noqa: E402
from mergepipe.analyze.runner import analyze  # noqa: E402
from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.planner.context import Planner  # noqa: E402
from mergepipe.catalog.models import register  # noqa: E402
from mergepipe.storage.safetensors import open_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_adapter(base_dir: Path, out: Path, seed: int, r: int = 16, alpha: int = 32) -> None:
    """A PEFT LoRA adapter directory with random A and B (B non-zero, as after training)."""
    if (out / "adapter_model.safetensors").exists():
        return
    base = open_checkpoint(base_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, info in sorted(base.tensors.items()):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not any(module.endswith(m) for m in MODULES):
            continue
        n_out, n_in = info.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) / n_in ** 0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * 2e-3
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "target_modules": sorted({m.split(".")[-1] for m in MODULES}),
        "base_model_name_or_path": str(base_dir), "task_type": "CAUSAL_LM", "bias": "none"}, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="experts per set")
    ap.add_argument("--family-k", type=int, default=4, help="use the work dir's qwen3-0.6b bf16 family with this K")
    ap.add_argument("--budgets", nargs="+", default=["10%", "25%", "100%"])
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "lora"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    fam = ensure_family(work, "qwen3-0.6b", "bf16", args.family_k)
    adapters = [work / "lora-qwen3" / f"adapter_{i}" for i in range(1, args.k + 1)]
    for i, a in enumerate(adapters):
        write_adapter(fam["base"], a, seed=i)
    db = work / f"lora-qwen3-K{args.k}.sqlite"
    cat = Catalog(db)
    register(cat, "base", str(fam["base"]))
    sets = {"full": [f"e{i}" for i in range(1, args.k + 1)], "lora": [f"lora{i}" for i in range(1, args.k + 1)]}
    for eid, path in zip(sets["full"], fam["experts"]):
        register(cat, eid, str(path), base_id="base")
    for eid, path in zip(sets["lora"], adapters):
        register(cat, eid, str(path), base_id="base", kind="lora")
    analyzed = {}
    for kind, ids in sets.items():
        t0 = time.perf_counter()
        res = analyze(cat, ids, block_bytes=1 << 20)
        analyzed[kind] = {"seconds": round(time.perf_counter() - t0, 2), "bytes_read": sum(r.bytes_read for r in res),
                          "skipped": all(r.skipped for r in res)}
    inputs = {"full": [fam["base"], *fam["experts"][:args.k]], "lora": [fam["base"], *adapters]}
    results = {"machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                           "torch": torch.__version__},
               "k": args.k, "op": "ties", "density": 0.5, "analyze": analyzed,
               "input_bytes": {k: sum(open_checkpoint(p).nbytes if k == "full" or p == fam["base"] else
                                      (p / "adapter_model.safetensors").stat().st_size for p in v)
                               for k, v in inputs.items()},
               "runs": []}
    outdir = work / "lora-out"
    outdir.mkdir(exist_ok=True)
    for kind, ids in sets.items():
        for budget in args.budgets:
            plan = Planner(cat).plan("base", ids, "ties", density=0.5, budget=budget)
            out = outdir / f"{kind}-{budget.rstrip('%')}"
            shutil.rmtree(out, ignore_errors=True)
            cold(inputs[kind])
            r = measure([PY, "-m", "mergepipe.cli", "--db", str(db), "execute", plan.id, "--out", str(out),
                         "--model-id", f"{out.name}-{time.time_ns()}"])
            r.pop("stdout", None)
            r["input_bytes_in_cache"] = resident_bytes(inputs[kind])
            results["runs"].append({"experts": kind, "budget": budget, "planned_expert_bytes": plan["estimate"]["expert_read"],
                                    "full_expert_bytes": plan["full_expert_bytes"],
                                    "base_bytes": plan["estimate"]["base_read"], **r})
            print(json.dumps(results["runs"][-1]), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    cat.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(render(results))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


def render(res: dict) -> str:
    gb = 1e9
    lines = [f"# LoRA adapters vs full experts as merge inputs (Qwen3-0.6B-shaped bf16, K={res['k']}, "
             f"TIES density {res['density']})", "",
             "Written by `python benchmarks/lora.py`. Cold cache; each merge its own process; bytes from getrusage.", "",
             f"Input bytes: full experts + base {res['input_bytes']['full'] / gb:.2f} GB; "
             f"LoRA adapters (r=16, fp32, all linear layers) + base {res['input_bytes']['lora'] / gb:.2f} GB.", "",
             "| experts | analyze s | analyze bytes read |", "|---|---|---|"]
    for kind, a in res["analyze"].items():
        lines.append(f"| {kind} | {a['seconds']} | {a['bytes_read'] / gb:.2f} GB |")
    lines += ["", "| experts | budget | planned expert GB | disk read GB | inputs in page cache GB | wall s | peak RSS GB |",
              "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['experts']} | {r['budget']} | {r['planned_expert_bytes'] / gb:.3f} | {r['read_bytes'] / gb:.3f} | "
                     f"{r['input_bytes_in_cache'] / gb:.3f} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / gb:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
