"""A merge request: everything a merge is asked to do, built once (by the command line, a mergekit
YAML config, a dashboard page or the Python API), validated once, and passed down whole.

What can be checked without the catalog is checked here (the operator and its parameters, the
strategy, the seed, the budget, the number of weights); what needs the catalog (the models, their
settings per tensor, densities against the operator) is checked by the resolved request
(planner/resolved.py), which a ``PlanContext`` builds.
The plan records the request exactly as the planner always did, so plan ids and digests do not
depend on how the request was spelled.

Every parameter is range-checked here, NaN included (comparisons are written ``not (low <= x)`` so that
NaN fails them): lambda, weights finite; densities in (0, 1]; gamma in [0, 1] and, for breadcrumbs,
gamma + density <= 1 (density 1, the default, keeps everything but the top gamma); della's epsilon in
[0, 0.5] with density - epsilon > 0 and density + epsilon <= 1; under normalize (without sign
consensus) a sum of the weights that is not (about) zero; the seed a non-negative integer. Each refusal
is a PlanError naming the parameter, its value and the allowed range. Weights that vary per tensor are
summed per tensor by the planner."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import math

from mergepipe.errors import PlanError
from mergepipe.ops.core import get_op, resolve_params
from mergepipe.ops.spec import OpSpec, Sparsify
from mergepipe.planner.budget import Budget
from mergepipe.planner.coalesce import MODES
from mergepipe.planner.settings import check_setting, expert_params, is_scalar
from mergepipe.planner.strategies import STRATEGIES
from mergepipe.storage.codecs import COMPACT_MODES
from mergepipe.storage.moe_layout import LAYOUTS as MOE_LAYOUTS

# The operator parameters a request carries (None: the operator's default).
PARAM_KEYS = ("lam", "normalize", "rescale", "gamma", "epsilon")
# Under normalize: |sum of the weights| must exceed this fraction of the sum of their magnitudes.
WEIGHT_SUM_EPS = 1e-12
MAX_SEED = 2**64 - 1
OUT_DTYPES = ("F32", "F16", "BF16")  # the float dtypes an output may be written in


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
    # the output tokenizer when not the base's files as they are: {"source": id, "source_uri": folder,
    # "chat_template": text, "vocab": the re-ordered vocabulary, config/vocab.py} (each key may be absent);
    # recorded in the plan (and its digest) when set
    tokenizer: dict | None = None
    # a `slices:` config's output layout (config/slices.py): {"tensors": [[out name, model id, input name,
    # scale or None], ...] in output order, "layers": [[model id, input layer], ...] per output layer};
    # None: the output has the base's tensors under their own names
    layout: dict | None = None
    # a model soup: the base is averaged in as one of the models (linear only): {"weight": setting,
    # "position": its index among the models in config order, "reference": true when MergePipe chose it
    # (a config without base_model) rather than the config listing its base_model among the models}
    base_member: dict | None = None
    # fewer, larger ranges at (nearly) equal bytes (planner/coalesce.py): auto (when an expert is remote),
    # on, off; it decides the access set, which the plan's digest covers
    coalesce: str = "auto"
    coalesce_tolerance: float = 0.10  # the band around the cut-off score per byte it re-chooses within
    # the compact tier (planner/tiers.py): auto (the levels the catalog's compacts hold), off (exact or omitted
    # only: today's plans), or a codec name restricting the levels read (storage/compact.py)
    compact: str = "auto"
    # the float tensors' output dtype (a safetensors code: F32, F16, BF16) when not the base's (mergekit's
    # out_dtype, else dtype): each output block is rounded once from float32 to it; recorded when it converts
    out_dtype: str | None = None
    # a Mixtral/Qwen3-MoE base's per-expert matrices written fused as transformers v5 and mergekit 0.1.5 do
    # (storage/moe_layout.py): auto (mergekit's: fused), fused, per-expert; recorded for those families only
    moe_layout: str = "auto"

    @classmethod
    def build(cls, base: str, experts, operator: str = "linear", *, weights=None, weight=None, density=None,
              lam=None, normalize=None, rescale=None, gamma=None, epsilon=None, budget=None, budget_mb=None,
              target_bound=None, strategy: str | None = None, seed: int | None = None, out=None,
              model_id: str | None = None, tokenizer: dict | None = None, layout: dict | None = None,
              base_member: dict | None = None, coalesce: str | None = None,
              coalesce_tolerance: float | None = None, compact=None, out_dtype: str | None = None,
              moe_layout: str | None = None, **unknown) -> MergeRequest:
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
                      out=None if out is None else str(out), model_id=model_id,
                      tokenizer=_tokenizer_setting(tokenizer), layout=_layout_setting(layout), base_member=base_member,
                      coalesce="auto" if coalesce is None else coalesce,
                      coalesce_tolerance=0.10 if coalesce_tolerance is None else coalesce_tolerance,
                      compact=compact_setting(compact), out_dtype=out_dtype,
                      moe_layout="auto" if moe_layout is None else moe_layout)
        return request.validated()

    def validated(self) -> MergeRequest:
        """The request with its operator's canonical name, after every catalog-free check."""
        op = get_op(self.operator)
        params = self.resolved_params(op)
        self._check_settings(op, params)
        if self.base_member is not None:
            member = _base_member(op, self.base_member, len(self.experts))
            if member != self.base_member:
                return replace(self, base_member=member).validated()
        if self.strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        if self.coalesce not in MODES:
            raise PlanError(f"unknown coalesce mode {self.coalesce!r} (choose from {', '.join(MODES)})")
        tol = self.coalesce_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0 <= tol < 1):
            raise PlanError(f"the coalesce tolerance must be a number in [0, 1), not {tol!r}")
        if self.out_dtype is not None and self.out_dtype not in OUT_DTYPES:
            raise PlanError(f"unknown output dtype {self.out_dtype!r} (choose from {', '.join(OUT_DTYPES)})")
        if self.moe_layout not in MOE_LAYOUTS:
            raise PlanError(f"unknown MoE layout {self.moe_layout!r} (choose from {', '.join(MOE_LAYOUTS)})")
        if self.compact not in COMPACT_MODES:
            raise PlanError(f"unknown compact setting {self.compact!r} (choose from {', '.join(COMPACT_MODES)})")
        seed = check_seed(self.seed)
        if seed is not self.seed:
            return replace(self, operator=op.name, seed=seed)
        return replace(self, operator=op.name) if op.name != self.operator else self

    def _check_settings(self, op: OpSpec, params: dict) -> None:
        """Weights and densities (merge-wide and per expert): finite, densities in range for ``op``; with
        one weight per expert, their sum under normalize."""
        # the merge-wide density is named after the first expert that takes it, as the planner does
        users = [e["model"] for e in self.experts if e.get("density") is None]
        settings = [("", f" of {users[0]}" if users else "", self.weight, self.density, params)]
        settings += [(f" of {e['model']}",) * 2 + (e.get("weight"), e.get("density"), expert_params(params, e))
                     for e in self.experts]
        for weight_where, density_where, weight, density, own in settings:
            if weight is not None:
                check_setting(weight, "weight" + weight_where)
            if density is not None:  # a per-tensor setting is checked per tensor by the planner (naming it)
                d = check_setting(density, "density" + density_where)
                if is_scalar(d):
                    check_density(op, own, d, density_where)
        if self.weight is not None or any(e.get("weight") is not None for e in self.experts):
            ws = [e["weight"] if e.get("weight") is not None else self.weight for e in self.experts]
            ws = [1.0 if w is None else w for w in ws]
            if self.base_member is not None:  # a soup: the base's weight is in the sum too
                ws.append(self.base_member.get("weight", 1.0))
            if all(is_scalar(w) for w in ws):
                check_weight_sum(op, params, [float(w) for w in ws])

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


