"""Passthrough (mergekit's ``passthrough``): each output tensor is one input tensor, copied, or times
``scale`` (mergekit's optional per-input ``scale``; a number, a gradient over the slice or filter
conditions). Used by ``slices:`` configs to stack, repeat and reorder layers (frankenmerges).

Which input tensor (model, name) each output tensor copies is the plan's ``layout`` (built from the
config by mergepipe/config/slices.py), with the scale resolved per output tensor. Passthrough reads
no expert delta: every output byte is a read of the input tensor it copies (the manifest's base read),
so there is nothing for a budget to choose and no error bound.
"""

from __future__ import annotations

from mergepipe.ops.spec import Consensus, OpSpec, Param

SCALE = Param("scale", 1.0, "passthrough: factor applied to a copied tensor (a number, a gradient over the slice or "
              "filter conditions; given per slice or per source in a `slices:` config)", gradient=True,
              label="scale", step=0.05)

SPECS = (OpSpec("passthrough", None, Consensus.NONE, False, False, extras=(SCALE,), nonlinear=True, common=(),
                joint=True, min_experts=0, copies=True,
                reference="mergekit passthrough (frankenmerges: layers stacked from `slices:`)",
                budget_semantics="reads no expert delta: each output tensor is a copy of one input tensor "
                                 "(times scale); the budget has nothing to choose",
                bound_note="n/a: passthrough copies (no delta is merged)"),)


def scalars(spec, gram, settings: dict, params: dict, ndim: int) -> list[float]:
    return []


def block(spec, base, xs, scalars: list[float], params: dict, ndim: int):
    """``base`` is the copied input tensor's block; ``scalars`` is [scale]."""
    return base * scalars[0]


METHODS = {"passthrough": (scalars, block)}
