"""Incremental merges: add, remove or reweight one expert of a published snapshot, reading the snapshot
and that expert only (issue 17).

For an additive operator a snapshot is a sufficient statistic of its experts. Every additive merge is

    M = beta(W) * base + k(W) * S,   S = sum_i w_i * delta_i (each delta_i on its access set, 0 elsewhere)

with W the sum of the weights, k(W) = lambda / W under normalize (else lambda) and beta(W) = W for a
whole-model operator without normalize (linear: sum_i w_i x_i), else 1. Changing one expert's weight by
dw (adding it: dw = w; removing it: dw = -w) gives

    M' = a * M + g * base + b * delta_r,   a = k(W')/k(W),  g = beta(W') - a * beta(W),  b = k(W') * dw

on the blocks where the expert's delta is in the merge, and a * M + g * base elsewhere. For a full
checkpoint delta_r = x_r - base, so the base's coefficient there is g - b (0 for linear with lambda 1:
no base read). The coefficients are derived exactly (fractions of the float inputs) to decide which
blocks need the base: none where it cancels, and none at all for task arithmetic without normalize
(a = 1, g = 0: blocks the expert does not touch are copied byte for byte).

The result equals a from-scratch merge of the new set with the same per-expert access sets (the old
experts' effective sets from the parent's manifest, the changed expert's planned set) up to rounding:
the snapshot is stored in the base's dtype, so each step rounds once more (see docs/incremental.md).

The error bound is the parent's, rescaled by |a| (the old experts' coefficients change under
normalize), minus the changed expert's old omitted part, plus its new omitted part: exactly the bound a
from-scratch plan with the same access sets reports.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

from mergepipe.catalog import analyses
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged
from mergepipe.errors import MergePipeError, PlanError
from mergepipe.manifest.build import canonical
from mergepipe.manifest.verify import load_manifest
from mergepipe.ops.core import get_op
from mergepipe.planner.budget import Budget
from mergepipe.planner.context import PlanContext
from mergepipe.planner.extend_format import EXTEND_FORMAT
from mergepipe.planner.extend_refusal import non_additive_message
from mergepipe.planner.extend_request import ACTIONS, ExtendRequest  # noqa: F401  (re-exported)
from mergepipe.planner.plan import Plan, compact_ranges, expand_ranges
from mergepipe.planner.request import MergeRequest, check_weight_sum
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES, tensor_grid
from mergepipe.storage.safetensors import FLOAT_DTYPES, TensorInfo
from mergepipe.storage.sources import fixed_bytes, open_source
from mergepipe.version import __version__


def plan_extend(catalog: Catalog, request: ExtendRequest) -> Plan:
    """The plan of an incremental merge, from the catalog and the parent's manifest (reads no tensor byte)."""
    return _ExtendContext(catalog, request).plan()


