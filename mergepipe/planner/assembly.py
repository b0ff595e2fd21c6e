"""Assembling a plan from a PlanContext and a selection of candidate blocks: the access set (block ranges
per expert and tensor), the digest over the inputs (its ``core``), and what follows from the catalog
outside the digest (estimates, transfer per storage tier, tiers, coalescing, warnings).

A key enters the core only when it says something a merge needs: keys added for later features are
written only when set, so that earlier plans keep their digests."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from mergepipe.errors import MergePipeError, PlanError
from mergepipe.manifest.build import canonical
from mergepipe.planner import methods, vocab_rows
from mergepipe.planner.candidates import tensor_info
from mergepipe.planner.plan import PLAN_FORMAT, Plan, compact_ranges
from mergepipe.planner.tiers import NO_COMPACTS, compact_store, tier_summary
from mergepipe.storage.dtypes import FLOAT_DTYPES, ITEMSIZE
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.moe_layout import fused_order, has_per_expert
from mergepipe.storage.safetensors import TensorInfo
from mergepipe.storage.tiers import transfer_estimate
from mergepipe.version import __version__

# the error bound of a first merge of an additive operator: every block is read, nothing omitted
_NOTHING_OMITTED = {"absolute": 0.0, "full_delta_norm": None, "relative": 0.0, "blockwise": 0.0,
                    "blockwise_relative": 0.0, "additive": 0.0, "additive_relative": 0.0, "kind": "blockwise"}


def build(ctx, chosen: np.ndarray, budget_spec: str, budget_bytes: int, target_bound,
          first_merge: bool = False, greedy: np.ndarray | None = None, tier: np.ndarray | None = None) -> Plan:
    """The plan reading the candidates ``chosen`` (``tier``: a three-way plan's tier per candidate;
    ``greedy``: the selection before coalescing)."""
    cands = ctx.candidates
    access, per_expert_bytes, per_tensor_bytes = access_of(ctx, chosen)
    selected_mask = np.zeros(len(cands.nbytes), dtype=bool)
    selected_mask[chosen] = True
    bound = _error_bound(ctx, selected_mask, tier)
    nbytes_base = base_bytes(ctx)
    budget = {"spec": budget_spec, "bytes": budget_bytes, **({"first_merge": True} if first_merge else {})}
    compact, core = _core(ctx, chosen, access, budget, tier)
    digest = hashlib.sha256(canonical(core)).hexdigest()
    data = dict(core)
    data.update({
        "id": "plan-" + digest[:16],
        "digest": "sha256:" + digest,
        "full_expert_bytes": cands.full_bytes + sum(ctx.vocab_bytes.values()),
        "estimate": {"base_read": nbytes_base, "expert_read": sum(per_expert_bytes.values()),
                     "compact_read": compact["bytes"] if compact else 0, "output_write": output_bytes(ctx)},
        "expert_read_by_expert": per_expert_bytes,
        "expert_read_by_tensor": dict(sorted(per_tensor_bytes.items())),
        "blocks_selected": {e: sum(r[1] - r[0] for rs in ts.values() for r in rs) for e, ts in access.items()},
        "blocks_candidate": {e["id"]: int((cands.expert == i).sum()) + vocab_blocks(ctx)
                             for i, e in enumerate(ctx.experts)},
        "blocks_total": sum(len(tensor_grid(output_info(ctx, t), ctx.block_bytes)) for t in ctx.tensors),
        "error_bound": bound,
        "target_bound": target_bound,
        "software": {"mergepipe": __version__},
    })
    _outside_digest(ctx, data, selected_mask, compact, (access, per_expert_bytes, nbytes_base), greedy, chosen,
                    first_merge)
    return Plan(data)


def _error_bound(ctx, selected_mask: np.ndarray, tier: np.ndarray | None) -> dict | None:
    """The plan's error bound: additive (omitted blocks), sparsified, or None (interpolation, copies, a
    first merge of a sparsifying operator)."""
    if ctx.op.additive and ctx.to_analyze:  # every block is read: nothing omitted
        return dict(_NOTHING_OMITTED)
    if ctx.op.additive:
        residual = (ctx.tiers.residual(tier) if tier is not None
                    else np.where(selected_mask, 0.0, ctx.candidates.bound_term))
        return ctx._bound(residual)
    if not (ctx.op.nonlinear or ctx.op.copies or ctx.to_analyze):
        return ctx._sparsified_bound(selected_mask, tier)
    return None


def _core(ctx, chosen: np.ndarray, access: dict, budget: dict, tier: np.ndarray | None) -> tuple[dict | None, dict]:
    """(the compact tier's summary, the plan's core: what its digest covers)."""
    core = {
        "format": PLAN_FORMAT,
        "base": {"id": ctx.base["id"], "uri": ctx.base["uri"], "fingerprint": ctx.base["fingerprint"]},
        "experts": ctx.experts,
        "operator": ctx.op.name,
        "params": ctx.params,
        "seed": ctx.seed,
        "strategy": ctx.strategy,
        "grid": {"block_bytes": ctx.block_bytes},
        "budget": budget,
        "access": access,
        "thresholds": ctx.thresholds,
    }
    if ctx.request.tokenizer:  # only when set: plans of the base's tokenizer keep their digests
        core["tokenizer"] = ctx.request.tokenizer
    if ctx.output_layout is not None:  # a `slices:` config: which input tensor each output tensor is made of
        core["layout"] = ctx.output_layout
    if out_dtype(ctx):  # only when a float tensor is converted: other plans keep their digests
        core["out_dtype"] = out_dtype(ctx)
    if (moe := moe_setting(ctx)) is not None:  # a Mixtral/Qwen3-MoE base's per-expert matrices: how written
        core["moe_layout"] = moe
    if ctx.tensor_params:  # lambda/normalize/rescale per tensor (only then: other plans keep their digests)
        core["tensor_params"] = ctx.tensor_params
    if ctx.base_member:  # a soup: the base is averaged in (only then: other plans keep their digests)
        core["base_member"] = ctx.base_member
    compact = tier_summary(ctx, tier) if tier is not None else None
    if compact and compact["core"]:  # only when a block is read from the compact tier: other plans keep digests
        core["compact"] = compact["core"]
    if ctx.op.nonlinear:  # the interpolation methods' per-tensor scalars and budget-omitted blocks
        core["coefficients"] = ctx.method_scalars
        core["omitted"] = methods.omitted_blocks(ctx, chosen)
        if ctx.composed_settings:  # only then: other plans keep their digests
            core["composed_coefficients"] = ctx.composed_settings
    return compact, core


def _outside_digest(ctx, data: dict, selected_mask: np.ndarray, compact: dict | None, reads: tuple,
                    greedy: np.ndarray | None, chosen: np.ndarray, first_merge: bool) -> None:
    """What follows from the catalog and the request's settings, outside the digest (like the estimates)."""
    access, per_expert_bytes, nbytes_base = reads
    data["tiers"] = compact["tiers"] if compact else exact_tiers(ctx, selected_mask)
    if compact and compact["core"]:
        data["compact_read_by_expert"] = compact["by_expert"]
        data["compact_files"] = compact["files"]
    if ctx.request.compact != "auto":  # the request's setting (an exported config keeps it)
        data["compact_mode"] = ctx.request.compact
    if ctx.compact_note and (ctx.compact_note != NO_COMPACTS or not selected_mask.all()):
        data["compact_note"] = ctx.compact_note  # why no block comes from the compact tier
    data["transfer"] = transfer(ctx, access, per_expert_bytes, nbytes_base,
                                compact["reads"] if compact and compact["core"] else ())
    if ctx.op.additive and not ctx.to_analyze and not any(ctx.vocab_bytes.values()):
        data["suggested_budget"] = ctx.suggested_budget()
    if greedy is not None:  # the access set already says what is read
        data["coalesce"] = coalesce_note(ctx, greedy, chosen, data["transfer"])
    if first_merge and (store := compact_store(ctx)):  # the analysis on the way's compacts
        data["compact_store"] = store
    if ctx.warnings:  # they follow from the catalog, like the estimates
        data["warnings"] = list(ctx.warnings)
    if out_dtype(ctx):  # what the conversion changes in the output (EXPLAIN's dtype line)
        data["conversion"] = conversion_note(ctx)


