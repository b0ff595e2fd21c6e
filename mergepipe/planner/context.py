"""The budget-aware planner: which (expert, tensor, block) triples to read, decided from the catalog
alone, before any expert byte is read.

Greedy by score per byte (default score |c_i| * ||delta_{i,t,b}||_2, which minimises the additive error
bound), deterministic tie-break (expert order, tensor order, block index), budget-sound by
construction. ``PlanContext`` holds everything about a merge request except the budget; ``Planner``
is the front door.

A PlanContext composes three parts, each its own module:

- the resolved request (planner/resolved.py): the base, its tensors, each expert's weight, density and
  own parameters per tensor, the weight and coefficient matrices, validated once; the numeric guards (an
  expert whose delta holds NaN/Inf is refused; one whose delta is zero where it is weighted is flagged in
  the plan's ``warnings``; experts analyzed on the way are checked by the engine as their statistics
  arrive);
- the candidates (planner/candidates.py): the magnitude thresholds and every block the operator could
  use, in greedy order; the compact tier (planner/tiers.py) and the interpolation methods' scalars
  (planner/methods.py) built on them;
- the assembly (planner/assembly.py): a selection made a Plan (access set, digest, estimates, warnings).

``PlanContext.plan`` chooses the blocks for one :class:`Budget` (greedy, joint, coalesced or three-way).
"""

from __future__ import annotations

import numpy as np

from mergepipe.catalog.db import Catalog
from mergepipe.errors import PlanError
from mergepipe.planner import assembly, methods, vocab_rows
from mergepipe.planner.bounds import Bounds
from mergepipe.planner.budget import Budget
from mergepipe.planner.candidates import Candidates, find_candidates, find_thresholds
from mergepipe.planner.coalesce import coalesce
from mergepipe.planner.plan import Plan, save_plan
from mergepipe.planner.request import MergeRequest
from mergepipe.planner.resolved import ResolvedRequest
from mergepipe.planner.strategies import StrategyScores
from mergepipe.planner.tiers import EXACT, tier_plan_inputs
from mergepipe.storage.safetensors import TensorInfo
from mergepipe.storage.tiers import tier_name


def _resolved(name: str) -> property:
    """A read-only attribute of a PlanContext that is its resolved request's (planner/resolved.py)."""
    return property(lambda self: getattr(self.resolved, name), doc=f"The resolved request's ``{name}``.")


