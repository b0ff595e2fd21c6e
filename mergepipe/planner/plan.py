"""A plan is data: canonical JSON with a digest over the inputs' fingerprints, operator, parameters,
grid and access set (compact block ranges per expert and tensor); saved in and loaded from the catalog."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mergepipe.catalog import plans
from mergepipe.catalog.db import Catalog
from mergepipe.errors import PlanError
from mergepipe.planner.explain_experts import DEFAULT_TOP, ExpertView
from mergepipe.planner.explain_sections import explain_text
from mergepipe.planner.extend_format import explain_extend, is_extend
from mergepipe.planner.settings import params_on


PLAN_FORMAT = "mergepipe.plan/1"


@dataclass
class Plan:
    """A content-addressed merge plan. ``data`` is the canonical, JSON-serialisable form (what the digest and
    the catalog hold); everything outside the planner reads it through the typed properties below (the
    engine, the manifest, EXPLAIN, export), so the format's keys are spelled here only."""

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

    # --- typed reads: the engine, the manifest and EXPLAIN read a plan through these, not its keys ----------
    @property
    def operator(self) -> str:
        return self.data["operator"]

    @property
    def params(self) -> dict:
        """The merge-wide operator parameters (a per-tensor one as its setting's plain form)."""
        return self.data["params"]

    @property
    def seed(self) -> int:
        return self.data["seed"]

    @property
    def strategy(self) -> str:
        return self.data["strategy"]

    @property
    def base(self) -> dict:
        """The base model's record (id, uri, fingerprint, ...)."""
        return self.data["base"]

    @property
    def base_id(self) -> str:
        return self.data["base"]["id"]

    @property
    def experts(self) -> list[dict]:
        """The experts' entries in order ([] for an incremental plan: see :attr:`changed`)."""
        return self.data.get("experts", [])

    @property
    def expert_ids(self) -> list[str]:
        return [e["id"] for e in self.experts]

    @property
    def analyzed_on_the_way(self) -> list[dict]:
        """The experts a first merge analyzes while it reads them."""
        return [e for e in self.experts if e.get("analyze")]

    @property
    def grid(self) -> dict:
        return self.data["grid"]

    @property
    def block_bytes(self) -> int:
        return self.data["grid"]["block_bytes"]

    @property
    def budget(self) -> dict:
        """``{"spec", "bytes", "first_merge"?}``."""
        return self.data["budget"]

    @property
    def budget_bytes(self) -> int:
        return self.data["budget"]["bytes"]

    @property
    def target_bound(self) -> float | None:
        """The target error bound a budget was chosen for (None: a budget was given)."""
        return self.data.get("target_bound")

    @property
    def full_expert_bytes(self) -> int:
        return self.data["full_expert_bytes"]

    @property
    def estimated(self) -> dict:
        """Estimated bytes: base_read, expert_read, compact_read?, output_write."""
        return self.data["estimate"]

    @property
    def estimated_by_expert(self) -> dict[str, int]:
        return self.data["expert_read_by_expert"]

    @property
    def estimated_by_tensor(self) -> dict[str, int]:
        """tensor -> estimated expert bytes read."""
        return self.data.get("expert_read_by_tensor") or {}

    @property
    def blocks_total(self) -> int:
        """Blocks per model on the plan's grid (a from-scratch plan)."""
        return self.data["blocks_total"]

    @property
    def blocks_candidate(self) -> dict[str, int]:
        """expert id -> blocks that may change the output (the candidates the budget chooses from)."""
        return self.data["blocks_candidate"]

    @property
    def suggested_budget(self) -> dict | None:
        """The budget the planner suggests (planner/bounds.py), outside the digest; None where it has none."""
        return self.data.get("suggested_budget")

    @property
    def compact_read_by_expert(self) -> dict[str, int]:
        return self.data.get("compact_read_by_expert") or {}

    @property
    def blocks_selected(self) -> dict[str, int]:
        """expert id -> blocks read exactly."""
        return self.data["blocks_selected"]

    @property
    def warnings(self) -> list[str]:
        return self.data.get("warnings") or []

    @property
    def compact_note(self) -> str | None:
        """Why the compact tier was not used, where it was asked for (else None)."""
        return self.data.get("compact_note")

    @property
    def error_bound(self) -> dict | None:
        return self.data["error_bound"]

    @property
    def access(self) -> dict:
        """expert id -> tensor -> block ranges read exactly."""
        return self.data["access"]

    def access_for(self, expert_id: str) -> dict[str, list[list[int]]]:
        """One expert's block ranges read exactly, per tensor."""
        return self.data["access"][expert_id]

    @property
    def thresholds(self) -> dict:
        """expert id -> tensor -> the operator's per-tensor statistics (ops/core.tensor_statistics)."""
        return self.data["thresholds"]

    @property
    def coefficients(self) -> dict:
        """An interpolation method's per-tensor scalars (an incremental plan: the expert coefficients)."""
        return self.data.get("coefficients") or {}

    @property
    def composed_coefficients(self) -> dict:
        return self.data.get("composed_coefficients") or {}

    @property
    def omitted(self) -> dict:
        """tensor -> block ranges not read (interpolation methods)."""
        return self.data.get("omitted") or {}

    @property
    def tensor_params(self) -> dict:
        """tensor -> lambda/normalize/rescale where given per tensor (filters or a gradient)."""
        return self.data.get("tensor_params") or {}

    def params_for(self, tensor: str) -> dict:
        """The operator parameters on one tensor (the per-tensor ones over the merge-wide)."""
        return params_on(self.params, self.data.get("tensor_params"), tensor)

    @property
    def layout(self) -> dict | None:
        """A `slices:` plan's output layout (None: the base's tensors in place)."""
        return self.data.get("layout")

    @property
    def output_tensor_names(self) -> set[str] | None:
        """The output tensors a `slices:` layout writes (None without a layout)."""
        layout = self.data.get("layout")
        return None if layout is None else {t[0] for t in layout["tensors"]}

    @property
    def tokenizer(self) -> dict | None:
        return self.data.get("tokenizer")

    @property
    def moe_layout(self) -> dict | None:
        """A Mixtral/Qwen3-MoE base's layout setting ({layout: fused | per-expert, architecture}), else None."""
        return self.data.get("moe_layout")

    @property
    def out_dtype(self) -> str | None:
        """The float tensors' output dtype when the plan converts them (None: each tensor's own dtype)."""
        return self.data.get("out_dtype")

    @property
    def vocab(self) -> dict | None:
        """A re-ordered vocabulary (the tokenizer's ``vocab``), else None."""
        return (self.data.get("tokenizer") or {}).get("vocab")

    @property
    def composed_tensors(self) -> set[str]:
        """The embedding tensors whose rows a re-ordered vocabulary composes (empty without one)."""
        return set((self.vocab or {}).get("tensors") or ())

    @property
    def chat_template(self) -> str | None:
        return (self.data.get("tokenizer") or {}).get("chat_template")

    @property
    def base_member(self) -> dict | None:
        """A model soup's base entry (its weight, position, whether it is the reference), else None."""
        return self.data.get("base_member")

    @property
    def compact(self) -> dict | None:
        """Blocks read from the compact tier (experts -> codec, group, bits), else None."""
        return self.data.get("compact")

    @property
    def compact_mode(self) -> str | None:
        """The compact-tier mode the request asked for (None: none)."""
        return self.data.get("compact_mode") or (self.data.get("compact") or {}).get("mode")

    @property
    def compact_files(self) -> dict:
        return self.data.get("compact_files") or {}

    @property
    def compact_store(self) -> dict | None:
        """The compacts a first merge's analysis writes too (codec, group), else None."""
        return self.data.get("compact_store")

    @property
    def tiers(self) -> dict | None:
        return self.data.get("tiers")

    # an incremental plan (planner/extend.py)
    @property
    def is_extend(self) -> bool:
        return is_extend(self.data)

    @property
    def parent(self) -> dict | None:
        """The snapshot an incremental plan extends (snapshot_id, model_id, uri, manifest_hash), else None."""
        return self.data.get("parent")

    @property
    def changed(self) -> dict | None:
        """The expert an incremental plan adds, re-weights or replaces."""
        return self.data.get("changed")

    @property
    def change(self) -> dict:
        return self.data["change"]

    @property
    def reads(self) -> dict:
        """An incremental plan's block reads: ``{"base": tensor -> ranges, "expert": ...}``."""
        return self.data["reads"]

    @property
    def access_bytes(self) -> dict:
        return self.data["access_bytes"]

    @property
    def from_scratch_estimate(self) -> dict:
        return self.data["from_scratch_estimate"]

    def inputs(self) -> list[dict]:
        """The models the plan reads: the base and the experts (an incremental plan: base, parent, changed)."""
        if self.is_extend:
            return [self.base, self.parent, self.changed]
        return [self.base, *self.experts]

    def explain(self, experts_top: int | None = DEFAULT_TOP, experts: str | None = None) -> str:
        """EXPLAIN text; ``experts_top``: experts listed (None: all; the rest on one line), ``experts``: an
        fnmatch pattern of the expert ids to list. The plan is the same whatever is listed."""
        if is_extend(self.data):
            return explain_extend(self.data)
        return explain_text(self, ExpertView.of(experts_top, experts, show_all=experts_top is None))


def as_plan(plan) -> Plan:
    """A :class:`Plan` from a Plan or its data (a worker receives the data)."""
    return plan if isinstance(plan, Plan) else Plan(plan)


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


def save_plan(catalog: Catalog, plan: Plan) -> None:
    plans.upsert_plan(catalog, {
        "id": plan.id, "base_id": plan.base_id, "operator": plan.operator,
        "budget_bytes": plan.budget_bytes, "full_expert_bytes": plan.full_expert_bytes,
        "expert_read_bytes": plan.estimated["expert_read"],
        "error_bound": (plan.error_bound or {}).get("absolute"), "json": plan.to_json(),
    })


def load_plan(catalog: Catalog, plan_id: str) -> Plan:
    text = plans.plan_json(catalog, plan_id)
    if text is None:
        raise PlanError(f"unknown plan id {plan_id!r}")
    return Plan.from_json(text)
