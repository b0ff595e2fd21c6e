"""Candidate blocks and the greedy selection: score per byte, deterministic tie-break, budget-sound
by construction; the budget/bound frontier. And how a PlanContext finds them: the magnitude thresholds
per (expert, tensor) from the catalog, then every block the operator could use, scored by the strategy."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from mergepipe.catalog import analyses
from mergepipe.catalog.packed import members, unpack
from mergepipe.ops.core import lookup_thresholds, statistics_of, tensor_statistics, threshold_fractions
from mergepipe.ops.spec import Sparsify
from mergepipe.planner.settings import expert_params, tensor_density
from mergepipe.planner.strategies import _uniform_priority
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import FLOAT_DTYPES, TensorInfo
from mergepipe.storage.sources import fixed_bytes, open_source


@dataclass
class Candidates:
    """Every block the operator could use, with its bytes and score, in greedy order."""

    expert: np.ndarray  # index into experts
    tensor: np.ndarray  # index into tensor names
    block: np.ndarray
    nbytes: np.ndarray
    score: np.ndarray
    bound_term: np.ndarray  # |c_i| * ||delta|| (additive error bound contribution)
    priority: np.ndarray | None = None  # greedy key (higher first); default score per byte
    setup: np.ndarray | None = None  # bytes read once per (expert, tensor) if any of its blocks is (LoRA A)
    order: np.ndarray = field(default=None)  # greedy order

    def __post_init__(self):
        if self.setup is None:
            self.setup = np.zeros(len(self.nbytes), dtype=np.int64)
        self.group = self.expert * (int(self.tensor.max(initial=0)) + 1) + self.tensor
        if self.priority is None:
            # a block's cost carries its share of the tensor's one-off bytes
            _, inverse, counts = np.unique(self.group, return_inverse=True, return_counts=True)
            cost = self.nbytes + self.setup / counts[inverse]
            ratio = np.where(cost > 0, self.score / np.maximum(cost, 1), np.inf)
        else:
            ratio = self.priority
        self.ratio = ratio  # the greedy key: score per byte, or the strategy's priority
        # lexsort: last key is primary -> sort by -ratio, then expert, tensor, block
        self.order = np.lexsort((self.block, self.tensor, self.expert, -ratio))
        grp = self.group[self.order]
        first = np.zeros(len(grp), dtype=bool)
        first[np.unique(grp, return_index=True)[1]] = True
        self.cost_in_order = self.nbytes[self.order] + self.setup[self.order] * first
        self.cum_bytes = np.cumsum(self.cost_in_order)
        self.cum_bound = np.cumsum(self.bound_term[self.order])

    @property
    def full_bytes(self) -> int:
        return int(self.cost_in_order.sum())

    def bytes_of(self, chosen: np.ndarray) -> np.ndarray:
        """Bytes each chosen candidate costs: its own, plus its group's one-off bytes for the first."""
        first = np.zeros(len(chosen), dtype=bool)
        first[np.unique(self.group[chosen], return_index=True)[1]] = True
        return self.nbytes[chosen] + self.setup[chosen] * first

    def select(self, budget_bytes: int) -> np.ndarray:
        """Greedy: walk the order, take every block that still fits."""
        if budget_bytes >= self.full_bytes:
            return self.order
        # Fast path: the longest prefix that fits, then the remaining blocks that still fit.
        k = int(np.searchsorted(self.cum_bytes, budget_bytes, side="right"))
        chosen = list(self.order[:k])
        used = int(self.cum_bytes[k - 1]) if k else 0
        paid = set(self.group[self.order[:k]].tolist())
        for c in self.order[k:]:
            extra = int(self.nbytes[c]) + (0 if self.group[c] in paid else int(self.setup[c]))
            if used + extra <= budget_bytes:
                chosen.append(c)
                used += extra
                paid.add(self.group[c])
        return np.array(chosen, dtype=np.int64)

    def frontier(self, points: int = 101) -> list[tuple[int, float]]:
        """(budget bytes, omitted bound) along the greedy prefix, for the budget-bound curve."""
        total = float(self.bound_term.sum())
        if len(self.order) == 0:
            return [(0, 0.0)]
        idx = np.unique(np.linspace(0, len(self.order), points).astype(int))
        out = []
        for k in idx:
            used = int(self.cum_bytes[k - 1]) if k else 0
            covered = float(self.cum_bound[k - 1]) if k else 0.0
            out.append((used, max(0.0, total - covered)))
        return out

    def smallest_budget_for(self, target_abs: float) -> int:
        total = float(self.bound_term.sum())
        need = total - target_abs
        if need <= 0:  # reading nothing already meets the target
            return 0
        k = int(np.searchsorted(self.cum_bound, need - 1e-12 * max(1.0, total), side="left"))
        k = min(k, len(self.order) - 1)
        return int(self.cum_bytes[k])


