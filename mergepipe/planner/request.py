"""A merge request: everything a merge is asked to do, built once (by the command line, a mergekit
YAML config, a dashboard page or the Python API), validated once, and passed down whole.

What can be checked without the catalog is checked here (the operator and its parameters, the
strategy, the seed, the budget, the number of weights); what needs the catalog (the models, their
settings per tensor, densities against the operator) is checked by the planner's ``PlanContext``.
The plan records the request exactly as the planner always did, so plan ids and digests do not
depend on how the request was spelled."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mergepipe.errors import PlanError
from mergepipe.ops.core import get_op, resolve_params
from mergepipe.ops.spec import OpSpec
from mergepipe.planner.budget import Budget
from mergepipe.planner.strategies import STRATEGIES

# The operator parameters a request carries (None: the operator's default).
PARAM_KEYS = ("lam", "normalize", "rescale", "gamma", "epsilon")


@dataclass(frozen=True)
class MergeRequest:
    """``base`` and ``experts`` are catalog ids; an expert is an id or ``{"model": id, "weight"?: w,
    "density"?: d}`` where w and d are numbers or per-tensor settings (gradients, filter conditions).
    ``weight`` and ``density`` are merge-wide settings; ``params`` the operator's other parameters
    (``lam``, ``normalize``, ``rescale``, ``gamma``, ``epsilon``; None or absent: the default).
    ``out`` and ``model_id`` say where a merge publishes (unused by planning)."""

    base: str
    experts: tuple
    operator: str = "linear"
    weight: object = None
    density: object = None
    params: dict = field(default_factory=dict)
    budget: Budget = field(default_factory=Budget)
    strategy: str = "norm"
    seed: int = 0
    out: str | None = None
    model_id: str | None = None

    @classmethod
    def build(cls, base: str, experts, operator: str = "linear", *, weights=None, weight=None, density=None,
              lam=None, normalize=None, rescale=None, gamma=None, epsilon=None, budget=None, budget_mb=None,
              target_bound=None, strategy: str | None = None, seed: int | None = None, out=None,
              model_id: str | None = None, **unknown) -> MergeRequest:
        """Shape keyword arguments (the API's, the CLI's flags, a page's widgets) into a validated request.
        ``weights`` lists one weight per expert, in order; ``budget`` is any spelling :class:`Budget` takes."""
        params = {k: v for k, v in (("lam", lam), ("normalize", normalize), ("rescale", rescale),
                                    ("gamma", gamma), ("epsilon", epsilon)) if v is not None}
        if unknown:  # an operator parameter this version does not know: say which operator refuses it
            params.update({k: v for k, v in unknown.items() if v is not None})
        specs = _expert_list(experts)
        if weights is not None:
            if specs and len(weights) != len(specs):
                raise PlanError(f"{len(weights)} weights given for {len(specs)} experts")
            specs = [dict(s, weight=w) for s, w in zip(specs, weights)]
        request = cls(base=base, experts=tuple(specs), operator=operator, weight=weight, density=density,
                      params=params, budget=Budget.of(budget, mb=budget_mb, target_bound=target_bound),
                      strategy="norm" if strategy is None else strategy, seed=0 if seed is None else seed,
                      out=None if out is None else str(out), model_id=model_id)
        return request.validated()

    def validated(self) -> MergeRequest:
        """The request with its operator's canonical name, after every catalog-free check."""
        op = get_op(self.operator)
        self.resolved_params(op)
        if self.strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            try:
                seed = int(self.seed)
            except (TypeError, ValueError):
                raise PlanError(f"seed must be an integer, not {self.seed!r}") from None
            return replace(self, operator=op.name, seed=seed)
        return replace(self, operator=op.name) if op.name != self.operator else self

    @property
    def op(self) -> OpSpec:
        return get_op(self.operator)

    def resolved_params(self, op: OpSpec | None = None) -> dict:
        """The operator's full parameter set (what the plan records as ``params``)."""
        p = dict(self.params)
        return resolve_params(op or self.op, normalize=p.pop("normalize", None), rescale=p.pop("rescale", None),
                              lam=p.pop("lam", None), **p)

    def with_budget(self, budget) -> MergeRequest:
        return replace(self, budget=Budget.of(budget))

    def replace(self, **changes) -> MergeRequest:
        return replace(self, **changes).validated()


def _expert_list(experts) -> list[dict]:
    if isinstance(experts, str):
        experts = [experts]
    out = []
    for e in experts or ():
        spec = {"model": e} if isinstance(e, str) else dict(e)
        if "model" not in spec:
            raise PlanError(f"expert {e!r} has no model id")
        out.append(spec)
    return out
