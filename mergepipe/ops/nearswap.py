"""NearSwap (mergekit's ``nearswap``): take the other model's value where it is near the base's.

Per entry, with a = base and b = the one other model: w = clamp(t / max(|a - b|, 1e-6), 0, 1),
out = w*b + (1-w)*a. Elementwise: no statistics, each block merged on its own, bit-equal to mergekit.
Budget: an omitted block keeps the base's values; every other block is merged (unchanged blocks with
b = a, unread). The additive error bound does not apply.
"""

from __future__ import annotations

from mergepipe.ops.slerp import T
from mergepipe.ops.spec import Consensus, OpSpec

SPECS = (OpSpec("nearswap", None, Consensus.NONE, False, False, extras=(T,), nonlinear=True, joint=True,
                common=(), min_experts=1, max_experts=1,
                reference="mergekit nearswap, https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001",
                budget_semantics="an omitted block keeps the base's values",
                bound_note="n/a: nearswap is elementwise non-linear"),)


def scalars(spec, gram, settings: dict, params: dict, ndim: int) -> list[float]:
    return [settings["t"]]


def block(spec, base, xs, scalars: list[float], params: dict, ndim: int):
    import torch
    a, b = base, xs[0]
    t = scalars[0]
    absdiff = torch.abs(a - b)
    weight = (t / absdiff.clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


METHODS = {"nearswap": (scalars, block)}
