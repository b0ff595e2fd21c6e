"""RAM and RAM+ (mergekit's ``ram`` and ``ramplus_tl``, Reinforced Agent Merging, arXiv 2601.13572).

Per entry, with task vectors v_i = x_i - base and nz_i = |v_i| > epsilon: an entry changed by one expert
only takes that expert's value; one changed by several takes their mean; out = base + that.
``ram`` is elementwise across the experts: each block is merged on its own, bit-equal to mergekit.
``ramplus_tl`` scales each expert's unique entries by lambda_i = 1 + r * clamp(rho_i, 0, alpha), with
rho_i = (entries of expert i shared with another) / (entries unique to it) over the whole tensor: those
two counts per (tensor, expert) come from ANALYZE, which counts them for the experts analyzed together at
mergekit's default epsilon 1e-5 (another epsilon, or a different set of experts than the one analyzed
together, is refused / re-analyzed by the config path).

Budget: a block is read for all experts or for none; an omitted block keeps the base's values.
The additive error bound does not apply.
"""

from __future__ import annotations

from mergepipe.errors import PlanError
from mergepipe.ops.spec import Consensus, OpSpec, Param

RAM_EPSILON = Param("epsilon", 1e-5, "ram: an entry counts as changed when |delta| > epsilon", low=0.0)
R = Param("r", 0.1, "ramplus_tl: strength of the boost of unique entries", low=0.0, step=0.01)
ALPHA = Param("alpha", 0.2, "ramplus_tl: cap of the shared/unique ratio", low=0.0, step=0.01)
COUNT_EPSILON = 1e-5  # the epsilon ANALYZE counts shared and unique entries at (mergekit's default)

_COMMON = dict(nonlinear=True, joint=True, common=(), min_experts=1,
               reference="RAM, Reinforced Agent Merging, https://arxiv.org/abs/2601.13572",
               budget_semantics="all experts' blocks are read or none; an omitted block keeps the base's values")
SPECS = (
    OpSpec("ram", None, Consensus.NONE, False, False, extras=(RAM_EPSILON,),
           bound_note="n/a: ram averages only the experts that changed each entry", **_COMMON),
    OpSpec("ramplus_tl", None, Consensus.NONE, False, False, extras=(R, ALPHA, RAM_EPSILON), gram=True,
           bound_note="n/a: ramplus_tl averages only the experts that changed each entry", **_COMMON),
)


def _masks(base, xs, epsilon: float):
    import torch
    task_vectors = torch.stack([x - base for x in xs], dim=0)
    tv_flat = task_vectors.view(len(xs), -1)
    nonzero_mask = tv_flat.abs() > epsilon
    contrib_counts = nonzero_mask.sum(dim=0, keepdim=True)
    return tv_flat, nonzero_mask, contrib_counts, contrib_counts > 1, contrib_counts == 1


def ram_scalars(spec, gram, settings: dict, params: dict, ndim: int) -> list[float]:
    return []


def ram_block(spec, base, xs, scalars: list[float], params: dict, ndim: int):
    tv_flat, nonzero_mask, contrib_counts, overlap_mask, unique_mask = _masks(base, xs, params["epsilon"])
    tv_flat_z = tv_flat * nonzero_mask
    merged = ((tv_flat_z * unique_mask) + (tv_flat_z * overlap_mask / contrib_counts.clamp(min=1))).sum(
        dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def check(params: dict) -> str | None:
    return None


def plus_scalars(spec, gram, settings: dict, params: dict, ndim: int) -> list[float]:
    """lambda_i per expert (float32), from ANALYZE's shared/unique counts."""
    import torch
    if abs(params["epsilon"] - COUNT_EPSILON) > 1e-15:
        raise PlanError(f"ramplus_tl needs per-tensor counts of shared and unique entries, which ANALYZE stores for "
                        f"epsilon {COUNT_EPSILON:g} only (mergekit's default): leave epsilon at {COUNT_EPSILON:g}")
    shared = torch.tensor(settings["ram_counts"][0], dtype=torch.int64)
    unique = torch.tensor(settings["ram_counts"][1], dtype=torch.int64)
    rho = shared / unique.clamp(min=params["epsilon"])
    lambda_ = 1 + params["r"] * rho.clamp(min=0, max=params["alpha"])
    return [float(v) for v in lambda_]


def plus_block(spec, base, xs, scalars: list[float], params: dict, ndim: int):
    import torch
    tv_flat, nonzero_mask, contrib_counts, overlap_mask, unique_mask = _masks(base, xs, params["epsilon"])
    lambda_ = torch.tensor(scalars, dtype=torch.float32)
    tv_flat_z = tv_flat * nonzero_mask
    merged = ((tv_flat_z * unique_mask * lambda_.unsqueeze(-1))
              + (tv_flat_z * overlap_mask / contrib_counts.clamp(min=1))).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


METHODS = {"ram": (ram_scalars, ram_block), "ramplus_tl": (plus_scalars, plus_block)}