class PlanContext(StrategyScores, Bounds):
    """Everything about a merge request except the budget: reusable while a user drags a slider."""

    candidates: Candidates

    def __init__(self, catalog: Catalog, request: MergeRequest):
        self.resolved = ResolvedRequest(catalog, request)
        self.thresholds = find_thresholds(self)  # marks the experts lacking one to be analyzed on the way
        if self.output_layout is not None and self.to_analyze:  # renamed tensors are not analyzed on the way
            raise methods.NeedsAnalysis(f"a `slices:` merge needs its experts analyzed first (not analyzed: "
                                        f"{', '.join(e['id'] for e in self.to_analyze)}): `mergepipe analyze "
                                        f"{' '.join(e['id'] for e in self.to_analyze)}`")
        self.candidates = find_candidates(self)
        # the compact tier (planner/tiers.py): None when the request or the catalog has none
        self.tiers, self.compact_note, self.compact_rows = tier_plan_inputs(self)
        # interpolation methods: per-tensor scalars; a re-ordered vocabulary's embedding tensors get theirs at
        # merge time, from their composed rows (planner/methods.py)
        self.method_scalars, self.composed_settings = (methods.tensor_scalars(self) if self.op.nonlinear
                                                       else (None, {}))

    # the resolved request's values, under the names the planner's parts read (bounds, strategies, tiers, ...)
    catalog = _resolved("catalog")
    request = _resolved("request")
    op = _resolved("op")
    params = _resolved("params")
    seed = _resolved("seed")
    strategy = _resolved("strategy")
    base = _resolved("base")
    output_layout = _resolved("output_layout")
    tensors = _resolved("tensors")
    tensor_index = _resolved("tensor_index")
    tensor_params = _resolved("tensor_params")
    experts = _resolved("experts")
    vocab = _resolved("vocab")
    vocab_bytes = _resolved("vocab_bytes")
    block_bytes = _resolved("block_bytes")
    weight_matrix = _resolved("weight_matrix")
    base_member = _resolved("base_member")
    base_weights = _resolved("base_weights")
    weight_sums = _resolved("weight_sums")
    warnings = _resolved("warnings")
    coef_matrix = _resolved("coef_matrix")
    to_analyze = _resolved("to_analyze")

    def params_for(self, tensor: str) -> dict:
        """The operator parameters on one tensor (planner/settings.params_on)."""
        return self.resolved.params_for(tensor)

    # --- estimates (planner/assembly.py) ---------------------------------------------------------
    def base_bytes(self) -> int:
        """Bytes of input tensors read as they are (the base's; a layout's copies from any model) =
        bytes written."""
        return assembly.base_bytes(self)

    def output_info(self, row: dict) -> TensorInfo:
        """A tensor as written (a re-ordered embedding tensor has the output vocabulary's rows)."""
        return assembly.output_info(self, row)

    def output_bytes(self) -> int:
        return assembly.output_bytes(self)

    # --- planning --------------------------------------------------------------------------------
    def plan(self, budget: Budget | None = None) -> Plan:
        """The plan at ``budget`` (None: the request's). Other spellings (``"10%"``, MiB, a target bound)
        are converted by the caller: ``Budget.of(...)``, ``Budget.percent``, ``Budget.target``."""
        if budget is None:
            budget = self.request.budget
        if not isinstance(budget, Budget):
            raise TypeError(f"PlanContext.plan takes a Budget, not {type(budget).__name__} (Budget.of converts "
                            f"every spelling)")
        cands = self.candidates
        reserved = sum(self.vocab_bytes.values())
        full = cands.full_bytes + reserved
        target_bound = budget.target_bound
        if budget.is_target and not self.op.additive:
            raise PlanError(f"--target-bound needs an additive operator (linear, task_arithmetic), not {self.op.name}")
        if self.to_analyze:  # a first merge: the budget applies from the next merge on
            return assembly.build(self, cands.order, budget.spec, full, target_bound, first_merge=True)
        if self.tiers is not None:
            return self._plan_tiered(budget, full)
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
        return assembly.build(self, chosen, budget.spec, budget_bytes, target_bound, greedy=greedy)

    def _plan_tiered(self, budget: Budget, full: int) -> Plan:
        """A three-way plan: exact, compact or omitted per candidate (planner/tiers.py)."""
        if budget.is_target:
            budget_bytes = self.smallest_budget_for(budget.target_bound * self.full_norm_estimate()) if full else 0
        else:
            budget_bytes = budget.bytes_of(full) if full else 0
        tier = self.tiers.select(budget_bytes)
        chosen = np.nonzero(tier == EXACT)[0]
        return assembly.build(self, chosen, budget.spec, budget_bytes, budget.target_bound, tier=tier)

    def _coalesces(self, budget: Budget) -> bool:
        """Whether this plan re-chooses its marginal blocks for fewer ranges (planner/coalesce.py)."""
        mode = self.request.coalesce
        if mode == "off" or budget.is_target or self.op.joint or self.op.nonlinear:
            return False
        if self.strategy in ("random", "uniform") or self.candidates.setup.any():
            return False
        return mode == "on" or any(tier_name(e["uri"]) != "local" for e in self.experts)


class Planner:
    """``Planner(catalog).plan(request)``, a :class:`MergeRequest`; or, for scripts,
    ``Planner(catalog).plan(base_model=..., experts=[...], operator="TIES", budget_mb=8192)``, which
    builds one (``MergeRequest.build``: the keyword settings, budget spellings included, converted once)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def context(self, request: MergeRequest | str, experts=None, operator: str = "linear", **kw) -> PlanContext:
        return PlanContext(self.catalog, _request(request, experts, operator, kw))

    def plan(self, request: MergeRequest | str | None = None, experts=None, operator: str = "linear",
             save: bool = True, base_model: str | None = None, **kw) -> Plan:
        ctx = PlanContext(self.catalog, _request(request if request is not None else base_model, experts, operator, kw))
        plan = ctx.plan(ctx.request.budget)
        if save:
            save_plan(self.catalog, plan)
        return plan


def _request(request, experts, operator, kw) -> MergeRequest:
    if isinstance(request, MergeRequest):
        if experts is not None or kw:
            raise PlanError("give either a MergeRequest or keyword settings, not both")
        return request
    return MergeRequest.build(request, experts, operator, **kw)
