"""What preflight (config/preflight.py) says about the output and the cost of a merge, from headers only.

* **Output**: MergePipe writes the base's tensors, so the output has the base's parameters, and its output
  head (or tied embedding) as the base has it; a tokenizer setting that gives the embedding more rows (a
  union of vocabularies, another model's tokenizer, ``pad_to_multiple_of``) grows it, which is flagged.
* **Bytes**: a merge reads every byte of the base (a block it does not merge is copied) and, of the experts,
  every byte of the tensors they share with the base (LoRA: the adapter's A and B) at a 100 % budget, or
  what the budget allows (:meth:`Budget.bytes_of`); bytes of remote inputs are transferred, local ones
  (a cached Hub snapshot included) are not. A target bound's budget depends on the statistics ANALYZE
  stores, so only the full read is given then.
* **Peak memory**: the engine's bound on input in flight (engine.py ``INFLIGHT_BYTES``) plus, per worker, a
  float32 buffer of a block for the base, each expert and the result; plus every model's embedding in
  float32 when its rows are re-ordered to another vocabulary (whole tensors). The Python process itself
  (torch loaded, ~0.3 GB) comes on top.
* **Time**: the tier cost model (storage/tiers.py: requests x latency / connections + bytes / bandwidth);
  a full read counts one request per weight file, a budgeted one a request per block (the upper bound of a
  scattered selection).
"""

from __future__ import annotations

import math
import os

from mergepipe.catalog.mismatch import vocab_size
from mergepipe.config.model import MergekitConfig
from mergepipe.planner.budget import Budget
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES
from mergepipe.storage.tiers import tier_name, transfer_estimate

HEADS = ("lm_head.weight", "embed_out.weight")  # output heads: absent where the embeddings are tied


def heads(ckpt) -> list[str]:
    """The output heads a checkpoint holds (none: its embeddings are tied)."""
    return [n for n in ckpt.tensors if n.endswith(HEADS)]


def tie_setting(ckpt) -> str:
    tie = (ckpt.config or {}).get("tie_word_embeddings")
    return "" if tie is None else f"; tie_word_embeddings: {str(tie).lower()}"


def tied_text(ckpt) -> str:
    """'own lm_head' or 'tied (tie_word_embeddings: true)': what a checkpoint does with its output head."""
    tie = (ckpt.config or {}).get("tie_word_embeddings")
    setting = "" if tie is None else f" (tie_word_embeddings: {str(tie).lower()})"
    return f"own {heads(ckpt)[0].split('.')[0]}{setting}" if heads(ckpt) else f"tied to the embedding{setting}"


def _numel(info) -> int:
    return math.prod(info.shape)


def params_of(ckpt) -> int:
    return sum(_numel(t) for t in ckpt.tensors.values())


def _vocab_tensors(ckpt) -> list:
    from mergepipe.catalog.vocab_names import is_vocab_tensor
    return [t for n, t in ckpt.tensors.items() if is_vocab_tensor(n) and len(t.shape) == 2]