class _ExtendContext:
    def __init__(self, catalog: Catalog, request: ExtendRequest):
        self.catalog, self.request = catalog, request
        try:
            self.manifest = load_manifest(catalog, request.snapshot)
        except MergePipeError:
            raise PlanError(f"unknown snapshot {request.snapshot!r} (give a snapshot id or merged model id)") from None
        core = self.core = self.manifest.core
        self.op = get_op(core["operator"])
        if not self.op.additive:
            raise PlanError(non_additive_message(self.op.name, request.snapshot, core, request))
        if (core.get("tokenizer") or {}).get("vocab"):
            raise PlanError(f"snapshot {request.snapshot} re-ordered its models' embedding rows to another vocabulary "
                            f"(tokenizer_source): adding or removing an expert changes that vocabulary; merge from "
                            f"scratch instead")
        if (core.get("moe_layout") or {}).get("layout") == "fused":
            raise PlanError(f"snapshot {request.snapshot} wrote its MoE experts fused (moe_layout): an incremental "
                            f"merge adds to the base's per-expert tensors; merge from scratch instead")
        if core.get("out_dtype"):
            raise PlanError(f"snapshot {request.snapshot} was written in {core['out_dtype']}, not its base's dtype: "
                            f"an incremental merge adds to the base's values in the base's dtype; merge from "
                            f"scratch instead")
        self.params = core["params"]
        if self.params["lambda"] == 0:
            raise PlanError(f"snapshot {request.snapshot} was merged with lambda 0: it holds no trace of its "
                            f"experts; merge from scratch instead")
        self.base = self._check_base()
        self.parent = self._check_parent()
        self.block_bytes = core["grid"]["block_bytes"]
        if (catalog.grid_block_bytes(self.base["id"]) or DEFAULT_BLOCK_BYTES) != self.block_bytes:
            raise PlanError(f"the block grid of {self.base['id']} changed since snapshot {request.snapshot} was "
                            f"made; merge from scratch instead")
        self.experts = [dict(e) for e in core["inputs"]["experts"]]
        for e in self.experts:
            e.pop("analyze", None)
            if e.get("weight") is None:
                raise PlanError(f"expert {e['id']} of snapshot {request.snapshot} has weights per tensor; an "
                                f"incremental merge needs one weight per expert: merge from scratch instead")
        self.access = {e["id"]: dict(core["touched"].get(e["id"], {})) for e in self.experts}
        self.tensors = catalog.tensors(self.base["id"])

    # --- checks ------------------------------------------------------------------------------------
    def _check_base(self) -> dict:
        recorded = self.core["inputs"]["base"]
        base = self.catalog.model(recorded["id"])
        if base["fingerprint"] != recorded["fingerprint"]:
            raise PlanError(f"base {base['id']} was re-registered since snapshot {self.request.snapshot} was made; "
                            f"merge from scratch instead")
        check_unchanged(base)
        return base

    def _check_parent(self) -> dict:
        row = self.catalog.model(self.manifest.run["model_id"])
        check_unchanged(row)
        return {"id": row["id"], "snapshot_id": self.manifest.snapshot_id, "model_id": row["id"], "uri": row["uri"],
                "fingerprint": row["fingerprint"], "kind": row["kind"], "manifest_hash": self.manifest.manifest_hash,
                "plan_id": self.core["plan_id"]}

    def _member(self, expert_id: str) -> dict:
        for e in self.experts:
            if e["id"] == expert_id:
                return e
        raise PlanError(f"{expert_id!r} is not an expert of snapshot {self.request.snapshot} "
                        f"(its experts: {', '.join(e['id'] for e in self.experts)})")

    def _check_same_expert(self, e: dict) -> dict:
        """An expert to remove or reweight must be the very files the parent merged."""
        row = self.catalog.model(e["id"])
        if row["fingerprint"] != e["fingerprint"]:
            raise PlanError(f"expert {e['id']} was re-registered (re-trained?) since snapshot {self.request.snapshot} "
                            f"was made: its old delta cannot be taken out; remove it from scratch instead")
        check_unchanged(row)
        return row

    # --- the changed expert ------------------------------------------------------------------------
    def _added(self) -> tuple[dict, dict, int, int, float, float]:
        """(entry, access, planned bytes, full bytes, omitted l2 sum, delta norm) of an added expert."""
        eid = self.request.expert
        if any(e["id"] == eid for e in self.experts):
            raise PlanError(f"{eid!r} is already an expert of snapshot {self.request.snapshot} (use --reweight)")
        row = self.catalog.model(eid)
        if row["base_id"] != self.base["id"]:
            raise PlanError(f"expert {eid!r} is registered with base {row['base_id']!r}, not {self.base['id']!r}")
        if not self.catalog.is_analyzed(eid):
            raise PlanError(f"expert {eid!r} is not analyzed (or changed since): run `mergepipe analyze {eid}` "
                            f"first; an incremental merge plans from its statistics")
        # one expert, coefficient 1: the greedy order is its blocks by l2 per byte, the bound its omitted l2
        # exact or omitted blocks only: an incremental merge reads the changed expert's blocks themselves
        ctx = PlanContext(self.catalog, MergeRequest.build(self.base["id"], [{"model": eid, "weight": 1.0}],
                                                           "task_arithmetic", lam=1.0, normalize=False,
                                                           compact="off"))
        budget = self.request.budget or self._parent_budget()
        single = ctx.plan(budget)
        weight = 1.0 if self.request.weight is None else self.request.weight
        entry = {"id": eid, "uri": row["uri"], "fingerprint": row["fingerprint"], "kind": row["kind"],
                 "weight": weight, "density": None}
        access = single["access"][eid]
        return (entry, access, single["expert_read_by_expert"][eid], single["full_expert_bytes"],
                single["error_bound"].get("additive", single["error_bound"]["absolute"]), self._delta_norm(eid))

    def _parent_budget(self) -> Budget:
        spec = self.core["budget"]["spec"]
        try:
            b = Budget.of(spec)
            if b.fraction is not None:
                return b
        except MergePipeError:
            pass
        full = self.core["full_expert_bytes"]
        return Budget.of(self.core["budget"]["bytes"] / full if full else 1.0)

    def _omitted_l2(self, eid: str, access: dict) -> float:
        chosen = {t: set(expand_ranges(rs)) for t, rs in access.items()}
        return math.fsum(l2 for t, blk, _n, l2, _m in analyses.changed_block_stats(self.catalog, eid)
                         if blk not in chosen.get(t, ()))

    def _delta_norm(self, eid: str) -> float:
        return math.sqrt(math.fsum(l2 * l2 for _t, _b, _n, l2, _m in analyses.changed_block_stats(self.catalog, eid)))

    def _access_bytes(self, entry: dict, access: dict) -> int:
        source = open_source(entry["kind"], entry["uri"])
        total = 0
        for t in self.tensors:
            blocks = set(expand_ranges(access.get(t["name"], [])))
            if not blocks:
                continue
            total += fixed_bytes(source, t["name"])
            for span in tensor_grid(_info(t), self.block_bytes):
                if span.index in blocks:
                    total += sum(n for _, _, n in source.block_ranges(t["name"], span))
        return total

    # --- coefficients ------------------------------------------------------------------------------
    def _beta(self, W: Fraction) -> Fraction:
        return W if self.op.whole_models and not self.params["normalize"] else Fraction(1)

    def _k(self, W: Fraction) -> Fraction:
        lam = Fraction(self.params["lambda"])
        return lam / W if self.params["normalize"] and abs(W) >= Fraction(1e-8) else lam

    def coefficients(self, w_old: float, w_new: float, full_kind: bool) -> dict:
        old = [Fraction(e["weight"]) for e in self.experts]
        W = sum(old, Fraction(0))
        dw = Fraction(w_new) - Fraction(w_old)
        W2 = W + dw
        a = self._k(W2) / self._k(W)
        g = self._beta(W2) - a * self._beta(W)
        b = self._k(W2) * dw
        g_read = g - b if full_kind else g
        return {"a": float(a), "g": float(g), "b": float(b), "g_read": float(g_read),
                "copy_unread": a == 1 and g == 0, "base_unread": g != 0, "base_read": g_read != 0,
                "k_old": float(self._k(W)), "k_new": float(self._k(W2)), "weight_sum": float(W2)}

    # --- the plan ----------------------------------------------------------------------------------
    def plan(self) -> Plan:
        req = self.request
        if req.action == "add":
            entry, access, nbytes, full, omitted, norm = self._added()
            w_old, w_new = 0.0, entry["weight"]
            experts = self.experts + [entry]
        else:
            entry = self._member(req.expert)
            self._check_same_expert(entry)
            if req.action == "remove" and len(self.experts) == 1:
                raise PlanError(f"{req.expert} is the only expert of snapshot {req.snapshot}: a merge needs at "
                                f"least one expert")
            access = self.access[entry["id"]]
            nbytes = full = self._access_bytes(entry, access)
            omitted, norm = self._omitted_l2(entry["id"], access), self._delta_norm(entry["id"])
            w_old = entry["weight"]
            w_new = 0.0 if req.action == "remove" else req.weight
            if req.action == "remove":
                experts = [e for e in self.experts if e["id"] != entry["id"]]
            else:
                experts = [dict(e, weight=w_new) if e["id"] == entry["id"] else e for e in self.experts]
        check_weight_sum(self.op, self.params, [e["weight"] for e in experts], " after this change")
        coefs = self.coefficients(w_old, w_new, entry["kind"] == "full")
        eff_access = {e["id"]: (access if e["id"] == entry["id"] else self.access[e["id"]]) for e in experts}
        return self._build(entry, access, nbytes, full, omitted, norm, w_old, w_new, experts, eff_access, coefs)

    def _base_blocks(self, access: dict, coefs: dict) -> tuple[dict, int]:
        """tensor -> ranges of base blocks the extend must read, and their bytes."""
        out, nbytes = {}, 0
        for t in self.tensors:
            if t["dtype"] not in FLOAT_DTYPES:
                continue
            spans = tensor_grid(_info(t), self.block_bytes)
            read = set(expand_ranges(access.get(t["name"], [])))
            need = [s for s in spans if (coefs["base_read"] if s.index in read else coefs["base_unread"])]
            if need:
                out[t["name"]] = compact_ranges(s.index for s in need)
                nbytes += sum(s.nbytes for s in need)
        return out, nbytes

    def _bound(self, entry, omitted, norm, w_old, w_new, coefs) -> dict:
        old = self.core.get("error_bound") or {}
        a = abs(coefs["a"])
        # the additive bound composes along a chain (the blockwise one needs every expert's blocks per position)
        old_additive = old.get("additive", old.get("absolute")) or 0.0
        absolute = a * (old_additive - abs(coefs["k_old"] * w_old) * omitted) \
            + abs(coefs["k_new"] * w_new) * omitted
        parent_norm = old.get("full_delta_norm")
        full_norm = None
        if parent_norm is not None:  # an estimate: the changed expert's delta taken as orthogonal to the rest
            sq = (a * parent_norm) ** 2 + (coefs["k_new"] * w_new * norm) ** 2 - (a * coefs["k_old"] * w_old * norm) ** 2
            full_norm = math.sqrt(max(sq, 0.0))
        absolute = max(absolute, 0.0)
        rel = absolute / full_norm if full_norm else None
        return {"absolute": absolute, "full_delta_norm": full_norm, "relative": rel, "incremental": True,
                "kind": "additive", "additive": absolute, "additive_relative": rel}

    def _build(self, entry, access, nbytes, full, omitted, norm, w_old, w_new, experts, eff_access, coefs) -> Plan:
        req, core = self.request, self.core
        base_blocks, base_bytes = self._base_blocks(access, coefs)
        model_bytes = sum(t["nbytes"] for t in self.tensors)
        old_bytes = dict(core.get("access_bytes") or core["estimated_by_expert"])
        access_bytes = {e["id"]: (nbytes if e["id"] == entry["id"] else old_bytes.get(e["id"], 0)) for e in experts}
        # the recipe's spelling carries along a chain: the parent's, unless --budget chose another
        budget_spec = req.budget.spec if req.budget else core["budget"]["spec"]
        plan_core = {
            "format": EXTEND_FORMAT,
            "parent": self.parent,
            "change": {"action": req.action, "expert": entry["id"], "weight_old": w_old if req.action != "add" else None,
                       "weight": w_new if req.action != "remove" else None},
            "changed": entry,
            "base": {"id": self.base["id"], "uri": self.base["uri"], "fingerprint": self.base["fingerprint"]},
            "experts": experts,
            "operator": self.op.name, "params": self.params, "seed": core["seed"], "strategy": core["strategy"],
            "grid": {"block_bytes": self.block_bytes},
            "budget": {"spec": budget_spec, "bytes": nbytes},
            "access": {e: eff_access[e] for e in sorted(eff_access)},
            "reads": {"expert": access, "base": base_blocks},
            "coefficients": coefs,
            "thresholds": {},
        }
        if core.get("tokenizer"):
            plan_core["tokenizer"] = core["tokenizer"]
        digest = hashlib.sha256(canonical(plan_core)).hexdigest()
        data = dict(plan_core)
        data.update({
            "id": "plan-" + digest[:16], "digest": "sha256:" + digest,
            "full_expert_bytes": full,
            "estimate": {"snapshot_read": model_bytes, "base_read": base_bytes, "expert_read": nbytes,
                         "output_write": model_bytes},
            "from_scratch_estimate": {"base_read": model_bytes, "expert_read": sum(access_bytes.values()),
                                      "output_write": model_bytes},
            "access_bytes": access_bytes,
            "expert_read_by_expert": {entry["id"]: nbytes},
            "error_bound": self._bound(entry, omitted, norm, w_old, w_new, coefs),
            "software": {"mergepipe": __version__},
        })
        return Plan(data)


def _info(row: dict) -> TensorInfo:
    return TensorInfo(row["name"], row["dtype"], tuple(row["shape"]), row["file"], row["offset"], row["nbytes"])
