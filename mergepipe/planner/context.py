"""The budget-aware planner: which (expert, tensor, block) triples to read, decided from the catalog
alone, before any expert byte is read.

Greedy by score per byte (default score |c_i| * ||delta_{i,t,b}||_2, which minimises the additive error
bound), deterministic tie-break (expert order, tensor order, block index), budget-sound by
construction. ``PlanContext`` holds everything about a merge request except the budget; ``Planner``
is the front door.

Numeric guards, from the statistics ANALYZE stored: an expert whose delta holds NaN/Inf (in its own
values or in the base's) in any tensor is refused (a PlanError naming the model, the tensors, their
blocks and counts): every tensor of the base is merged, and NaN or Inf times any weight stays non-finite.
An expert whose delta is zero everywhere (identical to its base), or zero in every tensor this merge
gives it a non-zero weight, is merged but flagged: the plan's ``warnings`` (shown by EXPLAIN and
``plan``). Experts analyzed on the way are checked by the engine as their statistics arrive.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from mergepipe.catalog import analyses
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged
from mergepipe.errors import PlanError
from mergepipe.manifest.build import canonical
from mergepipe.ops.core import coefficient, lookup_thresholds, tensor_statistics, threshold_fractions, useful_blocks
from mergepipe.ops.spec import OpSpec
from mergepipe.planner import methods, vocab_rows
from mergepipe.planner.bounds import Bounds
from mergepipe.planner.budget import Budget
from mergepipe.planner.candidates import Candidates
from mergepipe.planner.plan import PLAN_FORMAT, Plan, compact_ranges, save_plan
from mergepipe.planner.request import MergeRequest, check_density, check_weight_sum
from mergepipe.planner.settings import (
    PER_MODEL_PARAMS, check_setting, expert_params, is_scalar, layer_t, num_layers, params_on, resolve,
    tensor_density, tensor_weight,
)
from mergepipe.ops.core import TENSOR_PARAMS
from mergepipe.planner.coalesce import coalesce
from mergepipe.planner.strategies import StrategyScores, _uniform_priority
from mergepipe.planner.tiers import EXACT, NO_COMPACTS, Tiers, compact_store, tier_plan_inputs, tier_summary
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES, tensor_grid
from mergepipe.storage.safetensors import FLOAT_DTYPES, TensorInfo
from mergepipe.storage.sources import fixed_bytes, open_source
from mergepipe.storage.tiers import tier_name, transfer_estimate
from mergepipe.version import __version__


class PlanContext(StrategyScores, Bounds):
    """Everything about a merge request except the budget: reusable while a user drags a slider."""

    def __init__(self, catalog: Catalog, request: MergeRequest):
        self.catalog = catalog
        self.request = request = request.validated()
        self.op: OpSpec = request.op
        self.params = request.resolved_params(self.op)
        self.seed = int(request.seed)
        self.strategy = request.strategy
        self.base = catalog.model(request.base)
        self.output_layout = request.layout
        if self.op.copies and self.output_layout is None:
            raise PlanError(f"{self.op.name} copies the layers a `slices:` config names (mergekit frankenmerges): "
                            f"merge from such a config (--config)")
        self.tensors = layout_tensors(self.output_layout, self.base["id"], catalog.tensors(self.base["id"]),
                                      self.op.copies)
        self.tensor_index = {t["name"]: i for i, t in enumerate(self.tensors)}
        self.tensor_params = self._tensor_params()
        self.experts = self._expert_specs(request.experts, request.density, request.weight)
        if self.output_layout is not None:
            self._check_layout_models()
        if self.op.nonlinear:  # interpolation methods: expert counts, statistics present (planner/methods.py)
            methods.check_experts(self.op, self.experts, request.base_member)
        self._check_finite()
        self.vocab = vocab_rows.vocab_of(request)  # different vocabularies: embedding rows re-ordered, read in full
        vocab_rows.check_shapes(catalog, self.op, self.base, self.experts, self.vocab)
        if self.vocab is not None and self.to_analyze:
            raise methods.NeedsAnalysis(f"a merge that re-orders embedding rows needs its experts analyzed first "
                                        f"(not analyzed: {', '.join(e['id'] for e in self.to_analyze)})")
        self.vocab_bytes = vocab_rows.reserved(catalog, self.experts, self.vocab)
        self.block_bytes = catalog.grid_block_bytes(self.base["id"]) or DEFAULT_BLOCK_BYTES
        names = [t["name"] for t in self.tensors]
        # [K, T] weight of each expert on each tensor, and its coefficient in the merged delta
        self.weight_matrix = np.array([[tensor_weight(e, n) or 0.0 for n in names] for e in self.experts],
                                      dtype=np.float64).reshape(len(self.experts), len(names))
        self.base_member = self._base_member(request.base_member, names)
        self.base_weights = np.array([tensor_weight(self.base_member, n) or 0.0 for n in names] if self.base_member
                                     else [0.0] * len(names), dtype=np.float64)
        self.weight_sums = self.weight_matrix.sum(axis=0) + self.base_weights
        self._check_normalize(names)
        self.warnings = self._zero_delta_warnings(names) + analyses.outlier_warnings(
            catalog, self.base["id"], [e["id"] for e in self.experts if not e.get("analyze")])
        self.coef_matrix = np.array([[coefficient(self.op, w, ws, self.params_for(n))
                                      for w, ws, n in zip(row, self.weight_sums, names)]
                                     for row in self.weight_matrix]).reshape(self.weight_matrix.shape)
        self.thresholds = self._thresholds()
        if self.output_layout is not None and self.to_analyze:  # renamed tensors are not analyzed on the way
            raise methods.NeedsAnalysis(f"a `slices:` merge needs its experts analyzed first (not analyzed: "
                                        f"{', '.join(e['id'] for e in self.to_analyze)}): `mergepipe analyze "
                                        f"{' '.join(e['id'] for e in self.to_analyze)}`")
        self.candidates = self._candidates()
        # the compact tier (planner/tiers.py): None when the request or the catalog has none
        self.tiers, self.compact_note, self.compact_rows = tier_plan_inputs(self)
        # interpolation methods: per-tensor scalars; a re-ordered vocabulary's embedding tensors get theirs at
        # merge time, from their composed rows (planner/methods.py)
        self.method_scalars, self.composed_settings = (methods.tensor_scalars(self) if self.op.nonlinear
                                                       else (None, {}))

    def _expert_specs(self, experts, density, weight=None) -> list[dict]:
        if not experts and self.op.min_experts > 0:
            raise PlanError("no experts given")
        specs = [dict(e) for e in experts]
        ids = [s["model"] for s in specs]
        if len(set(ids)) != len(ids):
            raise PlanError(f"an expert is listed twice: {', '.join(sorted({i for i in ids if ids.count(i) > 1}))}")
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
            spec.update(self._own_params(row["id"], s))
            if not self.catalog.is_analyzed(row["id"]) and not self.op.copies:  # a copy needs no statistics
                spec["analyze"] = "not analyzed"
            if all(v is None or is_scalar(v) for v in (w, d, global_w, global_d)):
                spec["weight"] = w if w is not None else (global_w if global_w is not None else 1.0)
                dd = d if d is not None else (global_d if global_d is not None else 1.0)
                self._check_density(row["id"], dd, params=expert_params(self.params, spec))
                spec["density"] = dd if self.op.uses_density else None
            else:
                spec.update(self._per_tensor(row["id"], [w, global_w], [d, global_d], expert_params(self.params, spec)))
            if any(isinstance(spec.get(k), list) for k in PER_MODEL_PARAMS):
                spec["tensor_params"] = self._own_per_tensor(row["id"], spec)
            out.append(spec)
        return out

    def _check_layout_models(self) -> None:
        """A layout takes tensors from the base or from full checkpoints among the experts (a copy needs the
        model's own values: a delta or LoRA checkpoint has none to copy)."""
        kinds = {e["id"]: e["kind"] for e in self.experts}
        for model in sorted({t[1] for t in self.output_layout["tensors"]} - {self.base["id"]}):
            if model not in kinds:
                raise PlanError(f"the layout takes tensors from {model}, which is neither the base nor an expert")
            if kinds[model] != "full":
                raise PlanError(f"the layout copies layers of {model}, a {kinds[model]} checkpoint: passthrough "
                                f"copies full checkpoints (merge the adapter into a model first)")

    def _check_finite(self) -> None:
        """Refuse an analyzed expert whose delta holds NaN/Inf in any tensor (see the module docstring)."""
        for e in self.experts:
            if e.get("analyze"):
                continue
            rows = [r for r in analyses.nonfinite_blocks(self.catalog, e["id"]) if r[0] in self.tensor_index]
            if rows:
                raise PlanError(analyses.nonfinite_message(e["id"], self.base["id"], rows))

    def _check_normalize(self, names: list[str]) -> None:
        """Under normalize the weights are divided by their sum: refuse a sum of (about) zero, per tensor."""
        floats = [i for i, t in enumerate(self.tensors) if t["dtype"] in FLOAT_DTYPES]
        seen = set()
        for i in floats:
            column = tuple(float(w) for w in self.weight_matrix[:, i]) + (
                (float(self.base_weights[i]),) if self.base_member else ())
            if column not in seen:
                seen.add(column)
                check_weight_sum(self.op, self.params_for(names[i]), column, f" on {names[i]}" if len(self.tensors) > 1 and any(
                    e.get("weight") is None for e in self.experts) else "")

    def _base_member(self, member: dict | None, names: list[str]) -> dict | None:
        """A soup's base member (MergeRequest.base_member) with its weight per float tensor when that varies."""
        if member is None:
            return None
        out = dict(member)
        if not is_scalar(member["weight"]):
            layers = num_layers(names, json.loads(self.base["config"] or "{}"))
            floats = [t["name"] for t in self.tensors if t["dtype"] in FLOAT_DTYPES]
            out["tensors"] = {n: [resolve([member["weight"]], n, layer_t(n, layers), 1.0), None] for n in floats}
            out["settings"], out["weight"] = {"weight": member["weight"]}, None  # as an expert's per-tensor weight
        return out

    def _tensor_params(self) -> dict:
        """lambda/normalize/rescale per float tensor where one is given as filters or a gradient (else {})."""
        given = {k: self.params[k] for k in TENSOR_PARAMS if isinstance(self.params.get(k), list)}
        if not given:
            return {}
        names = [t["name"] for t in self.tensors]
        layers = num_layers(names, json.loads(self.base["config"] or "{}"))
        defaults = {"lambda": 1.0, "normalize": float(self.op.normalize), "rescale": float(self.op.rescale)}
        out = {}
        for t in self.tensors:
            if t["dtype"] not in FLOAT_DTYPES:
                continue
            values = {k: resolve([s], t["name"], layer_t(t["name"], layers), defaults[k]) for k, s in given.items()}
            out[t["name"]] = {k: (v if k == "lambda" else v >= 0.5) for k, v in values.items()}
        return out

    def params_for(self, tensor: str) -> dict:
        """The operator parameters on one tensor (planner/settings.params_on)."""
        return params_on(self.params, self.tensor_params, tensor)

    def _zero_delta_warnings(self, names: list[str]) -> list[str]:
        """A warning per analyzed expert whose delta is zero everywhere or in every tensor it is weighted in."""
        out = []
        floats = [i for i, t in enumerate(self.tensors) if t["dtype"] in FLOAT_DTYPES]
        for ei, e in enumerate(self.experts):
            if e.get("analyze") or self.op.copies:
                continue
            changed = set(analyses.changed_tensors(self.catalog, e["id"]))
            weighted = {names[i] for i in floats if self.weight_matrix[ei, i] != 0}
            if not changed:
                out.append(f"expert {e['id']!r} has a zero delta everywhere: it is identical to its base "
                           f"{self.base['id']!r} and changes nothing in this merge")
            elif weighted and not changed & weighted:
                out.append(f"expert {e['id']!r} has a zero delta in every tensor this merge gives it a non-zero "
                           f"weight: it changes nothing in this merge")
        return out

    def _check_density(self, expert_id: str, d: float, where: str = "", params: dict | None = None) -> None:
        check_density(self.op, params or self.params, d, f" of {expert_id}{where}")

    def _own_params(self, expert_id: str, spec: dict) -> dict:
        """An expert's own gamma/epsilon (mergekit's per-model parameters), checked, where its operator has them."""
        from mergepipe.ops.spec import all_parameters
        declared = {p.name: p for p in all_parameters()}
        out = {}
        for key in PER_MODEL_PARAMS:
            value = spec.get(key)
            if value is None:
                continue
            if key not in self.params:
                raise PlanError(f"operator {self.op.name} takes no parameter {key} (given for {expert_id})")
            if isinstance(value, (list, tuple, dict)):  # filters or a gradient: resolved per tensor (_own_per_tensor)
                out[key] = check_setting(value, f"{key} of {expert_id}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanError(f"{key} of {expert_id} must be a number, not {value!r}")
            out[key] = declared[key].check(float(value), f"{key} of {expert_id}")
        return out

    def _own_per_tensor(self, expert_id: str, spec: dict) -> dict:
        """An expert's gamma/epsilon given as filters or a gradient, per float tensor (mergekit's per-model
        parameters resolved per tensor; a tensor no condition matches takes the merge-wide value), each checked
        against its range and, for breadcrumbs, with the tensor's density."""
        from mergepipe.ops.spec import all_parameters
        declared = {p.name: p for p in all_parameters()}
        layers = num_layers([t["name"] for t in self.tensors], json.loads(self.base["config"] or "{}"))
        out = {}
        for t in self.tensors:
            if t["dtype"] not in FLOAT_DTYPES:
                continue
            name = t["name"]
            own = {k: declared[k].check(resolve([spec[k]], name, layer_t(name, layers), self.params[k]),
                                        f"{k} of {expert_id} on {name}")
                   for k in PER_MODEL_PARAMS if isinstance(spec.get(k), list)}
            check_density(self.op, {**expert_params(self.params, spec), **own}, tensor_density(spec, name) or 1.0,
                          f" of {expert_id} on {name}")
            out[name] = own
        return out

    def _per_tensor(self, expert_id: str, weight_settings, density_settings, params: dict | None = None) -> dict:
        """Weight and density of one expert for every float tensor, from filters and gradients."""
        names = [t["name"] for t in self.tensors if t["dtype"] in FLOAT_DTYPES]
        layers = num_layers([t["name"] for t in self.tensors], json.loads(self.base["config"] or "{}"))
        values = {}
        for name in names:
            t = layer_t(name, layers)
            w = resolve(weight_settings, name, t, 1.0)
            d = resolve(density_settings, name, t, 1.0)
            self._check_density(expert_id, d, f" on {name}", params)
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
        if not self.op.thresholded:
            return out
        for e in self.experts:
            if e.get("analyze"):
                continue
            rows = analyses.changed_tensor_thresholds(self.catalog, e["id"])
            per = {}
            for name, text, topk, l1, max_abs, numel in rows:
                if name in (self.vocab or {}).get("tensors", {}):
                    continue  # re-ordered rows: the engine takes their top k (engine/vocab.py)
                params = expert_params(self.params_for(name), e, name)
                fracs = threshold_fractions(self.op, tensor_density(e, name) or 1.0, params)
                vals = tensor_statistics(self.op, tensor_density(e, name) or 1.0, params, text, topk, l1, max_abs,
                                         numel)
                if vals is None:
                    table = json.loads(text or "{}")  # fraction 1: the top n - 1 (breadcrumbs, ops.core)
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

    @property
    def to_analyze(self) -> list[dict]:
        """Experts this merge analyzes on the way (not analyzed, changed, or missing a threshold)."""
        return [e for e in self.experts if e.get("analyze")]

    def _all_blocks(self, ei: int, expert: dict) -> np.ndarray:
        """Every block of an expert analyzed on the way (it has no statistics to choose from): the
        columns of the candidate table, with no score."""
        source = open_source(expert["kind"], expert["uri"])
        composed = (self.vocab or {}).get("tensors", {})  # re-ordered rows: read whole by the engine (engine/vocab.py)
        rows = []
        for ti, t in enumerate(self.tensors):
            if (t["dtype"] not in FLOAT_DTYPES or t["name"] in composed
                    or not source.has_delta(t["name"], t["shape"])):
                continue
            setup = fixed_bytes(source, t["name"])
            for span in tensor_grid(_info(t), self.block_bytes):
                nbytes = sum(n for _, _, n in source.block_ranges(t["name"], span))
                rows.append((ei, ti, span.index, nbytes, 0.0, setup))
        return np.array(rows, dtype=np.float64).reshape(-1, 6)

    def _candidates(self) -> Candidates:
        float_tensor = {t["name"] for t in self.tensors if t["dtype"] in FLOAT_DTYPES
                        and t["name"] not in (self.vocab or {}).get("tensors", {})}
        parts = []
        for ei, e in enumerate(self.experts if not self.op.copies else ()):  # passthrough reads no delta
            if e.get("analyze"):
                parts.append(self._all_blocks(ei, e))
                continue
            fixed = analyses.fixed_bytes_by_tensor(self.catalog, e["id"])
            rows = analyses.changed_block_stats(self.catalog, e["id"])
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
        cands = Candidates(arr["expert"], arr["tensor"], arr["block"], arr["nbytes"], score, bound_term, priority,
                           arr["setup"])
        cands.l2 = arr["l2"]  # ||delta|| of each block (the sparsified operators' bound, planner/bounds.py)
        return cands

    # --- estimates -------------------------------------------------------------------------------
    def base_bytes(self) -> int:
        """Bytes of input tensors read as they are (the base's; a layout's copies from any model) =
        bytes written."""
        if self.output_layout is not None:
            return sum(self.tensors[self.tensor_index[t[2]]]["nbytes"] for t in self.output_layout["tensors"])
        return sum(t["nbytes"] for t in self.tensors)

    def output_info(self, row: dict) -> TensorInfo:
        """A tensor as written (a re-ordered embedding tensor has the output vocabulary's rows)."""
        return _info(row) if self.vocab is None else vocab_rows.output_info(row, self.vocab)

    def _vocab_blocks(self) -> int:
        if self.vocab is None or self.vocab.get("copies"):
            return 0
        return sum(b - a for rs in vocab_rows.access(self.tensors, self.vocab, self.block_bytes).values() for a, b in rs)

    def output_bytes(self) -> int:
        if self.vocab is None:
            return self.base_bytes()
        return self.base_bytes() + sum(self.output_info(t).nbytes - t["nbytes"] for t in self.tensors)

    def plan(self, budget=None, budget_mb=None, target_bound: float | None = None) -> Plan:
        """The plan at ``budget`` (a :class:`Budget` or any spelling it takes; default the request's)."""
        if budget is None and budget_mb is None and target_bound is None:
            budget = self.request.budget
        budget = Budget.of(budget, mb=budget_mb, target_bound=target_bound)
        cands = self.candidates
        reserved = sum(self.vocab_bytes.values())
        full = cands.full_bytes + reserved
        target_bound = budget.target_bound
        if budget.is_target and not self.op.additive:
            raise PlanError(f"--target-bound needs an additive operator (linear, task_arithmetic), not {self.op.name}")
        if self.to_analyze:  # a first merge: the budget applies from the next merge on
            return self._build(cands.order, budget.spec, full, target_bound, first_merge=True)
        if self.tiers is not None:
            return self._plan_tiered(budget, full, target_bound)
        if budget.is_target:
            norm = self.full_norm_estimate()
            budget_bytes = (self.smallest_budget_for(target_bound * norm) + reserved) if full else 0
        else:
            budget_bytes = budget.bytes_of(full) if full else 0
        rest = vocab_rows.budget_rest(budget_bytes, reserved, budget.spec) if reserved else budget_bytes
        chosen = cands.select(rest) if full else np.zeros(0, dtype=np.int64)
        if self.op.joint and full:  # all experts' blocks of a (tensor, block) or none
            chosen = methods.select_joint(cands, rest)
        greedy = None
        if full and self._coalesces(budget):
            greedy, chosen = chosen, coalesce(cands, chosen, rest, self.request.coalesce_tolerance)
        return self._build(chosen, budget.spec, budget_bytes, target_bound, greedy=greedy)

    def _plan_tiered(self, budget: Budget, full: int, target_bound) -> Plan:
        """A three-way plan: exact, compact or omitted per candidate (planner/tiers.py)."""
        tiers = self.tiers
        if budget.is_target:
            budget_bytes = self.smallest_budget_for(target_bound * self.full_norm_estimate()) if full else 0
        else:
            budget_bytes = budget.bytes_of(full) if full else 0
        tier = tiers.select(budget_bytes)
        chosen = np.nonzero(tier == EXACT)[0]
        return self._build(chosen, budget.spec, budget_bytes, target_bound, tier=tier)

    def _exact_tiers(self, selected: np.ndarray) -> dict:
        """Blocks and bytes per tier of an exact-or-omitted plan."""
        cands = self.candidates
        return {"exact": {"blocks": int(selected.sum()), "bytes": int(cands.bytes_of(np.nonzero(selected)[0]).sum())},
                "compact": {"blocks": 0, "bytes": 0, "by_bits": {}},
                "omitted": {"blocks": int((~selected).sum()), "bytes": int(cands.nbytes[~selected].sum())}}

    def _coalesces(self, budget: Budget) -> bool:
        """Whether this plan re-chooses its marginal blocks for fewer ranges (planner/coalesce.py)."""
        mode = self.request.coalesce
        if mode == "off" or budget.is_target or self.op.joint or self.op.nonlinear:
            return False
        if self.strategy in ("random", "uniform") or self.candidates.setup.any():
            return False
        return mode == "on" or any(tier_name(e["uri"]) != "local" for e in self.experts)

    def _transfer(self, access: dict, per_expert_bytes: dict, base_bytes: int, compact_reads=()) -> dict:
        """Estimated transfer per storage tier (storage/tiers.py): the base read in full, one request per
        tensor, and each expert's planned blocks, one request per contiguous run; compact records are read
        from the catalog's folder (local, whatever the expert's storage), one request each."""
        reads = [(self.base["uri"], base_bytes, len(self.tensors))]
        reads += [(e["uri"], per_expert_bytes[e["id"]], _runs(access[e["id"]])) for e in self.experts]
        reads += list(compact_reads)
        return transfer_estimate(reads)

    def _access(self, chosen: np.ndarray) -> tuple[dict, dict, dict]:
        """(block ranges per expert and tensor, bytes per expert, bytes per tensor) of a selection."""
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
        if self.vocab is not None and not self.vocab.get("copies"):  # every expert's embedding rows, in full
            rows = vocab_rows.access(self.tensors, self.vocab, self.block_bytes)
            for e in self.experts:
                access[e["id"]] = dict(sorted({**access[e["id"]], **rows}.items()))
                per_expert_bytes[e["id"]] += self.vocab_bytes[e["id"]]
            for e in self.experts:
                for t in rows:
                    per_tensor_bytes[t] = per_tensor_bytes.get(t, 0) + next(
                        r["nbytes"] for r in self.catalog.tensors(e["id"]) if r["name"] == t)
        return access, per_expert_bytes, per_tensor_bytes

    def _coalesce_note(self, greedy: np.ndarray, chosen: np.ndarray, transfer: dict) -> dict:
        """What coalescing changed: the greedy selection's transfer estimate next to the plan's."""
        access, per_expert, _ = self._access(greedy)
        before = self._transfer(access, per_expert, self.base_bytes())
        cands = self.candidates
        return {"tolerance": self.request.coalesce_tolerance, "before": before, "after": transfer,
                "expert_read_before": int(cands.bytes_of(greedy).sum()),
                "expert_read_after": int(cands.bytes_of(chosen).sum()),
                "blocks_swapped": int(len(np.setdiff1d(chosen, greedy)))}

    def _build(self, chosen: np.ndarray, budget_spec: str, budget_bytes: int, target_bound,
               first_merge: bool = False, greedy: np.ndarray | None = None, tier: np.ndarray | None = None) -> Plan:
        cands = self.candidates
        access, per_expert_bytes, per_tensor_bytes = self._access(chosen)
        expert_read = sum(per_expert_bytes.values())
        selected_mask = np.zeros(len(cands.nbytes), dtype=bool)
        selected_mask[chosen] = True
        residual = self.tiers.residual(tier) if tier is not None else np.where(selected_mask, 0.0, cands.bound_term)
        bound = None
        if self.op.additive and self.to_analyze:  # every block is read: nothing omitted
            bound = {"absolute": 0.0, "full_delta_norm": None, "relative": 0.0, "blockwise": 0.0,
                     "blockwise_relative": 0.0, "additive": 0.0, "additive_relative": 0.0, "kind": "blockwise"}
        elif self.op.additive:
            bound = self._bound(residual)
        elif not (self.op.nonlinear or self.op.copies or self.to_analyze):
            bound = self._sparsified_bound(selected_mask, tier)
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
        if self.request.tokenizer:  # only when set: plans of the base's tokenizer keep their digests
            core["tokenizer"] = self.request.tokenizer
        if self.output_layout is not None:  # a `slices:` config: which input tensor each output tensor is made of
            core["layout"] = self.output_layout
        if self.tensor_params:  # lambda/normalize/rescale per tensor (only then: other plans keep their digests)
            core["tensor_params"] = self.tensor_params
        if self.base_member:  # a soup: the base is averaged in (only then: other plans keep their digests)
            core["base_member"] = self.base_member
        compact = tier_summary(self, tier) if tier is not None else None
        if compact and compact["core"]:  # only when a block is read from the compact tier: other plans keep digests
            core["compact"] = compact["core"]
        if self.op.nonlinear:  # the interpolation methods' per-tensor scalars and budget-omitted blocks
            core["coefficients"] = self.method_scalars
            core["omitted"] = methods.omitted_blocks(self, chosen)
            if self.composed_settings:  # only then: other plans keep their digests
                core["composed_coefficients"] = self.composed_settings
        digest = hashlib.sha256(canonical(core)).hexdigest()
        data = dict(core)
        data.update({
            "id": "plan-" + digest[:16],
            "digest": "sha256:" + digest,
            "full_expert_bytes": cands.full_bytes + sum(self.vocab_bytes.values()),
            "estimate": {"base_read": base_bytes, "expert_read": expert_read,
                         "compact_read": compact["bytes"] if compact else 0, "output_write": self.output_bytes()},
            "expert_read_by_expert": per_expert_bytes,
            "expert_read_by_tensor": dict(sorted(per_tensor_bytes.items())),
            "blocks_selected": {e: sum(r[1] - r[0] for rs in ts.values() for r in rs) for e, ts in access.items()},
            "blocks_candidate": {e["id"]: int((cands.expert == i).sum()) + self._vocab_blocks()
                                 for i, e in enumerate(self.experts)},
            "blocks_total": sum(len(tensor_grid(self.output_info(t), self.block_bytes)) for t in self.tensors),
            "error_bound": bound,
            "target_bound": target_bound,
            "software": {"mergepipe": __version__},
        })
        data["tiers"] = compact["tiers"] if compact else self._exact_tiers(selected_mask)
        if compact and compact["core"]:
            data["compact_read_by_expert"] = compact["by_expert"]
            data["compact_files"] = compact["files"]
        if self.request.compact != "auto":  # outside the digest: the request's setting (an exported config keeps it)
            data["compact_mode"] = self.request.compact
        if self.compact_note and (self.compact_note != NO_COMPACTS or not selected_mask.all()):
            data["compact_note"] = self.compact_note  # outside the digest: why no block comes from the compact tier
        data["transfer"] = self._transfer(access, per_expert_bytes, base_bytes,
                                          compact["reads"] if compact and compact["core"] else ())
        if self.op.additive and not self.to_analyze and not any(self.vocab_bytes.values()):  # outside the digest
            data["suggested_budget"] = self.suggested_budget()
        if greedy is not None:  # outside the digest: the access set already says what is read
            data["coalesce"] = self._coalesce_note(greedy, chosen, data["transfer"])
        if first_merge and (store := compact_store(self)):  # outside the digest: the analysis on the way's compacts
            data["compact_store"] = store
        if self.warnings:  # outside the digest: they follow from the catalog, like the estimates
            data["warnings"] = list(self.warnings)
        return Plan(data)


def layout_tensors(layout: dict | None, base_id: str, rows: list[dict], copies: bool = False) -> list[dict]:
    """The base's tensors a merge reads: all of them, or those a layout names. A merging operator reads
    each input tensor of the base at most once (its blocks, coefficients and statistics are the input's);
    passthrough copies any model's tensors, as often as the layout says."""
    if layout is None:
        return list(rows)
    known = {r["name"] for r in rows}
    names = [t[2] for t in layout["tensors"]]
    missing = sorted(set(names) - known)
    if missing:
        raise PlanError(f"the layout names {missing[0]}, which {base_id} does not have")
    if not copies:
        if any(t[1] != base_id for t in layout["tensors"]):
            raise PlanError(f"a merging layout takes every output tensor from the base {base_id} (merged with the "
                            f"experts)")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PlanError(f"the layout merges {twice[0]} twice: a merge reads each input tensor once")
    return [r for r in rows if r["name"] in set(names)]
def _runs(ranges_by_tensor: dict[str, list]) -> int:
    return sum(len(rs) for rs in ranges_by_tensor.values())


def _info(row: dict) -> TensorInfo:
    return TensorInfo(row["name"], row["dtype"], tuple(row["shape"]), row["file"], row["offset"], row["nbytes"])


class Planner:
    """``Planner(catalog).plan(request)``, a :class:`MergeRequest`; or, for scripts,
    ``Planner(catalog).plan(base_model=..., experts=[...], operator="TIES", budget_mb=8192)``, which
    builds one."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def context(self, request: MergeRequest | str, experts=None, operator: str = "ties", **kw) -> PlanContext:
        return PlanContext(self.catalog, _request(request, experts, operator, kw))

    def plan(self, request: MergeRequest | str | None = None, experts=None, operator: str = "ties",
             save: bool = True, base_model: str | None = None, **kw) -> Plan:
        plan = PlanContext(self.catalog, _request(request if request is not None else base_model,
                                                  experts, operator, kw)).plan()
        if save:
            save_plan(self.catalog, plan)
        return plan


def _request(request, experts, operator, kw) -> MergeRequest:
    if isinstance(request, MergeRequest):
        if experts is not None or kw:
            raise PlanError("give either a MergeRequest or keyword settings, not both")
        return request
    return MergeRequest.build(request, experts, operator, **kw)
