"""What an operator is: an :class:`OpSpec` declared by name with its parameters and defaults, and the
registry ``OPERATORS`` that the operator families (linear, ties, dare, breadcrumbs, della) add to."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpSpec:
    name: str
    sparsify: str | None  # None | "magnitude" | "random" | "magnitude_outliers" | "della"
    consensus: bool
    normalize: bool
    rescale: bool
    aliases: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)  # extra global parameters with defaults
    whole_models: bool = False  # linear: averages x_i, not base + deltas

    @property
    def additive(self) -> bool:
        """Fixed-coefficient additive operators: the planner's error bound holds for these."""
        return self.sparsify is None and not self.consensus

    @property
    def random(self) -> bool:
        return self.sparsify in ("random", "della")

    @property
    def uses_density(self) -> bool:
        return self.sparsify is not None


OPERATORS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    OPERATORS[spec.name] = spec
    return spec
