"""Error bounds: the additive bound's tighter blockwise form and the estimated norm of the full merge."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from mergepipe.catalog import analyses
from mergepipe.ops.spec import Sparsify

# The suggested budget's rule: the smallest greedy budget whose blockwise bound is at most this fraction of
# the estimated ||M_full - base||. From the fidelity study on real fine-tunes (docs/fidelity/README.md: the
# smallest blockwise bound at which an additive merge stayed within 1 point of its full merge).
# Fitted in the tiered fidelity study (docs/fidelity/tiered.md, `python -m benchmarks.fidelity.suggest_rule`): the
# largest fraction, rounded down, at which no budget the rule picks on the fit configurations (linear and
# task_arithmetic, full and LoRA experts, K = 8 and the first K = 4 group) lost more than 1 point against its full
# merge; then applied unchanged to 20 other configurations (the second K = 4 group, the four K = 2 groups). One rule for three-way
# plans (compacts in the catalog), one for exact-or-omitted plans. Not re-fitted per run: change it with the study.
SUGGEST_RULES = {
    "tiered": {"fraction": 0.46, "fit": "8 of 8", "within": 18, "of": 20},
    "exact": {"fraction": 0.72, "fit": "8 of 8", "within": 12, "of": 20},
}
SUGGEST_BOUND_FRACTION = SUGGEST_RULES["exact"]["fraction"]
WHERE = "docs/fidelity/tiered.md"
# what the exact-only rule did on configurations it was not fitted on (EXPLAIN states it as measured)
SUGGEST_VALIDATION = {"within": SUGGEST_RULES["exact"]["within"], "of": SUGGEST_RULES["exact"]["of"], "where": WHERE}


def _zero_bound() -> dict:
    return {"absolute": 0.0, "relative": 0.0, "kind": "sparsified", "full_delta_norm": None, "update_bound": 0.0}


class Bounds:
    """Error bounds of a plan: the full-merge norm estimated from sketches and the blockwise bound of the
    omitted blocks (a mixin of PlanContext: uses its candidates and sketch matrix)."""

    def full_norm_estimate(self) -> float:
        """Estimated ||M_full - base||_2 = ||sum_i c_i delta_i||, with cross terms from the sketches: per position
        (tensor, block), sum_ij c_i c_j ||d_i|| ||d_j|| cos_ij with cos_ij the sketches' cosine, which is
        ||sum_i c_i ||d_i|| u_i||^2 with u_i the unit sketch: O(K S) per position, not O(K^2 S)."""
        if hasattr(self, "_full_norm"):
            return self._full_norm
        ids = [e["id"] for e in self.experts]
        expert_of = {eid: i for i, eid in enumerate(ids)}
        sums: dict[tuple[int, int, int], np.ndarray] = {}  # (tensor, block, sketch length) -> sum_i a_i u_i
        rows = analyses.changed_block_sketch_table(self.catalog, ids) if ids else ()
        for chunk in _chunks(rows, 1024):
            for key, acc in _unit_sums(self, chunk, expert_of):
                sums[key] = acc if key not in sums else sums[key] + acc
        total = float(sum(float(np.dot(v, v)) for v in sums.values()))
        self._full_norm = math.sqrt(max(total, 0.0))
        return self._full_norm

    # --- estimates -------------------------------------------------------------------------------

    def _blockwise_bound(self, omitted: np.ndarray) -> float:
        """The blockwise bound of an exact-or-omitted selection (``omitted``: a mask of the candidates)."""
        return self._blockwise(np.where(omitted, self.candidates.bound_term, 0.0))

    def _blockwise(self, residual: np.ndarray) -> float:
        """A tighter bound: blocks at different (tensor, block) positions are disjoint coordinates, so
        ||sum of left-out updates||^2 = sum over positions of ||sum_i c_i r_i||^2, and each position's norm is
        at most the sum of its candidates' residual terms (|c_i| ||delta_i|| omitted, |c_i| times the compact's
        stored error norm, 0 read exactly). Never above the additive bound."""
        cands = self.candidates
        left = residual > 0
        if not left.any():
            return 0.0
        pos = cands.tensor[left] * (int(cands.block.max()) + 1) + cands.block[left]
        _, group = np.unique(pos, return_inverse=True)
        per_position = np.bincount(group, weights=residual[left])
        return float(np.sqrt(np.square(per_position).sum()))

    def _bound(self, residual: np.ndarray) -> dict:
        """A plan's error bound from its candidates' residual terms: ``absolute`` is the tightest sound bound
        it can state (the blockwise one); ``additive`` the plain sum over blocks, never tighter."""
        additive = float(residual.sum())
        blockwise = self._blockwise(residual)
        norm = self.full_norm_estimate()
        rel = (lambda x: x / norm if norm > 0 else 0.0)  # noqa: E731
        return {"absolute": blockwise, "relative": rel(blockwise), "kind": "blockwise", "full_delta_norm": norm,
                "blockwise": blockwise, "blockwise_relative": rel(blockwise),
                "additive": additive, "additive_relative": rel(additive)}

    def _sparsified_bound(self, exact: np.ndarray, tier: np.ndarray | None) -> dict | None:
        """A sound bound for the operators that sparsify each delta (TIES, DARE, breadcrumbs, DELLA; with or
        without sign consensus), from the catalog alone. Per position where some expert's block is not read
        exactly, ||M_full - M_A|| is at most the norm of both merges' updates there (sign consensus: each entry of
        a normalized merge with positive weights is a weighted mean of the agreeing experts' values, so its update
        is at most sqrt(sum_i ||tau_i||^2); otherwise the weighted sum), with ||tau_i|| bounded by the block's
        ||delta||_2 (times TIES' L1 ratio), or by its ||delta||_1 where an L1-preserving rescale may amplify it
        (DARE, DELLA, breadcrumbs with rescale). Loose, but sound; None where no bound holds (sign consensus
        under normalize with a weight <= 0: its divisor can vanish)."""
        cands = self.candidates
        if not len(cands.nbytes):
            return _zero_bound()
        ratio, l1_scaled, lam, normalize = self._sparsify_factors()
        if self.op.consensus and (normalize & (self.weight_matrix[cands.expert, cands.tensor] <= 0)).any():
            return None
        l2 = cands.l2
        l1 = self._block_l1() if l1_scaled.any() else np.zeros(len(l2))
        full = np.where(l1_scaled, l1, ratio * l2)
        plan = np.where(exact, full, 0.0)
        if tier is not None:
            for lv in self.tiers.levels:
                at = tier == lv
                err = self.tiers.errors[lv][at]
                entries = self.tiers.entries[at]
                plan[at] = np.where(l1_scaled[at], l1[at] + np.sqrt(entries) * err, ratio[at] * (l2[at] + err))
        return self._position_bound(exact, full, plan, lam, normalize)

    def _sparsify_factors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate: TIES' L1 ratio (magnitude pruning with rescale), whether an L1-preserving rescale
        applies (the bound takes ||delta||_1), |lambda| and normalize on its tensor."""
        cands = self.candidates
        n_t = len(self.tensors)
        ratio_kt = np.ones((len(self.experts), n_t))
        scaled_t, lam_t, normalize_t = np.zeros(n_t, dtype=bool), np.zeros(n_t), np.zeros(n_t, dtype=bool)
        present = np.zeros(n_t, dtype=bool)
        present[np.unique(cands.tensor)] = True
        for ti in np.nonzero(present)[0]:
            name = self.tensors[ti]["name"]
            params = self.params_for(name)
            lam_t[ti], normalize_t[ti] = abs(float(params["lambda"])), bool(params["normalize"])
            if self.op.sparsify is Sparsify.MAGNITUDE and params.get("rescale"):
                for ei, e in enumerate(self.experts):
                    thr = self.thresholds.get(e["id"], {}).get(name) or []
                    ratio_kt[ei, ti] = thr[1] if len(thr) > 1 else 1.0
            elif self.op.sparsify is not Sparsify.MAGNITUDE and params.get("rescale"):
                scaled_t[ti] = True
        ratio = ratio_kt[cands.expert, cands.tensor]
        l1_scaled, lam, normalize = scaled_t[cands.tensor], lam_t[cands.tensor], normalize_t[cands.tensor]
        return ratio, l1_scaled, lam, normalize

    def _block_l1(self) -> np.ndarray:
        """||delta||_1 of each candidate block, from the catalog (read with the candidates)."""
        return self.candidates.l1

    def _position_bound(self, exact: np.ndarray, full: np.ndarray, plan: np.ndarray, lam: np.ndarray,
                        normalize: np.ndarray) -> dict:
        """The sparsified bound from per-candidate update norms (``full``: the full merge's, ``plan``: the
        plan's), summed per position (tensor, block) where some expert's block is not read exactly."""
        cands = self.candidates
        pos = cands.tensor * (int(cands.block.max()) + 1) + cands.block
        _, group = np.unique(pos, return_inverse=True)
        inexact = np.bincount(group, weights=(~exact).astype(np.float64)) > 0
        w = np.abs(self.weight_matrix[cands.expert, cands.tensor])
        if self.op.consensus:
            mean = normalize  # a weighted mean of the agreeing values, per entry
            a = np.where(mean, full ** 2, 0.0)
            b = np.where(mean, plan ** 2, 0.0)
            per_full = np.sqrt(np.bincount(group, weights=a)) + np.bincount(group, weights=np.where(mean, 0.0, w * full))
            per_plan = np.sqrt(np.bincount(group, weights=b)) + np.bincount(group, weights=np.where(mean, 0.0, w * plan))
            lam_pos = np.bincount(group, weights=lam) / np.maximum(np.bincount(group), 1)
            per = lam_pos * (per_full + per_plan)
            update = lam_pos * per_full
        else:  # additive after sparsifying: the same coefficients as linear / task arithmetic
            c = np.abs(self.coef_matrix[cands.expert, cands.tensor])
            term = np.where(exact, 0.0, c * (full + np.where(plan > 0, plan, 0.0)))
            per = np.bincount(group, weights=term)
            update = np.bincount(group, weights=c * full)
        total = float(np.sqrt(np.square(np.where(inexact, per, 0.0)).sum()))
        scale = float(np.sqrt(np.square(update).sum()))
        return {"absolute": total, "relative": total / scale if scale > 0 else 0.0, "kind": "sparsified",
                "full_delta_norm": None, "update_bound": scale}

    def _prefix_residual(self, k: int) -> np.ndarray:
        """Residual terms after the first ``k`` steps of the greedy order (blocks, or the tiers' upgrades)."""
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            return tiers.prefix_residual(k)
        out = self.candidates.bound_term.astype(np.float64).copy()
        out[self.candidates.order[:k]] = 0.0
        return out

    def _greedy_steps(self) -> tuple[int, np.ndarray]:
        """(steps of the greedy order, bytes after each)."""
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            return len(tiers.order), tiers.cum_cost
        return len(self.candidates.order), self.candidates.cum_bytes

    def smallest_budget_for(self, target_abs: float) -> int:
        """The smallest greedy budget whose (blockwise) bound is at most ``target_abs`` (--target-bound)."""
        n, cum = self._greedy_steps()
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if self._blockwise(self._prefix_residual(mid)) <= target_abs:
                hi = mid
            else:
                lo = mid + 1
        return int(cum[lo - 1]) if lo else 0

    def suggested_budget(self, fraction: float | None = None) -> dict | None:
        """The smallest budget, in the plan's greedy order, whose blockwise bound is at most ``fraction`` x
        the estimated norm of the merged update (the bound falls as blocks are added, so a binary search
        over prefixes finds it); None when there is nothing to omit or no update."""
        cands = self.candidates
        norm = self.full_norm_estimate()
        n = len(cands.order)
        if n == 0 or norm <= 0:
            return None
        rule = SUGGEST_RULES["tiered" if getattr(self, "tiers", None) is not None else "exact"]
        fraction = rule["fraction"] if fraction is None else fraction
        target = fraction * norm

        n, cum = self._greedy_steps()

        def bound_of(k: int) -> float:
            return self._blockwise(self._prefix_residual(k))
        lo, hi = 0, n  # bound_of(n) == 0 <= target
        while lo < hi:
            mid = (lo + hi) // 2
            if bound_of(mid) <= target:
                hi = mid
            else:
                lo = mid + 1
        nbytes = int(cum[lo - 1]) if lo else 0
        return {"bytes": nbytes, "fraction_of_full": nbytes / cands.full_bytes if cands.full_bytes else 0.0,
                "bound_fraction": fraction, "blockwise": bound_of(lo), "full_delta_norm": norm,
                "validation": {"within": rule["within"], "of": rule["of"], "where": WHERE,
                               "plans": "tiered" if getattr(self, "tiers", None) is not None else "exact"}}


def _chunks(rows, n: int):
    """Lists of up to ``n`` rows of a cursor (the sketches are decoded a chunk at a time: bounded memory)."""
    fetch = getattr(rows, "fetchmany", None)
    while fetch is not None:  # a cursor: n rows a call, not a Python step per row
        chunk = fetch(n)
        if not chunk:
            return
        yield chunk
    chunk = []
    for r in rows:
        chunk.append(r)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _unit_sums(ctx, rows: list[tuple], expert_of: dict[str, int]):
    """Per (tensor, block, sketch length) among ``rows`` (model_id, tensor, block, delta_l2, sketch):
    sum over its experts of c_i ||d_i|| u_i, u_i the expert's sketch scaled to unit norm (fp16 samples).
    Rows of a merged tensor only, decoded in (position, row) order so that each position's rows are adjacent."""
    ti = np.fromiter((ctx.tensor_index.get(r[1], -1) for r in rows), dtype=np.int64, count=len(rows))
    ln = np.fromiter((len(r[4] or b"") for r in rows), dtype=np.int64, count=len(rows))
    block = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
    live = np.nonzero((ti >= 0) & (ln > 0))[0]
    order = live[np.lexsort((block[live], ti[live], ln[live]))]
    for length in np.unique(ln[order]):
        idx = order[ln[order] == length]
        sk = _f16_table().take(np.frombuffer(b"".join([rows[i][4] for i in idx]), dtype=np.uint16))
        sk = sk.reshape(len(idx), -1)
        norms = np.sqrt(np.einsum("rs,rs->r", sk, sk))
        ei = np.fromiter((expert_of[rows[i][0]] for i in idx), dtype=np.int64, count=len(idx))
        l2 = np.fromiter((rows[i][3] or 0.0 for i in idx), dtype=np.float64, count=len(idx))
        a = np.divide(ctx.coef_matrix[ei, ti[idx]] * l2, norms, out=np.zeros(len(idx)), where=norms > 0)
        sk *= a.astype(np.float32)[:, None]
        key = ti[idx] * (int(block[idx].max()) + 1) + block[idx]
        starts = np.r_[0, np.nonzero(np.diff(key))[0] + 1]
        for start, v in zip(starts.tolist(), _row_sums(sk, starts)):
            yield (int(ti[idx[start]]), int(block[idx[start]]), int(length)), v.astype(np.float64)


@lru_cache(maxsize=1)
def _f16_table() -> np.ndarray:
    """Every float16 bit pattern's float32 value (a lookup is ~4x faster than numpy's float16 cast, same bits)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _row_sums(sk: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """``np.add.reduceat(sk, starts, axis=0)`` bit for bit, ~10x faster on rows of sketches: reduceat adds a
    group's first row to numpy's pairwise sum of the others (eight running sums, 8 rows at a time, combined as
    ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the remainder one by one), which is done here on whole rows."""
    ends = [*starts[1:].tolist(), len(sk)]
    return [_group_sum(sk[s:e]) if e - s <= _PAIRWISE_BLOCK + 1 else np.add.reduceat(sk[s:e], [0], axis=0)[0]
            for s, e in zip(starts.tolist(), ends)]


_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: longer sums are split in halves (left to reduceat)


def _group_sum(rows: np.ndarray) -> np.ndarray:
    rest, n = rows[1:], len(rows) - 1
    if n < 8:
        acc = np.full(rows.shape[1], -0.0, rows.dtype)
        for i in range(n):
            acc += rest[i]
        return rows[0] + acc
    r = rest[:8].copy()
    whole = n - n % 8
    for i in range(8, whole, 8):
        r += rest[i:i + 8]
    acc = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for i in range(whole, n):
        acc += rest[i]
    return rows[0] + acc