def access_of(ctx, chosen: np.ndarray) -> tuple[dict, dict, dict]:
    """(block ranges per expert and tensor, bytes per expert, bytes per tensor) of a selection."""
    cands = ctx.candidates
    names = [t["name"] for t in ctx.tensors]
    access: dict[str, dict[str, list[int]]] = {e["id"]: {} for e in ctx.experts}
    per_expert_bytes = {e["id"]: 0 for e in ctx.experts}
    per_tensor_bytes: dict[str, int] = {}
    ids = [e["id"] for e in ctx.experts]
    for e, t, block, nbytes in zip(cands.expert[chosen].tolist(), cands.tensor[chosen].tolist(),
                                   cands.block[chosen].tolist(), cands.bytes_of(chosen).tolist()):
        eid, tname = ids[e], names[t]
        access[eid].setdefault(tname, []).append(int(block))
        per_expert_bytes[eid] += int(nbytes)
        per_tensor_bytes[tname] = per_tensor_bytes.get(tname, 0) + int(nbytes)
    access = {e: {t: compact_ranges(b) for t, b in sorted(ts.items())} for e, ts in access.items()}
    if ctx.vocab is not None and not ctx.vocab.get("copies"):  # every expert's embedding rows, in full
        rows = vocab_rows.access(ctx.tensors, ctx.vocab, ctx.block_bytes)
        for e in ctx.experts:
            access[e["id"]] = dict(sorted({**access[e["id"]], **rows}.items()))
            per_expert_bytes[e["id"]] += ctx.vocab_bytes[e["id"]]
        for e in ctx.experts:
            for t in rows:
                per_tensor_bytes[t] = per_tensor_bytes.get(t, 0) + next(
                    r["nbytes"] for r in ctx.catalog.tensors(e["id"]) if r["name"] == t)
    return access, per_expert_bytes, per_tensor_bytes