def find_thresholds(ctx) -> dict[str, dict[str, list[float]]]:
    """Magnitude thresholds per (expert, tensor) from the catalog (one query for every expert). An expert
    lacking one for a density this merge needs is marked to be analyzed on the way (the merge reads it in full)."""
    out: dict[str, dict[str, list[float]]] = {}
    if not ctx.op.thresholded:
        return out
    rows = tensor_rows(ctx)
    for e in ctx.experts:
        if e.get("analyze"):
            continue
        per = {}
        for name, text, topk, l1, max_abs, numel in rows.get(e["id"], ()):
            if name in (ctx.vocab or {}).get("tensors", {}):
                continue  # re-ordered rows: the engine takes their top k (engine/vocab.py)
            params = expert_params(ctx.params_for(name), e, name)
            fracs = threshold_fractions(ctx.op, tensor_density(e, name) or 1.0, params)
            vals = _statistics(ctx.op, tensor_density(e, name) or 1.0, params, fracs, text, topk, l1, max_abs, numel)
            if vals is None:
                table = json.loads(unpack(text) or "{}")  # fraction 1: the top n - 1 (breadcrumbs, ops.core)
                missing = ", ".join(f"{f:g}" for f in fracs if lookup_thresholds(table, [f]) is None
                                    or (f >= 1.0 and "1.0" not in table))
                e["analyze"] = (f"no magnitude threshold for top-{missing}" if missing else
                                "no exact top-k statistics (analyzed before catalog v5)")
                break
            if fracs:
                per[name] = vals
        if per and not e.get("analyze"):
            out[e["id"]] = per
    return out


def _statistics(op, density: float, params: dict, fracs: list[float], text, topk, l1, max_abs, numel):
    """ops.core.tensor_statistics of one (expert, tensor), given only the stored densities it can use: TIES its
    own; breadcrumbs its threshold fractions, the zero thresholds and the exact-k entries of its two cut-offs (a
    stored fraction f serves k = int(f n) and int(f n) - 1, ops.core.kth_statistics), with the whole text as the
    fallback should those not answer (they do: the same statistics, a hundred densities fewer to read)."""
    if op.sparsify is Sparsify.MAGNITUDE:
        keys = [str(f) for f in fracs]
        # the stored densities ascend: one in the first half is found decompressing a part; later ones, whole
        small = (members(text, keys), members(topk, keys) if topk is not None else None) if max(fracs, default=1.0) \
            <= 0.5 else (None, None)
        if small[0] is not None and (topk is None or small[1] is not None):
            vals = tensor_statistics(op, density, params, *small, l1, max_abs, numel)
            if vals is not None:
                return vals
        return tensor_statistics(op, density, params, unpack(text), unpack(topk), l1, max_abs, numel)
    text = unpack(text)
    stored = len(topk) >= 16 or bool(unpack(topk)) if isinstance(topk, (bytes, memoryview)) else bool(topk)
    cut = _outlier_cut(text, topk, int(numel or 0), density, params, fracs) if density < 1.0 and stored else None
    vals = statistics_of(op, density, params, *cut, l1, max_abs, numel) if cut else None
    return vals if vals is not None else tensor_statistics(op, density, params, text, unpack(topk), l1, max_abs, numel)


_KEY_FLOATS: dict[tuple, np.ndarray] = {}  # the stored fractions' keys -> their float values (one grid for all)


