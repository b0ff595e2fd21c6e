"""Micro-benchmark of the block merge kernels: the torch path (ops.sparsify + ops.combine, what
Engine._merge_block ran before the fused kernels) against the fused numba kernel (kernels.fused_merge),
on in-memory blocks of realistic shape, one thread (the engine runs one single-threaded worker per core).

Reports GB/s of expert input (K x block bytes per second of CPU time of the merging thread; the best of
``--reps``, as the machine is shared) and checks that both give the same bytes.

    python benchmarks/kernels.py [--ks 2 4 16] [--ops ties dare_ties linear] [--dtype bf16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mergepipe.ops import kernels  # noqa: E402
from mergepipe.engine.blocks import tensor_bytes  # noqa: E402
from mergepipe.ops.streams import block_seed  # noqa: E402
from mergepipe.ops.core import combine, get_op, resolve_params, sparsify  # noqa: E402
from mergepipe.storage.safetensors import DTYPES, bytes_to_tensor  # noqa: E402

CODES = {"bf16": "BF16", "fp32": "F32"}


def torch_block(spec, params, base_raw, dtype, shape, contributions, weight_sum, before=False):
    """Engine._merge_block's torch path for full checkpoints. ``before``: with DARE's random stream and
    L1 norms as they were before the fused kernels (torch.Generator uniforms, torch float64 sums)."""
    base = bytes_to_tensor(base_raw, dtype, shape).float()
    deltas = []
    for raw, edtype, _is_delta, w, density, thr, seed in contributions:
        delta = torch.sub(bytes_to_tensor(raw, edtype, shape), base)
        if before and spec.sparsify == "random" and density < 1.0:
            kept = delta * (torch.rand(delta.shape, generator=torch.Generator().manual_seed(seed)) < density)
            if params["rescale"]:
                org = float(delta.abs().sum(dtype=torch.float64))
                new = float(kept.abs().sum(dtype=torch.float64))
                kept = kept * (org / new) if org >= 1e-8 and new >= 1e-8 else kept
            deltas.append((w, kept))
        else:
            deltas.append((w, sparsify(spec, delta, density, params, thr, seed)))
    return tensor_bytes(combine(spec, base, deltas, weight_sum, params).to(DTYPES[dtype][0]))


def fused_block(spec, params, base_raw, dtype, shape, contributions, weight_sum):
    return memoryview(kernels.fused_merge(spec, params, base_raw, dtype, int(np.prod(shape)), contributions,
                                          weight_sum))


def make_block(rng, shape, dtype: str, k: int, density: float):
    """A base block ~ N(0, 0.02) and k fine-tuned experts: base + N(0, 0.002), in ``dtype``."""
    tdt = DTYPES[dtype][0]
    base = (torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)) * 0.02).to(tdt)
    base_raw = bytearray(tensor_bytes(base))
    contributions = []
    for i in range(k):
        x = (base.float() + torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)) * 0.002).to(tdt)
        d = (x.float() - base.float()).abs().reshape(-1)
        kk = max(1, int(density * d.numel()))
        thr = [float(torch.topk(d, kk).values[-1])]
        contributions.append((bytearray(tensor_bytes(x)), dtype, False, 1.0 / k + 0.01 * i, density, thr,
                              block_seed(0, f"e{i}", "layer.weight", 0)))
    return base_raw, contributions


def best_cpu_seconds(fn, reps: int) -> float:
    fn()  # warm-up (and numba compile on a cold cache)
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 16])
    ap.add_argument("--ops", nargs="+", default=["ties", "dare_ties", "linear"])
    ap.add_argument("--dtype", choices=sorted(CODES), default="bf16")
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--cols", type=int, default=1024, help="row length (Qwen3-0.6B hidden size)")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = CODES[a.dtype]
    rows = max(1, a.block_bytes // (a.cols * DTYPES[dtype][1]))
    shape = (rows, a.cols)
    block_bytes = rows * a.cols * DTYPES[dtype][1]
    rng = np.random.default_rng(0)
    results = []
    print(f"block {shape} {a.dtype} ({block_bytes / 2**20:.2f} MiB), density {a.density}, 1 thread, "
          f"GB/s of expert input (best of {a.reps})")
    print("before: the torch path as it was (torch.Generator uniforms for DARE); torch: the same path with the\n"
          "counter-based uniforms; fused: kernels.fused_merge; same bytes: torch == fused")
    print(f"{'op':<16}{'K':>4}{'before GB/s':>13}{'torch GB/s':>12}{'fused GB/s':>12}{'vs before':>10}  same bytes")
    for k in a.ks:
        base_raw, contributions = make_block(rng, shape, dtype, k, a.density)
        for name in a.ops:
            spec = get_op(name)
            params = resolve_params(spec)
            wsum = sum(c[3] for c in contributions)
            args = (spec, params, base_raw, dtype, shape, contributions, wsum)
            same = bytes(torch_block(*args)) == bytes(fused_block(*args))
            t_before = best_cpu_seconds(lambda: torch_block(*args, before=True), a.reps)
            t_old = best_cpu_seconds(lambda: torch_block(*args), a.reps)
            t_new = best_cpu_seconds(lambda: fused_block(*args), a.reps)
            gb = k * block_bytes / 1e9
            row = {"op": name, "k": k, "dtype": a.dtype, "block_shape": list(shape), "before_gbps": gb / t_before,
                   "torch_gbps": gb / t_old, "fused_gbps": gb / t_new, "speedup": t_before / t_new, "identical": same}
            results.append(row)
            print(f"{name:<16}{k:>4}{row['before_gbps']:>13.2f}{row['torch_gbps']:>12.2f}{row['fused_gbps']:>12.2f}"
                  f"{row['speedup']:>9.1f}x  {same}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