def transfer(ctx, access: dict, per_expert_bytes: dict, base_read: int, compact_reads=()) -> dict:
    """Estimated transfer per storage tier (storage/tiers.py): the base read in full, one request per
    tensor, and each expert's planned blocks, one request per contiguous run; compact records are read
    from the catalog's folder (local, whatever the expert's storage), one request each."""
    reads = [(ctx.base["uri"], base_read, len(ctx.tensors))]
    reads += [(e["uri"], per_expert_bytes[e["id"]], _runs(access[e["id"]])) for e in ctx.experts]
    reads += list(compact_reads)
    return transfer_estimate(reads)


def coalesce_note(ctx, greedy: np.ndarray, chosen: np.ndarray, after: dict) -> dict:
    """What coalescing changed: the greedy selection's transfer estimate next to the plan's."""
    access, per_expert, _ = access_of(ctx, greedy)
    before = transfer(ctx, access, per_expert, base_bytes(ctx))
    cands = ctx.candidates
    return {"tolerance": ctx.request.coalesce_tolerance, "before": before, "after": after,
            "expert_read_before": int(cands.bytes_of(greedy).sum()),
            "expert_read_after": int(cands.bytes_of(chosen).sum()),
            "blocks_swapped": int(len(np.setdiff1d(chosen, greedy)))}


def exact_tiers(ctx, selected: np.ndarray) -> dict:
    """Blocks and bytes per tier of an exact-or-omitted plan."""
    cands = ctx.candidates
    return {"exact": {"blocks": int(selected.sum()), "bytes": int(cands.bytes_of(np.nonzero(selected)[0]).sum())},
            "compact": {"blocks": 0, "bytes": 0, "by_bits": {}},
            "omitted": {"blocks": int((~selected).sum()), "bytes": int(cands.nbytes[~selected].sum())}}


