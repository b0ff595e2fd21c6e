"""A merge request resolved against the catalog: the base and its tensors, each expert's weight, density
and own parameters (one value, or one per float tensor from filters and gradients), the operator's
per-tensor parameters, the weight and coefficient matrices; checked once, here.

MergeRequest (planner/request.py) checks what needs no catalog; this module checks the rest: the models
(registered on this base, unchanged, full checkpoints where a layout copies them), each density against
the parameters it is used with (here only: per expert, and per tensor where it varies), the sums of the
weights per tensor under normalize, and the numeric guards (an expert whose delta holds NaN/Inf is
refused; one whose delta is zero where it is weighted is merged but flagged in ``warnings``).
"""

from __future__ import annotations

import json

import numpy as np

from mergepipe.catalog import analyses
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged
from mergepipe.errors import PlanError
from mergepipe.ops.core import TENSOR_PARAMS, coefficient
from mergepipe.ops.spec import OpSpec, all_parameters
from mergepipe.planner import methods, vocab_rows
from mergepipe.planner.request import MergeRequest, check_density, check_weight_sum
from mergepipe.planner.settings import (
    PER_MODEL_PARAMS, check_setting, expert_params, is_scalar, layer_t, num_layers, params_on, resolve,
    tensor_density, tensor_weight,
)
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES
from mergepipe.storage.safetensors import FLOAT_DTYPES