def _out_vocab(cfg: MergekitConfig, inputs: list) -> tuple[int | None, str]:
    """(rows the output embedding will have, what the tokenizer settings do), from the models' row counts."""
    base = inputs[0]
    rows = vocab_size(base.ckpt)
    opened = [i for i in inputs if i.ckpt is not None and i.kind != "lora"]
    sizes = sorted({v for v in (vocab_size(i.ckpt) for i in opened) if v is not None})
    src = cfg.tokenizer_source
    if rows is None:
        return None, "no embedding tensor found by name: the base's files as they are"
    if src is None or src == "base" or src == cfg.base:
        out, how = rows, "the base's tokenizer" + (" (copied as it is)" if src is None else "")
    elif src == "union":
        out = max(sizes)
        how = f"the union of every model's vocabulary: at least {out:,} rows (the exact count comes from the " \
              f"tokenizer files at merge time)"
    else:
        named = next((i for i in opened if i.ref == src), None)
        out = vocab_size(named.ckpt) if named is not None else rows
        how = f"the tokenizer of {src}" + (f" ({out:,} rows)" if named is not None else "")
    if cfg.pad_to_multiple_of:
        out = -(-out // cfg.pad_to_multiple_of) * cfg.pad_to_multiple_of
        how += f", padded to a multiple of {cfg.pad_to_multiple_of}"
    if len(sizes) > 1:
        how = f"vocabularies of {', '.join(f'{s:,}' for s in sizes)} rows; " + how
    else:
        how = f"{rows:,} rows in every model; " + how
    return out, how


def output_of(cfg: MergekitConfig, inputs: list, notes: list[str]) -> dict:
    """What the output will contain: tensors, parameters (vs the base's), output head, vocabulary."""
    base = inputs[0].ckpt
    base_params = params_of(base)
    rows, how = _out_vocab(cfg, inputs)
    base_rows = vocab_size(base)
    growth = 0
    if rows is not None and base_rows is not None and rows != base_rows:
        growth = sum((rows - base_rows) * t.shape[1] for t in _vocab_tensors(base) if t.shape[0] == base_rows)
    params = base_params + growth
    if growth > 0:
        notes.append(f"the output grows: {params:,} parameters, {growth:,} (+{100 * growth / base_params:.2f} %) more "
                     f"than the base's {base_params:,} (its embedding gets {rows:,} rows instead of {base_rows:,})")
    return {"tensors": len(base.tensors), "params": params, "base_params": base_params, "growth": growth,
            "head": tied_text(base), "vocab_rows": rows, "tokenizer": how}


def _expert_bytes(inp, base) -> int:
    """Bytes of an expert a full merge reads: the tensors it shares with the base (a LoRA: all of A and B)."""
    if inp.kind == "lora":
        return inp.ckpt.nbytes
    return sum(t.nbytes for n, t in inp.ckpt.tensors.items()
               if n in base.tensors and tuple(base.tensors[n].shape) == tuple(t.shape))


def _reads(base, experts: list, fraction: float | None) -> list[tuple[str, int, int]]:
    """(uri, bytes, requests) per input: the base whole; each expert whole (None) or its budgeted share."""
    out = [(base.uri, base.ckpt.nbytes, len(base.ckpt.file_sizes))]
    for e, nbytes in experts:
        if fraction is None or fraction >= 1.0:
            out.append((e.uri, nbytes, len(e.ckpt.file_sizes)))
        else:
            share = int(nbytes * fraction)
            out.append((e.uri, share, max(1, math.ceil(share / DEFAULT_BLOCK_BYTES)) if share else 0))
    return out


def _bytes_row(reads: list[tuple[str, int, int]]) -> dict:
    cost = transfer_estimate(reads)
    return {"read": sum(n for _, n, _ in reads),
            "transfer": sum(n for uri, n, _ in reads if tier_name(uri) != "local"),
            "seconds": cost["seconds"], "tiers": cost["tiers"]}


def peak_memory(base_ckpt, experts: list, reorder: bool) -> int:
    """The merge's memory estimate in bytes (see the module docstring)."""
    from mergepipe.engine.engine import INFLIGHT_BYTES
    itemsize = min((t.nbytes // max(1, _numel(t)) for t in base_ckpt.tensors.values() if t.nbytes), default=4)
    block_f32 = DEFAULT_BLOCK_BYTES // max(1, itemsize) * 4
    workers = max(1, min(4, os.cpu_count() or 1))
    peak = INFLIGHT_BYTES + workers * (len(experts) + 2) * block_f32
    if reorder:
        peak += (len(experts) + 1) * sum(_numel(t) * 4 for t in _vocab_tensors(base_ckpt))
    return peak


def estimate(cfg: MergekitConfig, inputs: list) -> dict:
    """Bytes to read and transfer (full and under the budget), peak memory and time (tier cost model)."""
    base = inputs[0]
    experts = [(i, _expert_bytes(i, base.ckpt)) for i in inputs[1:]
               if i.ckpt is not None and i.role != "base (again)"]
    full_expert = sum(n for _, n in experts)
    budget = cfg.budget if cfg.budget is not None else Budget()
    out = {"full": _bytes_row(_reads(base, experts, None)), "full_expert_bytes": full_expert,
           "budget": None if cfg.target_bound is not None else str(budget)}
    out["full"]["expert"] = full_expert
    if cfg.target_bound is None and not budget.is_target:
        allowed = budget.bytes_of(full_expert)
        row = _bytes_row(_reads(base, experts, allowed / full_expert if full_expert else 0.0))
        row["expert"] = allowed
        out["budgeted"] = row
    reorder = cfg.tokenizer_source is not None and len({vocab_size(i.ckpt) for i, _ in experts} |
                                                        {vocab_size(base.ckpt)}) > 1
    out["peak_memory"] = peak_memory(base.ckpt, experts, reorder)
    return out


def table_rows(result) -> list[dict]:
    """One row per model: the preflight table (CLI, dashboard)."""
    rows = []
    for i in result.inputs:
        c = i.ckpt
        rows.append({
            "model": i.ref, "role": i.role, "from": i.source or "-",
            "tensors": len(c.tensors) if c is not None else None,
            "params": params_of(c) if c is not None else None,
            "dtype": ",".join(sorted({t.dtype for t in c.tensors.values()})) if c is not None else None,
            "vocab": vocab_size(c) if c is not None and i.kind != "lora" else None,
            "lm_head": ("own" if heads(c) else "tied") if c is not None and i.kind != "lora" else None,
            "vs base": ("error" if i.error else "-" if i.role.startswith("base") else
                        f"{len(i.differences)} differ" if i.differences else "same layout"),
            "bytes": c.nbytes if c is not None else None,
            "fetched": i.fetched,
        })
    return rows
