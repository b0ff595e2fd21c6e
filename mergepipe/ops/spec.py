"""What an operator is: an :class:`OpSpec` that declares its name, aliases, reference, how it sparsifies
and combines (enums, not strings), and its parameters (:class:`Param`: default, range, help, whether
they may vary per tensor), plus the registry ``OPERATORS`` that the operator families (linear, ties,
dare, breadcrumbs, della) add to.

The command line's flags and help, the YAML config's checks and the dashboard's Plan page widgets are
generated from these declarations. What adding an operator touches (CONTRIBUTING.md, "add an operator"):
one module for a new combination within an existing family (its ``OpSpec`` in that family's ``SPECS``);
two for a new family (``ops/<family>.py``, and ``ops/core.py``: its import and ``FAMILIES``); four with a
new kind of sparsification (also a :class:`Sparsify` member here and the full-read reference in
``research/baselines.py``); an interpolation method with statistics of its own also touches ANALYZE, the
catalog and the planner.
Nothing here imports torch or numpy (planning, EXPLAIN and ``--help`` read the declarations).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Sparsify(str, enum.Enum):
    """How each expert's delta is sparsified before combining (``None`` on a spec: not at all).

    A ``str`` enum: a member compares equal to its value (``Sparsify.MAGNITUDE == "magnitude"``)."""

    MAGNITUDE = "magnitude"  # keep the top-density magnitudes (per-tensor threshold from the catalog)
    RANDOM = "random"  # DARE: keep each entry with probability density
    OUTLIERS = "magnitude_outliers"  # breadcrumbs: drop the top gamma and the smallest magnitudes
    DELLA = "della"  # MAGPRUNE: keep probability rising with magnitude rank

    @property
    def thresholded(self) -> bool:
        """Needs per-tensor magnitude thresholds from the catalog (ANALYZE)."""
        return self in (Sparsify.MAGNITUDE, Sparsify.OUTLIERS)

    @property
    def random(self) -> bool:
        return self in (Sparsify.RANDOM, Sparsify.DELLA)

    def __str__(self) -> str:
        return self.value


class Consensus(enum.Enum):
    """Whether signs are elected before combining (TIES' sign consensus)."""

    NONE = "none"
    SIGN = "sign"

    def __bool__(self) -> bool:
        return self is Consensus.SIGN


@dataclass(frozen=True)
class Param:
    """One declared operator parameter.

    ``low``/``high`` bound a number (``low_open``: the low end is excluded); ``per_tensor``: it may be
    a mergekit setting that varies per tensor (gradient, filter conditions) and per expert; ``flag``,
    ``dest`` and ``nargs`` spell the command-line option when it differs from ``--name``."""

    name: str
    default: float | bool
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    per_tensor: bool = False
    flag: str | None = None
    dest: str | None = None
    nargs: str | None = None
    # the dashboard's widget: label, starting value and lowest value when they differ from the
    # declaration, step, and the decimals a value is rounded to
    label: str = ""
    page_default: float | None = None
    page_low: float | None = None
    step: float = 0.1
    decimals: int | None = None
    # a merge-wide value that may be a mergekit gradient or filter list (slerp's t): one value per tensor,
    # the same for every model; ``required``: mergekit gives it no default (the merge must set it)
    gradient: bool = False
    required: bool = False

    @property
    def kind(self) -> type:
        return bool if isinstance(self.default, bool) else float

    @property
    def option(self) -> str:
        return self.flag or f"--{self.name}"

    @property
    def key(self) -> str:
        """The keyword of this parameter in a MergeRequest / the planner (``lambda`` -> ``lam``)."""
        return self.dest or self.name

    def range_text(self) -> str:
        if self.low is None and self.high is None:
            return ""
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open else '['}{lo}, {hi}]"

    def in_range(self, value: float) -> bool:
        if self.kind is bool:
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value <= self.high

    def check(self, value, where: str | None = None, error: type[Exception] | None = None) -> float:
        """``value`` if it is within the declared range, else ``error`` naming the range."""
        if error is None:
            from mergepipe.errors import PlanError
            error = PlanError
        if not self.in_range(value):
            if not self.range_text():
                raise error(f"{where or self.name} must be a finite number, not {value:g}")
            raise error(f"{where or self.name} {value:g} is outside the range {self.range_text()} of {self.name}")
        return value


# The parameters every operator has (their defaults per operator: normalize and rescale come from the
# spec; density only where the operator sparsifies).
WEIGHT = Param("weight", 1.0, "each expert's weight, one per expert in order", per_tensor=True, flag="--weights",
               dest="weights", nargs="+")