def _outlier_cut(text: str | None, topk, n: int, density: float, params: dict, fracs: list[float]):
    """(thresholds, topk) cut down to what breadcrumbs reads for its two cut-offs k (as
    ops.core._outlier_statistics counts them), parsed (``topk`` as stored: decompressed as far as the entries
    it reads); None where they cannot be told."""
    if not text or n <= 0 or "gamma" not in params:
        return None
    table = json.loads(text)
    keys = tuple(table)
    if keys not in _KEY_FLOATS:
        _KEY_FLOATS.clear()  # one grid at a time
        _KEY_FLOATS[keys] = np.array([float(k) for k in keys], dtype=np.float64)
    target = int(density * n)
    n_bot = max(0, n - target - int(params["gamma"] * n))
    ks = np.array([n - n_bot - target, n - n_bot])
    kf = (_KEY_FLOATS[keys] * n).astype(np.int64)  # int(f n), as kth_statistics counts it
    serve = np.flatnonzero((kf == ks[0]) | (kf == ks[0] + 1) | (kf == ks[1]) | (kf == ks[1] + 1)).tolist()
    # a stored 0 answers k (every non-zero entry kept) when int(f n) - 1 <= k: the one with the least int(f n)
    # tells for all of them
    zeros = np.flatnonzero(np.array(list(table.values()), dtype=np.float64) == 0.0)
    keep = set(serve) | ({int(zeros[np.argmin(kf[zeros])])} if len(zeros) else set())
    keep |= {keys.index(k) for k in {str(f) for f in fracs} if k in table}
    kept = {keys[i]: table[keys[i]] for i in sorted(keep)}
    serving = [keys[i] for i in serve]
    return kept, json.loads((members(topk, serving) if serving else None) or unpack(topk))


def tensor_rows(ctx) -> dict[str, list[tuple]]:
    """Per analyzed expert: the tensor_stats rows (tensor, thresholds, topk, l1, max_abs, numel) of the tensors it
    changed, for every expert in one query (catalog/analyses.changed_tensor_table), the JSON as stored (packed:
    read with catalog/packed.unpack, or a part of it with members)."""
    ids = [e["id"] for e in ctx.experts if not e.get("analyze")]
    out: dict[str, list[tuple]] = {}
    for mid, *row in (analyses.changed_tensor_table(ctx.catalog, ids, packed=True) if ids else ()):
        out.setdefault(mid, []).append(tuple(row))
    return out


def find_candidates(ctx) -> Candidates:
    """Every block the operator could use (analyzed experts: their changed blocks past the thresholds;
    experts analyzed on the way: all their blocks), scored by the context's strategy."""
    arr = _candidate_table(ctx)
    coefs = np.abs(ctx.coef_matrix)
    bound_term = coefs[arr["expert"], arr["tensor"]] * arr["l2"] if len(arr["l2"]) else np.zeros(0)
    score = bound_term.copy()
    priority = None
    if ctx.strategy == "conflict" and len(score):
        score = score * (1.0 - ctx._conflict_rates(arr))
    elif ctx.strategy == "kept" and len(score):
        score = score * np.sqrt(ctx._kept_energy(arr))
    elif ctx.strategy == "random":
        priority = np.random.default_rng(ctx.seed).random(len(score))
    elif ctx.strategy == "uniform":
        priority = _uniform_priority(arr["expert"], arr["tensor"], arr["block"])
    cands = Candidates(arr["expert"], arr["tensor"], arr["block"], arr["nbytes"], score, bound_term, priority,
                       arr["setup"])
    cands.l2 = arr["l2"]  # ||delta|| of each block (the sparsified operators' bound, planner/bounds.py)
    cands.l1 = arr["l1"]  # ||delta||_1 of each block (the same bound where a rescale preserves L1)
    return cands


def _candidate_table(ctx) -> dict[str, np.ndarray]:
    """The candidates' columns: expert, tensor, block, nbytes, l2 (||delta|| of the block), l1, setup; the
    analyzed experts' blocks come from one query (catalog/analyses.changed_block_table), filtered in arrays."""
    merged = [t["name"] for t in ctx.tensors if t["dtype"] in FLOAT_DTYPES
              and t["name"] not in (ctx.vocab or {}).get("tensors", {})]
    experts = list(enumerate(ctx.experts if not ctx.op.copies else ()))  # passthrough reads no delta
    parts = [_all_blocks(ctx, ei, e) for ei, e in experts if e.get("analyze")]
    analyzed = [(ei, e) for ei, e in experts if not e.get("analyze")]
    if analyzed:
        parts.append(_analyzed_blocks(ctx, analyzed, merged))
    table = np.concatenate(parts) if parts else np.zeros((0, 7))
    table = table[np.argsort(table[:, 0], kind="stable")] if len(parts) > 1 else table
    cols = {"expert": table[:, 0], "tensor": table[:, 1], "block": table[:, 2], "nbytes": table[:, 3],
            "l2": table[:, 4], "l1": table[:, 5], "setup": table[:, 6]}
    return {k: np.array(v, dtype=np.float64 if k in ("l2", "l1") else np.int64) for k, v in cols.items()}


