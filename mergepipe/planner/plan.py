"""The budget-aware planner: which (expert, tensor, block) triples to read, decided from the catalog
alone, before any expert byte is read.

Greedy by score per byte (default score |c_i| * ||delta_{i,t,b}||_2, which minimises the additive error
bound), deterministic tie-break (expert order, tensor order, block index), budget-sound by
construction. A plan is data: canonical JSON with a digest over the inputs' fingerprints, operator,
parameters, grid and access set.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from mergepipe import __version__
from mergepipe.planner.budget import mib, parse_budget
from mergepipe.catalog.db import Catalog, now
from mergepipe.errors import PlanError
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES, tensor_grid
from mergepipe.manifest.build import canonical
from mergepipe.ops.core import (
    OpSpec, coefficient, get_op, lookup_thresholds, resolve_params, threshold_fractions, useful_blocks,
)
from mergepipe.catalog.models import check_unchanged
from mergepipe.planner.settings import (
    check_setting, is_scalar, layer_t, num_layers, resolve, tensor_density, tensor_weight,
)
from mergepipe.catalog.sketch import decode
from mergepipe.storage.sources import fixed_bytes, open_source
from mergepipe.storage.safetensors import FLOAT_DTYPES, TensorInfo

# How candidate blocks are ranked (greedy takes the highest priority per byte first):
#   norm      |c_i| * ||delta||_2 per byte: minimises the additive error bound (the default)
#   conflict  norm, discounted by the block's sign-conflict rate against the other experts (sketches)
#   kept      norm of the part of delta the operator keeps (entries above the TIES/breadcrumbs
#             magnitude threshold, estimated from the sketch); equals norm for other operators
#   random    a seeded random order (a baseline for studies)
#   uniform   the same fraction of every (expert, tensor), blocks spread evenly (a baseline)
STRATEGIES = ("norm", "conflict", "kept", "random", "uniform")
PLAN_FORMAT = "mergepipe.plan/1"


@dataclass
class Plan:
    """A content-addressed merge plan. ``data`` is the canonical, JSON-serialisable form."""

    data: dict

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def digest(self) -> str:
        return self.data["digest"]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.data, sort_keys=True, indent=indent, separators=None if indent else (",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(json.loads(text))

    def __getitem__(self, key):
        return self.data[key]

    @property
    def selected_blocks(self) -> int:
        return sum(r[1] - r[0] for tensors in self.data["access"].values() for rs in tensors.values() for r in rs)

    def explain(self) -> str:
        return explain_plan(self.data)


def compact_ranges(indices) -> list[list[int]]:
    """[0,1,2,5,6] -> [[0,3],[5,7]] (half-open ranges)."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def expand_ranges(ranges) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


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


