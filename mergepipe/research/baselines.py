"""The naive full-read baseline: load every tensor of the base and of every expert whole, merge whole
tensors, write the output. It is what merge scripts do today ((K+1) x model bytes read whatever the
density) and, written independently of the block engine, the reference the tests compare against.

Whole-tensor semantics of the brief: top-k thresholds by ``torch.topk`` on the whole tensor, sign
election and divisors per element. Random operators draw the same per-(seed, expert block content, tensor,
block) streams as the engine (the grid only decides which generator covers which rows), so full-budget
results can be compared exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.ops.core import get_op
from mergepipe.ops.spec import OpSpec
from mergepipe.ops.streams import block_seed, content_id, l1_ratio, uniform
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import FLOAT_DTYPES, open_checkpoint


def kth_largest(absd: torch.Tensor, k: int) -> float:
    if k <= 0:
        return float("inf")
    if k > int(torch.count_nonzero(absd)):
        return 0.0
    return float(torch.topk(absd.reshape(-1), k).values[-1])


def _block_ids(info, block_bytes, raw: torch.Tensor) -> list[str]:
    """The content identity of each block of the expert tensor ``raw`` (as stored): ops.streams.content_id."""
    flat = raw.contiguous()
    return [content_id([flat[span.row_start:span.row_end].reshape(-1).view(torch.uint8).numpy().tobytes()])
            for span in tensor_grid(info, block_bytes)]


def _per_block_uniform(info, block_bytes, seed, ids, shape2d):
    parts = []
    for span, cid in zip(tensor_grid(info, block_bytes), ids):
        rows = span.row_end - span.row_start
        bshape = (rows, *info.shape[1:]) if len(info.shape) >= 2 else (rows,)
        parts.append(uniform(block_seed(seed, cid, info.name, span.index), bshape).reshape(-1))
    return torch.cat(parts).reshape(shape2d) if parts else torch.zeros(shape2d)


def reference_sparsify(op: OpSpec, info, delta: torch.Tensor, density: float, params: dict, seed: int,
                       raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """``raw``: the expert's tensor as stored (its blocks' bytes seed the random operators)."""
    n = delta.numel()
    a = delta.abs()
    if op.sparsify is None or density >= 1.0:
        return delta
    if op.sparsify == "magnitude":  # exactly the top k = max(1, int(d n)), ties by flat index (stable sort)
        k = max(1, int(density * n))
        order = torch.sort(a.reshape(-1), descending=True, stable=True).indices
        mask = torch.zeros(n, dtype=torch.bool)
        mask[order[:k]] = True
        kept = torch.where(mask.reshape(delta.shape), delta, 0.0)
        if params["rescale"]:  # mergekit: per tensor, L1 of the top k
            org, new = float(a.double().sum()), float(a.reshape(-1)[order[:k]].double().sum())
            if org >= 1e-7 and new >= 1e-7:
                kept = kept * (org / new)
        return kept
    if op.sparsify == "magnitude_outliers":  # mergekit: ranks [k_hi, k_hi + int(d n)) of the same order
        target, n_top = int(density * n), int(params["gamma"] * n)
        k_hi = min(n_top, n - target)
        order = torch.sort(a.reshape(-1), descending=True, stable=True).indices
        mask = torch.zeros(n, dtype=torch.bool)
        mask[order[k_hi:k_hi + target]] = True
        kept = torch.where(mask.reshape(delta.shape), delta, 0.0)
        return _rescale_blocks(info, delta, kept, block_bytes) if params["rescale"] else kept
    ids = _block_ids(info, block_bytes, raw)
    if op.sparsify == "random":
        u = _per_block_uniform(info, block_bytes, seed, ids, delta.shape)
        kept = torch.where(u < density, delta, 0.0)
        return _rescale_blocks(info, delta, kept, block_bytes) if params["rescale"] else kept
    if op.sparsify == "della":
        eps = params["epsilon"]
        kept_all = torch.zeros_like(delta)
        for span, cid in zip(tensor_grid(info, block_bytes), ids):
            rows = delta[span.row_start:span.row_end] if delta.dim() else delta
            r2 = rows.reshape(rows.shape[0], -1) if rows.dim() >= 2 else rows.reshape(1, -1)
            m = r2.shape[1]
            # rank of each |value| within its row (0 = smallest), ties by position; mergekit's r / (m - 1)
            order = torch.sort(r2.abs(), dim=1, stable=True).indices
            ranks = torch.empty_like(order)
            ranks.scatter_(1, order, torch.arange(m).expand_as(order).contiguous())
            p = ((density - eps) + (ranks.float() / (m - 1)).clamp(0, 1) * 2 * eps) if m > 1 else torch.full_like(r2, density)
            u = uniform(block_seed(seed, cid, info.name, span.index), r2.shape)
            kept_all[span.row_start:span.row_end] = torch.where(u < p, r2, 0.0).reshape(rows.shape)
        return _rescale_blocks(info, delta, kept_all, block_bytes) if params["rescale"] else kept_all
    raise AssertionError(op.sparsify)


def _rescale_blocks(info, delta, kept, block_bytes):
    out = kept.clone()
    for span in tensor_grid(info, block_bytes):
        d, k = delta[span.row_start:span.row_end], kept[span.row_start:span.row_end]
        ratio = l1_ratio(d, k)  # the engine's per-block L1 norms (float64, fixed summation order)
        if ratio is not None:
            out[span.row_start:span.row_end] = k * ratio
    return out


def reference_tensor(op: OpSpec, params: dict, base: torch.Tensor, deltas: list[torch.Tensor],
                     weights: list[float]) -> torch.Tensor:
    """Whole-tensor merge of already sparsified deltas (float32)."""
    lam = params["lambda"]
    w = torch.tensor(weights, dtype=torch.float32).view(-1, *[1] * base.dim())
    stacked = torch.stack(deltas) * w
    if op.consensus:
        sign = torch.where(stacked.sum(0) >= 0, 1.0, -1.0)
        mask = stacked.sign() == sign
        mixed = (stacked * mask).sum(0)
        divisor = (w * mask).sum(0)
        divisor[divisor == 0] = 1.0
    else:
        mixed = stacked.sum(0)
        divisor = torch.tensor(float(sum(weights)))
        if divisor.abs() < 1e-8:
            divisor = torch.tensor(1.0)
    if params["normalize"]:
        mixed = mixed / divisor
    mixed = mixed * lam
    if op.whole_models and not params["normalize"]:
        return base * float(sum(weights)) + mixed
    return base + mixed


def naive_merge(base_dir, expert_dirs, out_dir, operator: str = "linear", weights=None, densities=None,
                params: dict | None = None, seed: int = 0, block_bytes: int = 1 << 20, expert_ids=None,
                expert_kinds=None) -> dict:
    """Full-read merge into ``out_dir`` (one safetensors file); returns {'tensors': {name: tensor}?}."""
    from mergepipe.ops.core import resolve_params
    op = get_op(operator)
    params = params or resolve_params(op)
    k = len(expert_dirs)
    weights = list(weights or [1.0] * k)
    densities = list(densities or [1.0] * k)
    expert_ids = list(expert_ids or [Path(d).name for d in expert_dirs])
    kinds = list(expert_kinds or ["full"] * k)
    base_ck = open_checkpoint(base_dir)
    exp_cks = [open_checkpoint(d) for d in expert_dirs]
    result = {}
    for name, info in sorted(base_ck.tensors.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
        base = _load(base_ck, info.file, name)
        if info.dtype not in FLOAT_DTYPES:
            result[name] = base
            continue
        b32 = base.float()
        deltas = []
        for i, ck in enumerate(exp_cks):
            raw = _load(ck, ck.tensors[name].file, name)
            x = raw.float()
            d = x if kinds[i] == "delta" else x - b32
            deltas.append(reference_sparsify(op, info, d, densities[i], params, seed, raw, block_bytes))
        result[name] = reference_tensor(op, params, b32, deltas, weights).to(base.dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    if base_ck.root.is_dir():
        for extra in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json"):
            if (base_ck.root / extra).exists():
                shutil.copyfile(base_ck.root / extra, out / extra)
    return {"out": str(out), "tensors": len(result)}


def _load(ck, fname: str, name: str) -> torch.Tensor:
    path = ck.root / fname if ck.root.is_dir() else ck.root
    with safe_open(str(path), framework="pt") as fh:
        return fh.get_tensor(name)


def main(argv=None) -> int:
    """``python -m mergepipe.baselines BASE OUT --experts E1 E2 --op ties --density 0.2`` (benchmarks)."""
    import argparse
    ap = argparse.ArgumentParser(prog="mergepipe.baselines")
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--experts", nargs="+", required=True)
    ap.add_argument("--op", default="linear")
    ap.add_argument("--weights", nargs="*", type=float)
    ap.add_argument("--density", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--expert-ids", nargs="*", help="(ignored: random operators are seeded by the experts' block contents)")
    a = ap.parse_args(argv)
    res = naive_merge(a.base, a.experts, a.out, a.op, a.weights, [a.density] * len(a.experts), seed=a.seed,
                      block_bytes=a.block_bytes, expert_ids=a.expert_ids)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
