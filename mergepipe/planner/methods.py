"""Planning the interpolation methods (ops with ``spec.nonlinear``: slerp, nuslerp, model_stock, nearswap):
expert counts, per-tensor scalars from the catalog's Gram statistics, and joint block selection.

- Scalars: each float tensor's coefficients (slerp's ca/cb, model_stock's t, ...) are computed here from
  ANALYZE's Gram statistics (catalog/gram.py) and the tensor's settings (t resolved per tensor from a
  gradient or filters; the experts' weights per tensor) and recorded in the plan (``coefficients``, part of
  the digest): the engine merges block by block with them and reads no extra byte. Over a re-ordered
  vocabulary the catalog has no statistics of embed_tokens/lm_head's composed rows: the plan records those
  tensors' settings instead (``composed_coefficients``) and the engine, which reads them in full for every
  model, takes their Gram statistics from the composed rows and calls the same ``method_scalars``.
- Joint selection (``spec.joint``): a block (tensor, index) is read for every expert that changed it, or
  for none; groups are taken greedily by summed score per summed byte (ties: tensor, block), while they fit
  the budget. ``omitted`` lists, per tensor, the blocks some expert changed that the plan does not read:
  the engine keeps the base's values there. Every other block of a float tensor is merged (an expert that
  did not change a block has x = base there and is not read).
- The additive error bound does not apply (EXPLAIN says n/a and why).
"""

from __future__ import annotations

import json

import numpy as np

from mergepipe.catalog import analyses
from mergepipe.catalog.gram import (load_arcee_thresholds, load_gram_diagonal, load_gram_matrices, load_sce_selection,
                                    load_set_counts, sce_row_keys, set_key)
from mergepipe.errors import PlanError
from mergepipe.ops.core import METHODS
from mergepipe.ops.interp import Gram
from mergepipe.planner.plan import compact_ranges
from mergepipe.planner.settings import layer_t, num_layers, resolve, tensor_weight
from mergepipe.storage.safetensors import FLOAT_DTYPES


class NeedsAnalysis(PlanError):
    """The catalog lacks statistics these experts need together: ``mergepipe analyze --gram`` them together (the
    mergekit config path does it by itself)."""


def check_experts(op, experts: list[dict], member: dict | None = None) -> None:
    # without a base_model (a soup, config/soup.py) the reference model is one of the models
    k = len(experts) + (member is not None)
    if k < op.min_experts or (op.max_experts is not None and k > op.max_experts):
        if op.max_experts == op.min_experts:
            want = f"exactly {op.min_experts} model{'s' if op.min_experts > 1 else ''} besides the base"
        else:
            want = f"at least {op.min_experts} models besides the base"
        raise PlanError(f"{op.name} needs {want} ({k} given)"
                        + (": base_model must be one of the two models (mergekit: exactly 2 models, the base "
                           "among them)" if op.name in ("slerp", "nearswap") else ""))
    if any(e.get("analyze") for e in experts):
        missing = ", ".join(e["id"] for e in experts if e.get("analyze"))
        raise NeedsAnalysis(f"{op.name} needs the experts' statistics before planning (not analyzed: {missing}); "
                        f"run `mergepipe analyze {'--arcee ' if op.name == 'arcee_fusion' else ''}"
                        f"{' '.join(e['id'] for e in experts)}` first")
    if op.common is not None and "weight" not in op.common:
        if any(e.get("weight") not in (None, 1.0) or e.get("tensors") for e in experts):
            raise PlanError(f"{op.name} takes no weights (mergekit's {op.name} has no weight parameter)")


# methods whose per-tensor scalars need the Gram statistics (or nothing) besides the tensor's settings: over a
# re-ordered vocabulary (config/vocab.py) the engine computes those of embed_tokens/lm_head from the composed rows
VOCAB_METHODS = ("slerp", "nuslerp", "model_stock", "multislerp", "karcher", "nearswap", "ram", "sce", "ramplus_tl",
                 "arcee_fusion")
# methods whose scalars need other whole-tensor statistics (sce's top k of the variance across the experts,
# ramplus_tl's shared/unique counts, arcee_fusion's importance threshold): over a re-ordered vocabulary the
# engine takes those of embed_tokens/lm_head from the composed rows too (engine/vocab.py, analyze/gram.py)
STAT_METHODS = ("sce", "ramplus_tl", "arcee_fusion")
# Gram methods whose scalars read no dot product between two experts (sce: ||delta_i||^2; ramplus_tl: none): the
# planner reads only the base's and the diagonal's rows, and counts the pairs (they must be stored all the same)
DIAGONAL_METHODS = ("sce", "ramplus_tl")


def composed_at_merge(op) -> bool:
    """Whether a re-ordered tensor's scalars are computed at merge time (from its composed rows)."""
    return bool(op.gram) or op.name in STAT_METHODS