DENSITY = Param("density", 1.0, "fraction of each delta kept by the sparsifying operators", low=0.0, high=1.0,
                low_open=True, per_tensor=True, label="Density", page_default=0.5, page_low=0.01, step=0.01,
                decimals=2)
LAMBDA = Param("lambda", 1.0, "scale of the merged delta", dest="lam")
GAMMA = Param("gamma", 0.01, "breadcrumbs: fraction of largest magnitudes dropped", low=0.0, high=1.0,
              label="gamma (largest magnitudes dropped)", step=0.01)
EPSILON = Param("epsilon", 0.15, "della: spread of keep probabilities around the density", low=0.0, high=0.5,
                label="epsilon (spread of keep probabilities)", step=0.01)


def _flag_param(name: str, default: bool, text: str) -> Param:
    return Param(name, default, text)


@dataclass(frozen=True)
class OpSpec:
    name: str
    sparsify: Sparsify | None  # None: the deltas are used as they are
    consensus: Consensus
    normalize: bool  # default of the normalize parameter
    rescale: bool  # default of the rescale parameter
    aliases: tuple[str, ...] = ()
    extras: tuple[Param, ...] = ()  # parameters beyond the common ones (gamma, epsilon)
    whole_models: bool = False  # linear: averages x_i, not base + deltas
    # mergekit merges without a base_model (its base is ignored): a model soup, planned against a
    # reference model (config/soup.py) that is itself averaged in (MergeRequest.base_member)
    base_optional: bool = False
    reference: str = ""  # the paper or page the operator follows
    # --- the interpolation methods (ops/slerp.py, nuslerp.py, model_stock.py, ...): not additive ---
    nonlinear: bool = False  # output not base + fixed coefficients x deltas: no error bound, own block kernel
    joint: bool = False  # a block is read for every expert or for none (the planner selects groups)
    gram: bool = False  # needs the per-tensor Gram statistics of ANALYZE (norms and pairwise dots)
    common: tuple[str, ...] | None = None  # the common parameters it takes (None: all of them)
    min_experts: int = 1
    max_experts: int | None = None
    copies: bool = False  # passthrough: reads no delta, each output tensor copies one input (plan ``layout``)
    budget_semantics: str = ""  # what an omitted block means (EXPLAIN, README)
    bound_note: str = ""  # why the error bound does not apply (EXPLAIN)

    @property
    def params(self) -> dict:
        """The extra parameters' defaults, by name."""
        return {p.name: p.default for p in self.extras}

    @property
    def parameters(self) -> tuple[Param, ...]:
        """Every parameter this operator takes, with this operator's defaults."""
        common = [WEIGHT] + ([DENSITY] if self.uses_density else []) + [
            LAMBDA,
            _flag_param("normalize", self.normalize, "divide by the sum of the weights"),
            _flag_param("rescale", self.rescale, "rescale the kept entries to the L1 norm of the delta (per tensor for TIES, per block otherwise)"),
        ]
        if self.common is not None:
            common = [p for p in common if p.name in self.common]
        return tuple(common) + self.extras

    @property
    def additive(self) -> bool:
        """Fixed-coefficient additive operators: the planner's error bound holds for these."""
        return self.sparsify is None and not self.consensus and not self.nonlinear

    @property
    def random(self) -> bool:
        return self.sparsify is not None and self.sparsify.random

    @property
    def uses_density(self) -> bool:
        return self.sparsify is not None

    @property
    def thresholded(self) -> bool:
        return self.sparsify is not None and self.sparsify.thresholded


OPERATORS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    OPERATORS[spec.name] = spec
    return spec


def all_parameters() -> tuple[Param, ...]:
    """Every parameter any registered operator declares, once each, in declaration order."""
    seen: dict[str, Param] = {}
    for p in (WEIGHT, DENSITY, LAMBDA, _flag_param("normalize", False, "divide by the sum of the weights"),
              _flag_param("rescale", False, "rescale the kept entries to the L1 norm of the delta (per tensor for TIES, per block otherwise)")):
        seen[p.name] = p
    for spec in OPERATORS.values():
        for p in spec.extras:
            seen.setdefault(p.name, p)
    return tuple(seen.values())


def operators_of(name: str) -> list[str]:
    """The operators that take parameter ``name``."""
    return [s.name for s in OPERATORS.values() if any(p.name == name for p in s.parameters)]