class PlanContext:
    """Everything about a merge request except the budget: reusable while a user drags a slider."""

    def __init__(self, catalog: Catalog, base_model: str, experts, operator: str = "ties",
                 weights=None, density=None, lam=None, normalize=None, rescale=None, seed: int = 0,
                 strategy: str = "norm", gamma=None, epsilon=None, weight=None):
        self.catalog = catalog
        self.op: OpSpec = get_op(operator)
        self.params = resolve_params(self.op, normalize=normalize, rescale=rescale, lam=lam,
                                     gamma=gamma, epsilon=epsilon)
        self.seed = int(seed)
        if strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
        self.strategy = strategy
        self.base = catalog.model(base_model)
        self.tensors = [t for t in catalog.tensors(self.base["id"])]
        self.tensor_index = {t["name"]: i for i, t in enumerate(self.tensors)}
        self.experts = self._expert_specs(experts, weights, density, weight)
        self.block_bytes = catalog.grid_block_bytes(self.base["id"]) or DEFAULT_BLOCK_BYTES
        names = [t["name"] for t in self.tensors]
        # [K, T] weight of each expert on each tensor, and its coefficient in the merged delta
        self.weight_matrix = np.array([[tensor_weight(e, n) or 0.0 for n in names] for e in self.experts],
                                      dtype=np.float64).reshape(len(self.experts), len(names))
        self.weight_sums = self.weight_matrix.sum(axis=0)
        self.coef_matrix = np.array([[coefficient(self.op, w, ws, self.params) for w, ws in zip(row, self.weight_sums)]
                                     for row in self.weight_matrix]).reshape(self.weight_matrix.shape)
        self.thresholds = self._thresholds()
        self.candidates = self._candidates()

    def _expert_specs(self, experts, weights, density, weight=None) -> list[dict]:
        if not experts:
            raise PlanError("no experts given")
        specs = []
        for i, e in enumerate(experts):
            spec = {"model": e} if isinstance(e, str) else dict(e)
            if "model" not in spec:
                raise PlanError(f"expert {e!r} has no model id")
            specs.append(spec)
        ids = [s["model"] for s in specs]
        if len(set(ids)) != len(ids):
            raise PlanError(f"an expert is listed twice: {', '.join(sorted({i for i in ids if ids.count(i) > 1}))}")
        if weights is not None:
            if len(weights) != len(specs):
                raise PlanError(f"{len(weights)} weights given for {len(specs)} experts")
            for s, w in zip(specs, weights):
                s["weight"] = w
        global_w = None if weight is None else check_setting(weight, "weight")
        global_d = None if density is None else check_setting(density, "density")
        check_unchanged(self.base)
        out = []
        for s in specs:
            row = self.catalog.model(s["model"])
            if row["base_id"] != self.base["id"]:
                raise PlanError(f"expert {row['id']!r} is registered with base {row['base_id']!r}, not {self.base['id']!r}")
            check_unchanged(row)
            w = check_setting(s["weight"], f"weight of {row['id']}") if s.get("weight") is not None else None
            d = check_setting(s["density"], f"density of {row['id']}") if s.get("density") is not None else None
            spec = {"id": row["id"], "uri": row["uri"], "fingerprint": row["fingerprint"], "kind": row["kind"]}
            if not self.catalog.is_analyzed(row["id"]):
                spec["analyze"] = "not analyzed"
            if all(v is None or is_scalar(v) for v in (w, d, global_w, global_d)):
                spec["weight"] = w if w is not None else (global_w if global_w is not None else 1.0)
                dd = d if d is not None else (global_d if global_d is not None else 1.0)
                self._check_density(row["id"], dd)
                spec["density"] = dd if self.op.uses_density else None
            else:
                spec.update(self._per_tensor(row["id"], [w, global_w], [d, global_d]))
            out.append(spec)
        return out

    def _check_density(self, expert_id: str, d: float, where: str = "") -> None:
        if self.op.uses_density and not 0 < d <= 1:
            raise PlanError(f"density {d:g} of {expert_id}{where} is outside (0, 1]")
        if self.op.sparsify == "della":
            eps = self.params["epsilon"]
            if d < 1 and not (0 < eps and d - eps > 0 and d + eps <= 1):
                raise PlanError(f"della needs 0 < density - epsilon and density + epsilon <= 1 "
                                f"(density {d:g}{where}, epsilon {eps})")

    def _per_tensor(self, expert_id: str, weight_settings, density_settings) -> dict:
        """Weight and density of one expert for every float tensor, from filters and gradients."""
        names = [t["name"] for t in self.tensors if t["dtype"] in FLOAT_DTYPES]
        layers = num_layers([t["name"] for t in self.tensors], json.loads(self.base["config"] or "{}"))
        values = {}
        for name in names:
            t = layer_t(name, layers)
            w = resolve(weight_settings, name, t, 1.0)
            d = resolve(density_settings, name, t, 1.0)
            self._check_density(expert_id, d, f" on {name}")
            values[name] = [w, d if self.op.uses_density else None]
        ws = {v[0] for v in values.values()}
        ds = {v[1] for v in values.values()}
        return {"weight": ws.pop() if len(ws) == 1 else None, "density": ds.pop() if len(ds) == 1 else None,
                "settings": {"weight": weight_settings[0], "density": density_settings[0]},
                "tensors": values}

    def _thresholds(self) -> dict[str, dict[str, list[float]]]:
        """Magnitude thresholds per (expert, tensor) from the catalog. An expert lacking one for a
        density this merge needs is marked to be analyzed on the way (the merge reads it in full)."""
        out: dict[str, dict[str, list[float]]] = {}
        if self.op.sparsify not in ("magnitude", "magnitude_outliers"):
            return out
        for e in self.experts:
            if e.get("analyze"):
                continue
            rows = self.catalog.conn.execute(
                "SELECT tensor, thresholds FROM tensor_stats WHERE model_id = ? AND delta_nnz > 0", [e["id"]])
            per = {}
            for name, text in rows:
                fracs = threshold_fractions(self.op, tensor_density(e, name) or 1.0, self.params)
                vals = lookup_thresholds(json.loads(text or "{}"), fracs)
                if vals is None:
                    missing = ", ".join(f"{f:g}" for f in fracs if lookup_thresholds(json.loads(text or "{}"), [f]) is None)
                    e["analyze"] = f"no magnitude threshold for top-{missing}"
                    break
                if fracs:
                    per[name] = vals
            if per and not e.get("analyze"):
                out[e["id"]] = per
        return out

    @property
    def to_analyze(self) -> list[dict]:
        """Experts this merge analyzes on the way (not analyzed, changed, or missing a threshold)."""
        return [e for e in self.experts if e.get("analyze")]

    def _all_blocks(self, ei: int, expert: dict) -> np.ndarray:
        """Every block of an expert analyzed on the way (it has no statistics to choose from): the
        columns of the candidate table, with no score."""
        source = open_source(expert["kind"], expert["uri"])
        rows = []
        for ti, t in enumerate(self.tensors):
            if t["dtype"] not in FLOAT_DTYPES or not source.has_delta(t["name"]):
                continue
            setup = fixed_bytes(source, t["name"])
            for span in tensor_grid(_info(t), self.block_bytes):
                nbytes = sum(n for _, _, n in source.block_ranges(t["name"], span))
                rows.append((ei, ti, span.index, nbytes, 0.0, setup))
        return np.array(rows, dtype=np.float64).reshape(-1, 6)

    def _candidates(self) -> Candidates:
        float_tensor = {t["name"] for t in self.tensors if t["dtype"] in FLOAT_DTYPES}
        parts = []
        for ei, e in enumerate(self.experts):
            if e.get("analyze"):
                parts.append(self._all_blocks(ei, e))
                continue
            fixed = dict(self.catalog.conn.execute(
                "SELECT tensor, fixed_bytes FROM tensor_stats WHERE model_id = ? AND fixed_bytes > 0", [e["id"]]))
            rows = self.catalog.conn.execute(
                "SELECT tensor, block, nbytes, delta_l2, delta_max_abs FROM blocks WHERE model_id = ? AND delta_nnz > 0",
                [e["id"]]).fetchall()
            by_tensor: dict[str, list] = {}
            for r in rows:
                if r[0] in float_tensor:
                    by_tensor.setdefault(r[0], []).append(r)
            for name, rs in by_tensor.items():
                a = np.array([r[1:] for r in rs], dtype=np.float64)  # block, nbytes, l2, max_abs
                useful = useful_blocks(self.op, self.thresholds.get(e["id"], {}).get(name), a[:, 3])
                a = a[useful]
                parts.append(np.column_stack([np.full(len(a), ei), np.full(len(a), self.tensor_index[name]), a[:, :3],
                                              np.full(len(a), fixed.get(name, 0))]))
        table = np.concatenate(parts) if parts else np.zeros((0, 6))
        cols = {"expert": table[:, 0], "tensor": table[:, 1], "block": table[:, 2], "nbytes": table[:, 3],
                "l2": table[:, 4], "setup": table[:, 5]}
        arr = {k: np.array(v, dtype=np.float64 if k == "l2" else np.int64) for k, v in cols.items()}
        coefs = np.abs(self.coef_matrix)
        bound_term = coefs[arr["expert"], arr["tensor"]] * arr["l2"] if len(arr["l2"]) else np.zeros(0)
        score = bound_term.copy()
        priority = None
        if self.strategy == "conflict" and len(score):
            score = score * (1.0 - self._conflict_rates(arr))
        elif self.strategy == "kept" and len(score):
            score = score * np.sqrt(self._kept_energy(arr))
        elif self.strategy == "random":
            priority = np.random.default_rng(self.seed).random(len(score))
        elif self.strategy == "uniform":
            priority = _uniform_priority(arr["expert"], arr["tensor"], arr["block"])
        return Candidates(arr["expert"], arr["tensor"], arr["block"], arr["nbytes"], score, bound_term, priority,
                          arr["setup"])

    def _sketch_matrix(self):
        """Per (tensor, block): the experts' sketches rescaled to delta units, as [blocks, K, S]."""
        if hasattr(self, "_sketches"):
            return self._sketches
        keys: dict[tuple[str, int], int] = {}
        index, expert, scale, blobs = [], [], [], []
        for ei, e in enumerate(self.experts):
            for tensor, block, mx, blob in self.catalog.conn.execute(
                    "SELECT tensor, block, delta_max_abs, sketch FROM blocks WHERE model_id = ? AND delta_nnz > 0",
                    [e["id"]]):
                index.append(keys.setdefault((tensor, block), len(keys)))
                expert.append(ei)
                scale.append(mx)
                blobs.append(blob)
        size = max((len(b) // 2 for b in blobs), default=0)
        mat = np.zeros((len(keys), len(self.experts), size), dtype=np.float32)
        full = [i for i, b in enumerate(blobs) if len(b) == 2 * size]  # most blocks: decode them at once
        if full:
            vals = np.frombuffer(b"".join(blobs[i] for i in full), dtype=np.float16).reshape(len(full), size)
            sel = np.array(full)
            mat[np.array(index)[sel], np.array(expert)[sel]] = vals.astype(np.float32) * np.array(scale, dtype=np.float32)[sel, None]
        for i in set(range(len(blobs))) - set(full):  # small blocks sample every element
            v = decode(blobs[i]) * scale[i]
            mat[index[i], expert[i], : len(v)] = v
        self._sketches = (keys, mat)
        return self._sketches

    def _conflict_rates(self, arr) -> np.ndarray:
        """For each candidate: sign-conflict rate of the expert's delta against the others' weighted sum."""
        keys, mat = self._sketch_matrix()
        wm = self.weight_matrix.astype(np.float32)
        rates = np.zeros(len(arr["expert"]))
        names = [t["name"] for t in self.tensors]
        for n, (ei, ti, b) in enumerate(zip(arr["expert"], arr["tensor"], arr["block"])):
            idx = keys.get((names[ti], int(b)))
            if idx is None:
                continue
            weighted = mat[idx] * wm[:, ti, None]
            mine = weighted[ei]
            others = weighted.sum(axis=0) - mine
            both = (mine != 0) & (others != 0)
            if both.any():
                rates[n] = float((np.sign(mine[both]) != np.sign(others[both])).mean())
        return rates

    def _kept_energy(self, arr) -> np.ndarray:
        """For each candidate: the share of its block's energy above the operator's magnitude threshold.

        Estimated from the block's sketch (a fixed sample of delta). Operators without a magnitude
        threshold keep everything (share 1)."""
        if self.op.sparsify not in ("magnitude", "magnitude_outliers"):
            return np.ones(len(arr["expert"]))
        keys, mat = self._sketch_matrix()
        names = [t["name"] for t in self.tensors]
        share = np.ones(len(arr["expert"]))
        for n, (ei, ti, b) in enumerate(zip(arr["expert"], arr["tensor"], arr["block"])):
            idx = keys.get((names[ti], int(b)))
            thr = self.thresholds.get(self.experts[ei]["id"], {}).get(names[ti])
            if idx is None or not thr:
                continue
            v = mat[idx, ei]
            lo, hi = (thr[0], math.inf) if self.op.sparsify == "magnitude" else (thr[1], thr[0])
            energy = float((v * v).sum())
            if energy > 0:
                a = np.abs(v)
                share[n] = float((v[(a >= lo) & (a <= hi)] ** 2).sum()) / energy
        return share

    def full_norm_estimate(self) -> float:
        """Estimated ||M_full - base||_2 = ||sum_i c_i delta_i||, with cross terms from the sketches."""
        if hasattr(self, "_full_norm"):
            return self._full_norm
        keys, mat = self._sketch_matrix()
        key_tensor = np.zeros(len(keys), dtype=np.int64)
        for (tensor, _), i in keys.items():
            key_tensor[i] = self.tensor_index[tensor]
        coefs = self.coef_matrix[:, key_tensor].T  # [B, K]
        l2 = np.zeros((len(keys), len(self.experts)))
        for ei, e in enumerate(self.experts):
            for tensor, block, value in self.catalog.conn.execute(
                    "SELECT tensor, block, delta_l2 FROM blocks WHERE model_id = ? AND delta_nnz > 0", [e["id"]]):
                l2[keys[(tensor, block)], ei] = value
        gram = np.matmul(mat, mat.transpose(0, 2, 1))  # [B, K, K] sketch inner products (batched BLAS)
        norms = np.sqrt(np.maximum(np.einsum("bkk->bk", gram), 0))
        # cos_ij * ||d_i|| * ||d_j|| with cos estimated from the sketches
        a = np.divide(l2 * coefs, norms, out=np.zeros_like(l2), where=norms > 0)  # [B, K]
        total = float(np.einsum("bk,bkj,bj->", a, gram, a, optimize=True))
        self._full_norm = math.sqrt(max(total, 0.0))
        return self._full_norm

    # --- estimates -------------------------------------------------------------------------------
    def base_bytes(self) -> int:
        return sum(t["nbytes"] for t in self.tensors)

    def plan(self, budget=None, budget_mb=None, target_bound: float | None = None) -> Plan:
        cands = self.candidates
        full = cands.full_bytes
        if budget_mb is not None:
            budget = mib(budget_mb)
        budget_spec = f"target-bound {target_bound:g}" if target_bound is not None else (
            "100%" if budget is None else str(budget))
        if target_bound is not None and not target_bound >= 0:
            raise PlanError("--target-bound must be a non-negative number")
        if target_bound is not None and not self.op.additive:
            raise PlanError(f"--target-bound needs an additive operator (linear, task_arithmetic), not {self.op.name}")
        if target_bound is None and full:
            parse_budget(budget_spec, full)  # a bad budget is refused, first merge or not
        if self.to_analyze:  # a first merge: the budget applies from the next merge on
            return self._build(cands.order, budget_spec, full, target_bound, first_merge=True)
        if target_bound is not None:
            norm = self.full_norm_estimate()
            budget_bytes = cands.smallest_budget_for(target_bound * norm) if full else 0
        else:
            budget_bytes = parse_budget(budget_spec, full) if full else 0
        chosen = cands.select(budget_bytes) if full else np.zeros(0, dtype=np.int64)
        return self._build(chosen, budget_spec, budget_bytes, target_bound)

    def _blockwise_bound(self, omitted: np.ndarray) -> float:
        """A tighter bound: blocks at different (tensor, block) positions are disjoint coordinates, so
        ||sum of omitted updates||^2 = sum over positions of ||sum_i c_i delta_i||^2, and each position's
        norm is at most the sum of its omitted |c_i| * ||delta_i||. Never above the additive bound."""
        cands = self.candidates
        if not omitted.any():
            return 0.0
        pos = cands.tensor[omitted] * (int(cands.block.max()) + 1) + cands.block[omitted]
        _, group = np.unique(pos, return_inverse=True)
        per_position = np.bincount(group, weights=cands.bound_term[omitted])
        return float(np.sqrt(np.square(per_position).sum()))

    def _build(self, chosen: np.ndarray, budget_spec: str, budget_bytes: int, target_bound,
               first_merge: bool = False) -> Plan:
        cands = self.candidates
        names = [t["name"] for t in self.tensors]
        access: dict[str, dict[str, list[int]]] = {e["id"]: {} for e in self.experts}
        per_expert_bytes = {e["id"]: 0 for e in self.experts}
        per_tensor_bytes: dict[str, int] = {}
        for c, nbytes in zip(chosen, cands.bytes_of(chosen)):
            eid = self.experts[cands.expert[c]]["id"]
            tname = names[cands.tensor[c]]
            access[eid].setdefault(tname, []).append(int(cands.block[c]))
            per_expert_bytes[eid] += int(nbytes)
            per_tensor_bytes[tname] = per_tensor_bytes.get(tname, 0) + int(nbytes)
        access = {e: {t: compact_ranges(b) for t, b in sorted(ts.items())} for e, ts in access.items()}
        expert_read = sum(per_expert_bytes.values())
        selected_mask = np.zeros(len(cands.nbytes), dtype=bool)
        selected_mask[chosen] = True
        bound = None
        if self.op.additive and self.to_analyze:  # every block is read: nothing omitted
            bound = {"absolute": 0.0, "full_delta_norm": None, "relative": 0.0, "blockwise": 0.0,
                     "blockwise_relative": 0.0}
        elif self.op.additive:
            omitted = float(cands.bound_term[~selected_mask].sum())
            blockwise = self._blockwise_bound(~selected_mask)
            norm = self.full_norm_estimate()
            bound = {"absolute": omitted, "full_delta_norm": norm,
                     "relative": omitted / norm if norm > 0 else 0.0,
                     "blockwise": blockwise, "blockwise_relative": blockwise / norm if norm > 0 else 0.0}
        base_bytes = self.base_bytes()
        core = {
            "format": PLAN_FORMAT,
            "base": {"id": self.base["id"], "uri": self.base["uri"], "fingerprint": self.base["fingerprint"]},
            "experts": self.experts,
            "operator": self.op.name,
            "params": self.params,
            "seed": self.seed,
            "strategy": self.strategy,
            "grid": {"block_bytes": self.block_bytes},
            "budget": {"spec": budget_spec, "bytes": budget_bytes, **({"first_merge": True} if first_merge else {})},
            "access": access,
            "thresholds": self.thresholds,
        }
        digest = hashlib.sha256(canonical(core)).hexdigest()
        data = dict(core)
        data.update({
            "id": "plan-" + digest[:16],
            "digest": "sha256:" + digest,
            "full_expert_bytes": cands.full_bytes,
            "estimate": {"base_read": base_bytes, "expert_read": expert_read, "output_write": base_bytes},
            "expert_read_by_expert": per_expert_bytes,
            "expert_read_by_tensor": dict(sorted(per_tensor_bytes.items())),
            "blocks_selected": {e: sum(r[1] - r[0] for rs in ts.values() for r in rs) for e, ts in access.items()},
            "blocks_candidate": {e["id"]: int((cands.expert == i).sum()) for i, e in enumerate(self.experts)},
            "blocks_total": sum(len(tensor_grid(_info(t), self.block_bytes)) for t in self.tensors),
            "error_bound": bound,
            "target_bound": target_bound,
            "software": {"mergepipe": __version__},
        })
        return Plan(data)


def _uniform_priority(expert: np.ndarray, tensor: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Priority that takes the same fraction of every (expert, tensor) group, spread over its blocks.

    Within a group of n candidates the j-th (by block index) gets the position of j in a
    van der Corput sequence, so any prefix of the greedy order covers each group evenly."""
    priority = np.zeros(len(block))
    groups: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(expert.tolist(), tensor.tolist())):
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        members.sort(key=lambda i: block[i])
        for j, i in enumerate(members):
            priority[i] = 1.0 - _van_der_corput(j)
    return priority


def _van_der_corput(n: int) -> float:
    q, denom = 0.0, 1.0
    while n:
        denom *= 2
        n, bit = divmod(n, 2)
        q += bit / denom
    return q


def _info(row: dict) -> TensorInfo:
    return TensorInfo(row["name"], row["dtype"], tuple(row["shape"]), row["file"], row["offset"], row["nbytes"])


class Planner:
    """``Planner(catalog).plan(base_model=..., experts=[...], operator="TIES", budget_mb=8192)``."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def context(self, base_model: str, experts, operator: str = "ties", **kw) -> PlanContext:
        return PlanContext(self.catalog, base_model, experts, operator, **kw)

    def plan(self, base_model: str, experts, operator: str = "ties", budget=None, budget_mb=None,
             target_bound=None, save: bool = True, **kw) -> Plan:
        plan = self.context(base_model, experts, operator, **kw).plan(budget, budget_mb, target_bound)
        if save:
            save_plan(self.catalog, plan)
        return plan


def save_plan(catalog: Catalog, plan: Plan) -> None:
    with catalog.transaction():
        catalog.db["plans"].upsert({
            "id": plan.id, "created_at": now(), "base_id": plan["base"]["id"], "operator": plan["operator"],
            "budget_bytes": plan["budget"]["bytes"], "full_expert_bytes": plan["full_expert_bytes"],
            "expert_read_bytes": plan["estimate"]["expert_read"],
            "error_bound": (plan["error_bound"] or {}).get("absolute"), "json": plan.to_json(),
        }, pk="id")


def load_plan(catalog: Catalog, plan_id: str) -> Plan:
    rows = catalog.query("SELECT json FROM plans WHERE id = ? OR id = ?", [plan_id, "plan-" + plan_id])
    if not rows:
        raise PlanError(f"unknown plan id {plan_id!r}")
    return Plan.from_json(rows[0]["json"])


def explain_plan(p: dict) -> str:
    """EXPLAIN-style text: inputs, budget, estimates, then selection per expert and per tensor."""
    from mergepipe.planner.budget import human_bytes  # formatting only

    lines = [f"PLAN {p['id']}  ({p['digest']})",
             f"  operator   {p['operator']}  params {json.dumps(p['params'], sort_keys=True)}  seed {p['seed']}  "
             f"strategy {p['strategy']}",
             f"  base       {p['base']['id']}  {p['base']['fingerprint'][:19]}",
             f"  grid       {human_bytes(p['grid']['block_bytes'])} blocks, {p['blocks_total']} per model",
             f"  budget     {p['budget']['spec']} = {human_bytes(p['budget']['bytes'])} of "
             f"{human_bytes(p['full_expert_bytes'])} full expert read"
             + ("  (first merge: every expert is read in full; the budget applies from the next merge)"
                if p["budget"].get("first_merge") else ""),
             f"  estimate   base read {human_bytes(p['estimate']['base_read'])}, expert read "
             f"{human_bytes(p['estimate']['expert_read'])}, write {human_bytes(p['estimate']['output_write'])}"]
    if p["error_bound"]:
        b = p["error_bound"]
        norm = "n/a" if b["full_delta_norm"] is None else f"{b['full_delta_norm']:.6g}"
        lines.append(f"  bound      ||M_full - M_A|| <= {b['absolute']:.6g}  (relative {b['relative']:.3e} "
                     f"of ||M_full - base|| ~ {norm})")
        if "blockwise" in b:  # plans stored before the blockwise bound existed lack it
            lines.append(f"  tighter    ||M_full - M_A|| <= {b['blockwise']:.6g}  (relative "
                         f"{b['blockwise_relative']:.3e}; blocks at different positions are disjoint)")
    lines.append("  experts")
    for e in p["experts"]:
        eid = e["id"]
        extra = f" density {e['density']:g}" if e.get("density") is not None else ""
        weight = "per tensor" if e.get("weight") is None else f"{e['weight']:g}"
        lines.append(f"    {eid:<20} weight {weight}{extra}  blocks {p['blocks_selected'][eid]}/"
                     f"{p['blocks_candidate'][eid]}  read {human_bytes(p['expert_read_by_expert'][eid])}")
        if e.get("analyze"):
            lines.append(f"    {'':<20} {e['analyze']}: read in full and analyzed on the way")
    lines.append("  tensors (blocks read per expert)")
    tensors = sorted({t for ts in p["access"].values() for t in ts})
    for t in tensors:
        parts = []
        for e in p["experts"]:
            rs = p["access"][e["id"]].get(t, [])
            if rs:
                parts.append(f"{e['id']}:" + ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in rs))
        lines.append(f"    {t:<48} {human_bytes(p['expert_read_by_tensor'].get(t, 0)):>12}  {' '.join(parts)}")
    return "\n".join(lines)