def _analyzed_blocks(ctx, analyzed: list[tuple[int, dict]], merged: list[str]) -> np.ndarray:
    """The changed blocks of analyzed experts past their thresholds (ops.core.useful_blocks, per row), as the
    candidate table's columns, in expert order then the catalog's block order."""
    rows = analyses.changed_block_table(ctx.catalog, [e["id"] for _, e in analyzed])
    if not rows:
        return np.zeros((0, 7))
    expert_of = {e["id"]: ei for ei, e in analyzed}
    tensor_of = {name: ctx.tensor_index[name] for name in merged}
    n_t = len(ctx.tensors)
    ei = np.fromiter((expert_of[r[0]] for r in rows), dtype=np.int64, count=len(rows))
    ti = np.fromiter((tensor_of.get(r[1], -1) for r in rows), dtype=np.int64, count=len(rows))
    num = np.array([r[2:] for r in rows], dtype=np.float64).reshape(-1, 5)  # block, nbytes, l2, l1, max_abs
    keep = ti >= 0
    useful = _useful(ctx, analyzed, merged, n_t)  # [K, T] smallest kept magnitude (-inf: every block)
    keep &= num[:, 4] >= useful[ei, np.maximum(ti, 0)]
    setup = np.zeros((len(ctx.experts), n_t))
    for eid, name, fixed in analyses.fixed_bytes_table(ctx.catalog, list(expert_of)):
        if name in tensor_of:
            setup[expert_of[eid], tensor_of[name]] = fixed
    table = np.column_stack([ei, ti, num[:, :4], setup[ei, np.maximum(ti, 0)]])[keep]
    return table[np.argsort(table[:, 0], kind="stable")]


def _useful(ctx, analyzed: list[tuple[int, dict]], merged: list[str], n_t: int) -> np.ndarray:
    """[K, T]: the smallest max |delta| of a block that contributes (ops.core.useful_blocks, per (expert, tensor)):
    -inf without a magnitude threshold, +inf where a thresholded operator has none for the tensor."""
    out = np.full((len(ctx.experts), n_t), -np.inf)
    if not ctx.op.thresholded:
        return out
    at = 0 if ctx.op.sparsify is Sparsify.MAGNITUDE else 1  # TIES' threshold, breadcrumbs' lower one
    for ei, e in analyzed:
        thr = ctx.thresholds.get(e["id"], {})
        for name in merged:
            t = thr.get(name)
            out[ei, ctx.tensor_index[name]] = t[at] if t else np.inf
    return out


def _all_blocks(ctx, ei: int, expert: dict) -> np.ndarray:
    """Every block of an expert analyzed on the way (it has no statistics to choose from): the
    columns of the candidate table, with no score."""
    source = open_source(expert["kind"], expert["uri"])
    composed = (ctx.vocab or {}).get("tensors", {})  # re-ordered rows: read whole by the engine (engine/vocab.py)
    rows = []
    for ti, t in enumerate(ctx.tensors):
        if (t["dtype"] not in FLOAT_DTYPES or t["name"] in composed
                or not source.has_delta(t["name"], t["shape"])):
            continue
        setup = fixed_bytes(source, t["name"])
        for span in tensor_grid(tensor_info(t), ctx.block_bytes):
            nbytes = sum(n for _, _, n in source.block_ranges(t["name"], span))
            rows.append((ei, ti, span.index, nbytes, 0.0, 0.0, setup))
    return np.array(rows, dtype=np.float64).reshape(-1, 7)


def tensor_info(row: dict) -> TensorInfo:
    """A catalog tensor row as the storage layer's TensorInfo."""
    return TensorInfo(row["name"], row["dtype"], tuple(row["shape"]), row["file"], row["offset"], row["nbytes"])