VOCAB_KEYS = ("source", "sha256", "tokens_n", "rows", "models", "row_models", "tensors", "sources")


def _tokenizer_setting(tokenizer) -> dict | None:
    if not tokenizer:
        return None
    if not isinstance(tokenizer, dict) or set(tokenizer) - {"source", "source_uri", "chat_template", "vocab"} \
            or not all(isinstance(v, str) for k, v in tokenizer.items() if k != "vocab"):
        raise PlanError("tokenizer must be a mapping of source, source_uri and chat_template (strings) and vocab")
    if "vocab" in tokenizer and not (isinstance(tokenizer["vocab"], dict)
                                     and set(VOCAB_KEYS) <= set(tokenizer["vocab"])):
        raise PlanError(f"tokenizer.vocab must be a mapping of {', '.join(VOCAB_KEYS)} (config/vocab.py)")
    if ("source" in tokenizer) != ("source_uri" in tokenizer):
        raise PlanError("a tokenizer source needs both its id (source) and its folder (source_uri)")
    return dict(sorted(tokenizer.items()))


def _layout_setting(layout) -> dict | None:
    if layout is None:
        return None
    ok = isinstance(layout, dict) and set(layout) == {"tensors", "layers"} and isinstance(layout["tensors"], list) \
        and all(isinstance(t, (list, tuple)) and len(t) == 4 and all(isinstance(x, str) for x in t[:3])
                and (t[3] is None or is_scalar(t[3])) for t in layout["tensors"]) and layout["tensors"]
    if not ok:
        raise PlanError("layout must be {tensors: [[output name, model id, input name, scale], ...], layers: [...]}")
    outs = [t[0] for t in layout["tensors"]]
    if len(set(outs)) != len(outs):
        raise PlanError("layout names an output tensor twice")
    return {"tensors": [[t[0], t[1], t[2], None if t[3] is None else float(t[3])] for t in layout["tensors"]],
            "layers": [[str(m), int(i)] for m, i in layout["layers"]]}