class ResolvedRequest:
    """Per expert and per tensor, the values a merge uses, validated once (see the module docstring)."""

    def __init__(self, catalog: Catalog, request: MergeRequest):
        self.catalog = catalog
        self.request = request = request.validated()
        self.op: OpSpec = request.op
        self.params = request.resolved_params(self.op)
        self.seed = int(request.seed)
        self.strategy = request.strategy
        self.base = catalog.model(request.base)
        self.output_layout = request.layout
        self._resolve_models()
        self._resolve_weights()

    def _resolve_models(self) -> None:
        """The tensors, the experts with their settings, the output vocabulary; the checks on them."""
        request, catalog = self.request, self.catalog
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

    def _resolve_weights(self) -> None:
        """[K, T] weight of each expert on each tensor, the soup's base member, and the coefficients."""
        names = [t["name"] for t in self.tensors]
        self.weight_matrix = np.array([[tensor_weight(e, n) or 0.0 for n in names] for e in self.experts],
                                      dtype=np.float64).reshape(len(self.experts), len(names))
        self.base_member = self._base_member(self.request.base_member, names)
        self.base_weights = np.array([tensor_weight(self.base_member, n) or 0.0 for n in names] if self.base_member
                                     else [0.0] * len(names), dtype=np.float64)
        self.weight_sums = self.weight_matrix.sum(axis=0) + self.base_weights
        self._check_normalize(names)
        self.warnings = self._zero_delta_warnings(names) + analyses.outlier_warnings(
            self.catalog, self.base["id"], [e["id"] for e in self.experts if not e.get("analyze")])
        self.coef_matrix = np.array([[coefficient(self.op, w, ws, self.params_for(n))
                                      for w, ws, n in zip(row, self.weight_sums, names)]
                                     for row in self.weight_matrix]).reshape(self.weight_matrix.shape)

    @property
    def to_analyze(self) -> list[dict]:
        """Experts this merge analyzes on the way (not analyzed, changed, or missing a threshold)."""
        return [e for e in self.experts if e.get("analyze")]

    def params_for(self, tensor: str) -> dict:
        """The operator parameters on one tensor (planner/settings.params_on)."""
        return params_on(self.params, self.tensor_params, tensor)

    def _layers(self) -> int:
        return num_layers([t["name"] for t in self.tensors], json.loads(self.base["config"] or "{}"))

    # --- per expert ------------------------------------------------------------------------------
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
        self._analyzed = analyses.analyzed_ids(self.catalog, ids) if ids else set()
        self._rows = self.catalog.models_by_id(ids)
        return [self._expert_spec(s, global_w, global_d) for s in specs]

    def _expert_spec(self, s: dict, global_w, global_d) -> dict:
        """One expert: its catalog row, own parameters, weight and density (one value or per tensor), checked."""
        row = self._rows.get(s["model"]) or self.catalog.model(s["model"])  # an unknown id: the catalog's refusal
        if row["base_id"] != self.base["id"]:
            raise PlanError(f"expert {row['id']!r} is registered with base {row['base_id']!r}, not {self.base['id']!r}")
        check_unchanged(row)
        w = check_setting(s["weight"], f"weight of {row['id']}") if s.get("weight") is not None else None
        d = check_setting(s["density"], f"density of {row['id']}") if s.get("density") is not None else None
        spec = {"id": row["id"], "uri": row["uri"], "fingerprint": row["fingerprint"], "kind": row["kind"]}
        spec.update(self._own_params(row["id"], s))
        if row["id"] not in self._analyzed and not self.op.copies:  # a copy needs no statistics
            spec["analyze"] = "not analyzed"
        if all(v is None or is_scalar(v) for v in (w, d, global_w, global_d)):
            spec["weight"] = w if w is not None else (global_w if global_w is not None else 1.0)
            dd = d if d is not None else (global_d if global_d is not None else 1.0)
            spec["density"] = dd if self.op.uses_density else None  # (checked by _check_densities)
        else:
            spec.update(self._per_tensor([w, global_w], [d, global_d]))
        if any(isinstance(spec.get(k), list) for k in PER_MODEL_PARAMS):
            spec["tensor_params"] = self._own_per_tensor(spec)
        self._check_densities(row["id"], spec)
        return spec

    def _own_params(self, expert_id: str, spec: dict) -> dict:
        """An expert's own gamma/epsilon (mergekit's per-model parameters), checked, where its operator has them."""
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

    def _own_per_tensor(self, spec: dict) -> dict:
        """An expert's gamma/epsilon given as filters or a gradient, per float tensor (mergekit's per-model
        parameters resolved per tensor; a tensor no condition matches takes the merge-wide value); checked,
        with the tensor's density, by _check_densities."""
        layers = self._layers()
        return {t["name"]: {k: resolve([spec[k]], t["name"], layer_t(t["name"], layers), self.params[k])
                            for k in PER_MODEL_PARAMS if isinstance(spec.get(k), list)}
                for t in self.tensors if t["dtype"] in FLOAT_DTYPES}

    def _per_tensor(self, weight_settings, density_settings) -> dict:
        """Weight and density of one expert for every float tensor, from filters and gradients."""
        names = [t["name"] for t in self.tensors if t["dtype"] in FLOAT_DTYPES]
        layers = self._layers()
        values = {}
        for name in names:
            t = layer_t(name, layers)
            d = resolve(density_settings, name, t, 1.0)
            values[name] = [resolve(weight_settings, name, t, 1.0), d if self.op.uses_density else None]
        ws = {v[0] for v in values.values()}
        ds = {v[1] for v in values.values()}
        return {"weight": ws.pop() if len(ws) == 1 else None, "density": ds.pop() if len(ds) == 1 else None,
                "settings": {"weight": weight_settings[0], "density": density_settings[0]},
                "tensors": values}

    def _check_densities(self, expert_id: str, spec: dict) -> None:
        """Every density of one expert, checked here only: its one value (or its value on each float tensor)
        against the merge-wide parameters with the expert's own numbers; then, where its gamma/epsilon vary per
        tensor, each tensor's own values (their ranges) with the tensor's density."""
        params = expert_params(self.params, spec)
        if "tensors" not in spec:
            check_density(self.op, params, spec["density"], f" of {expert_id}")
        else:
            for name, (_, d) in spec["tensors"].items():
                check_density(self.op, params, d, f" of {expert_id} on {name}")
        declared = {p.name: p for p in all_parameters()}
        for name, own in (spec.get("tensor_params") or {}).items():
            for k, v in own.items():
                declared[k].check(v, f"{k} of {expert_id} on {name}")
            check_density(self.op, {**params, **own}, tensor_density(spec, name) or 1.0, f" of {expert_id} on {name}")

    # --- per tensor ------------------------------------------------------------------------------
    def _tensor_params(self) -> dict:
        """lambda/normalize/rescale per float tensor where one is given as filters or a gradient (else {})."""
        given = {k: self.params[k] for k in TENSOR_PARAMS if isinstance(self.params.get(k), list)}
        if not given:
            return {}
        layers = self._layers()
        defaults = {"lambda": 1.0, "normalize": float(self.op.normalize), "rescale": float(self.op.rescale)}
        out = {}
        for t in self.tensors:
            if t["dtype"] not in FLOAT_DTYPES:
                continue
            values = {k: resolve([s], t["name"], layer_t(t["name"], layers), defaults[k]) for k, s in given.items()}
            out[t["name"]] = {k: (v if k == "lambda" else v >= 0.5) for k, v in values.items()}
        return out

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

    # --- checks ----------------------------------------------------------------------------------
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
        analyzed = [e["id"] for e in self.experts if not e.get("analyze")]
        found = analyses.nonfinite_blocks_of(self.catalog, analyzed)
        for e in self.experts:
            if e.get("analyze"):
                continue
            rows = [r for r in found.get(e["id"], ()) if r[0] in self.tensor_index]
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

    def _zero_delta_warnings(self, names: list[str]) -> list[str]:
        """A warning per analyzed expert whose delta is zero everywhere or in every tensor it is weighted in."""
        out = []
        floats = [i for i, t in enumerate(self.tensors) if t["dtype"] in FLOAT_DTYPES]
        ids = [e["id"] for e in self.experts if not (e.get("analyze") or self.op.copies)]
        changed_of = analyses.changed_tensors_of(self.catalog, ids) if ids else {}
        for ei, e in enumerate(self.experts):
            if e.get("analyze") or self.op.copies:
                continue
            changed = changed_of[e["id"]]
            weighted = {names[i] for i in floats if self.weight_matrix[ei, i] != 0}
            if not changed:
                out.append(f"expert {e['id']!r} has a zero delta everywhere: it is identical to its base "
                           f"{self.base['id']!r} and changes nothing in this merge")
            elif weighted and not changed & weighted:
                out.append(f"expert {e['id']!r} has a zero delta in every tensor this merge gives it a non-zero "
                           f"weight: it changes nothing in this merge")
        return out


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