def method_scalars(op, gram: Gram | None, settings: dict, params: dict, ndim: int) -> list[float]:
    """One tensor's scalars (ops/<method>.py ``scalars``), as recorded in a plan's ``coefficients``."""
    scalars_fn, _ = METHODS[op.name]
    return [float(v) for v in scalars_fn(op, gram, settings, params, ndim)]


def tensor_scalars(ctx) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Per float tensor, the method's scalars; and per re-ordered embedding tensor of a Gram method, the
    settings its scalars are computed from at merge time (the catalog has no statistics of its composed
    rows: the engine takes them from the rows it reads in full, engine/vocab.py)."""
    op, params = ctx.op, ctx.params
    ids = [e["id"] for e in ctx.experts]
    gram, counted = _load_gram(ctx, ids) if op.gram else ({}, set())
    changed = analyses.changed_tensors_of(ctx.catalog, ids) if op.gram and ids else {}
    counts = load_set_counts(ctx.catalog, ctx.base["id"], set_key(ids)) if op.name == "ramplus_tl" else None
    arcee = load_arcee_thresholds(ctx.catalog, ctx.base["id"], ids[0]) if op.name == "arcee_fusion" else None
    topk = params.get("select_topk", 1.0) if op.name == "sce" else 1.0
    sce = (load_sce_selection(ctx.catalog, ctx.base["id"], sce_row_keys(topk, set_key(ids)))
           if 0.0 < topk < 1.0 else None)
    names = [t["name"] for t in ctx.tensors]
    layers = num_layers(names, json.loads(ctx.base["config"] or "{}"))
    composed = set((ctx.vocab or {}).get("tensors", ()))
    out, at_merge = {}, {}
    for t in ctx.tensors:
        if t["dtype"] not in FLOAT_DTYPES:
            continue
        name = t["name"]
        settings = {"weights": [tensor_weight(e, name) for e in ctx.experts]}
        if ctx.base_member is not None:  # no base_model: the reference (the "base") is one of the models
            settings["reference_weight"] = tensor_weight(ctx.base_member, name)
        if name in composed and op.name not in VOCAB_METHODS and not op.copies:
            raise PlanError(f"tokenizer_source: {op.name} over a re-ordered vocabulary is not supported "
                            f"(supported: {', '.join(VOCAB_METHODS)} and the task-vector methods)")
        if "t" in params:
            settings["t"] = resolve([params["t"]], name, layer_t(name, layers), 0.0)
        if name in composed and composed_at_merge(op):  # statistics of its composed rows, at merge time
            at_merge[name] = settings
            continue
        if counts is not None:
            per = counts.get(name)
            if per is None or set(per) != set(ids):
                raise NeedsAnalysis(f"{op.name} needs the counts of shared and unique entries of exactly these experts "
                                    f"analyzed together, which the catalog does not hold for tensor {name}: "
                                    f"`mergepipe analyze --gram {' '.join(ids)}`")
            settings["ram_counts"] = ([per[e][0] for e in ids], [per[e][1] for e in ids])
        if arcee is not None:
            settings["arcee_threshold"] = _arcee_threshold(arcee, ids[0], t)
        if sce is not None:
            settings["sce"] = _sce_selection(sce, ids, t, topk)
        zero = {e for e in ids if name not in changed[e]} if op.gram else set()
        g = (_gram(op, gram.get(name), ids, name, t, zero, ctx.base_member is not None, name in counted)
             if op.gram else None)
        out[name] = method_scalars(op, g, settings, params, len(t["shape"]))
    return out, at_merge


def _load_gram(ctx, ids: list[str]) -> tuple[dict, set]:
    """Each tensor's Gram matrix (catalog/gram.py) and the tensors whose pairs of experts were counted, not read
    (DIAGONAL_METHODS, when every pair of every float tensor is stored; else every row is read)."""
    if ctx.op.name in DIAGONAL_METHODS and len(set(ids)) == len(ids):
        gram, complete = load_gram_diagonal(ctx.catalog, ctx.base["id"], ids)
        if {t["name"] for t in ctx.tensors if t["dtype"] in FLOAT_DTYPES} <= complete:
            return gram, complete
    return load_gram_matrices(ctx.catalog, ctx.base["id"], ids), set()


def _arcee_threshold(thresholds: dict, expert: str, t) -> float:
    """An expert's arcee_fusion threshold on one tensor, stored by ANALYZE --gram."""
    value = thresholds.get(t["name"])
    if value is None:
        why = (" (a 1-D tensor is one softmax row: it must fit in one block)" if len(t["shape"]) == 1 else "")
        raise NeedsAnalysis(f"arcee_fusion needs the importance threshold of {expert} on tensor {t['name']}, which "
                            f"the catalog does not hold{why}: ANALYZE --arcee stores it for full checkpoints whose "
                            f"base it reads (`mergepipe analyze --arcee {expert}`)")
    return value