def _base_member(op: OpSpec, member, n_experts: int) -> dict:
    """The soup's base member in its canonical form: weight (checked setting; default 1), position, reference."""
    if not (op.whole_models or op.base_optional):
        raise PlanError(f"{op.name} cannot average the base in as a model (linear and karcher do: a model soup)")
    if not isinstance(member, dict) or set(member) - {"weight", "position", "reference"}:
        raise PlanError("base_member must be a mapping of weight, position and reference")
    position = member.get("position", 0)
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= n_experts:
        raise PlanError(f"base_member position must be an integer in [0, {n_experts}], not {position!r}")
    weight = member.get("weight")
    return {"weight": 1.0 if weight is None else check_setting(weight, "weight of the base"),
            "position": position, "reference": bool(member.get("reference", False))}


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


def check_density(op: OpSpec, params: dict, d: float, where: str = "") -> None:
    """A density of ``op`` (``where``: of which expert, on which tensor): in (0, 1], and within the
    ranges its sparsification needs with gamma (breadcrumbs) or epsilon (della)."""
    if not op.uses_density:
        return
    if not (0 < d <= 1):
        raise PlanError(f"density {d:g}{where} is outside (0, 1], the range of density")
    if op.sparsify is Sparsify.OUTLIERS and d < 1 and not (params["gamma"] + d <= 1 + 1e-12):
        raise PlanError(f"breadcrumbs needs gamma + density <= 1 (gamma {params['gamma']:g} + density {d:g}{where} "
                        f"= {params['gamma'] + d:g}): lower gamma or the density")
    if op.sparsify is Sparsify.DELLA:
        eps = params["epsilon"]
        if d < 1 and not (0 < eps and d - eps > 0 and d + eps <= 1):
            raise PlanError(f"della needs 0 < density - epsilon and density + epsilon <= 1 "
                            f"(density {d:g}{where}, epsilon {eps:g}): keep density in ({eps:g}, {1 - eps:g}]")


def check_weight_sum(op: OpSpec, params: dict, weights, where: str = "") -> None:
    """Under normalize (without sign consensus, whose divisor is the weight of agreeing entries, 0 -> 1)
    the merged delta is divided by the sum of the weights: refuse a sum of (about) zero."""
    if not params.get("normalize") or op.consensus or not weights:
        return
    total = math.fsum(weights)
    scale = math.fsum(abs(w) for w in weights)
    if not (abs(total) > WEIGHT_SUM_EPS * scale):  # all-zero weights included
        raise PlanError(f"the weights sum to {total:g}{where}; normalize divides by their sum, which must be "
                        f"non-zero (|sum| > {WEIGHT_SUM_EPS:g} x the sum of |weight|): change the weights or "
                        f"turn normalize off (--no-normalize)")


def compact_setting(value) -> str:
    """The request's compact mode from a keyword: None/True -> auto, False -> off, else the name given."""
    if value is None or value is True:
        return "auto"
    if value is False:
        return "off"
    return str(value).lower() if isinstance(value, str) else value


def check_seed(seed) -> int:
    """The seed as an int: an integer (or an integral number) in [0, 2**64 - 1]."""
    if isinstance(seed, bool):
        raise PlanError(f"seed must be an integer in [0, {MAX_SEED}], not {seed!r}")
    value = seed
    if not isinstance(seed, int):
        try:
            value = int(seed) if not isinstance(seed, float) or seed.is_integer() else None
        except (TypeError, ValueError, OverflowError):
            value = None
        if value is None:
            raise PlanError(f"seed must be an integer in [0, {MAX_SEED}], not {seed!r}")
    if not (0 <= value <= MAX_SEED):
        raise PlanError(f"seed {value} is outside the range [0, {MAX_SEED}] of seed")
    return value