# --- estimates -----------------------------------------------------------------------------------
def base_bytes(ctx) -> int:
    """Bytes of input tensors read as they are (the base's; a layout's copies from any model) = bytes written."""
    if ctx.output_layout is not None:
        return sum(ctx.tensors[ctx.tensor_index[t[2]]]["nbytes"] for t in ctx.output_layout["tensors"])
    return sum(t["nbytes"] for t in ctx.tensors)


def output_info(ctx, row: dict) -> TensorInfo:
    """A tensor as written (a re-ordered embedding tensor has the output vocabulary's rows)."""
    return tensor_info(row) if ctx.vocab is None else vocab_rows.output_info(row, ctx.vocab)


def output_bytes(ctx) -> int:
    """Bytes of the output's tensors (re-ordered embedding rows, float tensors in the output dtype)."""
    total = base_bytes(ctx)
    if ctx.vocab is not None:
        total += sum(output_info(ctx, t).nbytes - t["nbytes"] for t in ctx.tensors)
    out = out_dtype(ctx)
    if out is None:
        return total
    return total + sum(converted_bytes(n, r["dtype"], out) - n for r in _written_rows(ctx)
                       for n in [output_info(ctx, r).nbytes])


def _written_rows(ctx) -> list[dict]:
    """The input tensor of each output tensor, in output order."""
    if ctx.output_layout is None:
        return ctx.tensors
    return [ctx.tensors[ctx.tensor_index[t[2]]] for t in ctx.output_layout["tensors"]]


def out_dtype(ctx) -> str | None:
    """The request's output dtype when some float tensor of the base is in another one (else None: the
    tensors are written in their own dtypes)."""
    out = ctx.request.out_dtype
    if out is None or all(t["dtype"] == out or t["dtype"] not in FLOAT_DTYPES for t in ctx.tensors):
        return None
    return out


def conversion_note(ctx) -> dict:
    """The base's float dtypes, the output's, and the output's bytes without and with the conversion."""
    out = out_dtype(ctx)
    written = output_bytes(ctx)
    floats = sorted({t["dtype"] for t in ctx.tensors if t["dtype"] in FLOAT_DTYPES})
    return {"from": floats, "to": out, "bytes": written,
            "bytes_unconverted": written - sum(converted_bytes(n, r["dtype"], out) - n for r in _written_rows(ctx)
                                               for n in [output_info(ctx, r).nbytes])}


def moe_setting(ctx) -> dict | None:
    """How a fused MoE family's per-expert matrices are written (storage/moe_layout.py): fused (the default,
    mergekit's) or per expert; None for other bases. A fused layout is checked here (the experts fuse)."""
    arch = ctx.base.get("architecture")
    rows = _written_rows(ctx)
    names = [t[0] for t in ctx.output_layout["tensors"]] if ctx.output_layout is not None else [r["name"] for r in rows]
    if not has_per_expert(arch, names):
        return None
    layout = "per-expert" if ctx.request.moe_layout == "per-expert" else "fused"
    if layout == "fused":
        try:
            fused_order(arch, [replace(tensor_info(r), name=n) for r, n in zip(rows, names)])
        except MergePipeError as exc:
            raise PlanError(str(exc)) from None
    return {"layout": layout, "architecture": arch}


def converted_bytes(nbytes: int, dtype: str, out: str | None) -> int:
    """Bytes of a tensor of ``nbytes`` in ``dtype`` written in ``out`` (float tensors only; None: as is)."""
    if out is None or dtype not in FLOAT_DTYPES:
        return nbytes
    return nbytes // ITEMSIZE[dtype] * ITEMSIZE[out]


def vocab_blocks(ctx) -> int:
    """Blocks of every expert's re-ordered embedding rows, read in full."""
    if ctx.vocab is None or ctx.vocab.get("copies"):
        return 0
    return sum(b - a for rs in vocab_rows.access(ctx.tensors, ctx.vocab, ctx.block_bytes).values() for a, b in rs)


def _runs(ranges_by_tensor: dict[str, list]) -> int:
    return sum(len(rs) for rs in ranges_by_tensor.values())