def _sce_selection(rows: dict, ids: list[str], t, topk: float) -> tuple:
    """sce's top-k of one tensor, stored by ANALYZE --sce-topk for exactly these experts: (each expert's sum
    of kept delta^2, threshold, cut block, cut rank)."""
    per = rows.get(t["name"], {})
    first = sorted(ids)[0]
    if set(per.get("sums", {})) != set(ids) or any(first not in per.get(k, {}) for k in ("thr", "cut", "rank")):
        raise NeedsAnalysis(f"sce select_topk {topk:g} needs the top-k of the variance across exactly these experts "
                            f"on tensor {t['name']}, which the catalog does not hold: `mergepipe analyze "
                            f"--sce-topk {topk:g} {' '.join(ids)}`")
    return [per["sums"][e] for e in ids], per["thr"][first], per["cut"][first], per["rank"][first]


def _gram(op, rows: np.ndarray | None, ids: list[str], name: str, t, zero: set, whole: bool = False,
          counted: bool = False) -> Gram:
    """The tensor's Gram statistics from its (K+1) x (K+1) matrix (the base first; catalog/gram.py
    ``load_gram_matrices``, None: no rows); a pair with an expert whose delta is zero on this tensor (a LoRA
    adapter that does not target it has no rows) is 0. ``counted``: the pairs of experts were counted, not read
    (``load_gram_diagonal``: NaN between two experts, which a DIAGONAL_METHODS method does not read)."""
    n = len({"": 0, **dict.fromkeys(ids)})
    m = np.full((n, n), np.nan) if rows is None else rows.copy()
    zeroed = np.array([False] + [e in zero for e in ids])
    m[np.isnan(m) & (zeroed[:, None] | zeroed[None, :])] = 0.0
    needs_base = op.name in ("slerp", "karcher") or whole  # whole models: ||x_i||^2 and <x_i, x_j> need the base
    if needs_base:
        _require(op, m[:1, :1], ["", ""], name, ids, "||base||^2")
        _require(op, m[:1, 1:], ids, name, ids, "<base, delta>")
    if not counted:
        _require(op, m[1:, 1:], ids, name, ids, "the dot products of the experts' deltas")
    bb = None if np.isnan(m[0, 0]) else float(m[0, 0])
    bd = tuple(np.nan_to_num(m[0, 1:], nan=0.0).tolist())
    return Gram(bb, bd, tuple(map(tuple, m[1:, 1:].tolist())), int(np.prod(t["shape"])))


def _require(op, part: np.ndarray, ids: list[str], name: str, all_ids: list[str], what: str) -> None:
    """NeedsAnalysis when a Gram value this merge needs is missing (NaN) on tensor ``name``."""
    if np.isnan(part).any():
        raise NeedsAnalysis(f"{op.name} needs {what} on tensor {name}, which the catalog does not hold: the "
                            f"experts must be analyzed together (`mergepipe analyze --gram {' '.join(all_ids)}`)"
                            + ("; the base is not read for delta checkpoints" if what[0] in "|<" else ""))


def select_joint(cands, budget_bytes: int) -> np.ndarray:
    """Greedy over (tensor, block) groups: all of a group's candidates or none, within the budget."""
    n = len(cands.nbytes)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    width = int(cands.block.max()) + 1
    key = cands.tensor.astype(np.int64) * width + cands.block.astype(np.int64)
    groups, inverse = np.unique(key, return_inverse=True)
    gbytes = np.bincount(inverse, weights=cands.nbytes.astype(np.float64))
    gscore = np.bincount(inverse, weights=cands.score)
    ratio = np.where(gbytes > 0, gscore / np.maximum(gbytes, 1), np.inf)
    if cands.priority is not None:  # strategies random / uniform: the group's mean priority
        ratio = np.bincount(inverse, weights=cands.priority) / np.bincount(inverse)
    order = np.lexsort((groups, -ratio))  # groups sort by (tensor, block)
    members = [[] for _ in groups]
    for c, g in enumerate(inverse):
        members[g].append(c)
    chosen, used, paid = [], 0, set()
    for g in order:
        extra = 0
        new_paid = []
        for c in members[g]:
            extra += int(cands.nbytes[c])
            pg = int(cands.group[c])
            if pg not in paid and pg not in new_paid:
                extra += int(cands.setup[c])
                new_paid.append(pg)
        if used + extra <= budget_bytes:
            chosen.extend(members[g])
            used += extra
            paid.update(new_paid)
    return np.array(sorted(chosen, key=lambda c: (cands.tensor[c], cands.block[c], cands.expert[c])), dtype=np.int64)


def omitted_blocks(ctx, chosen: np.ndarray) -> dict[str, list]:
    """Per tensor, the blocks an expert changed that the plan does not read (compact ranges)."""
    cands = ctx.candidates
    mask = np.ones(len(cands.nbytes), dtype=bool)
    mask[chosen] = False
    names = [t["name"] for t in ctx.tensors]
    out: dict[str, set] = {}
    for ti, b in zip(cands.tensor[mask], cands.block[mask]):
        out.setdefault(names[int(ti)], set()).add(int(b))
    return {t: compact_ranges(sorted(bs)) for t, bs in sorted(out.items())}
