"""Block math shared by the operator families: per-block random streams (counter-based, independent of
traversal order) and the L1-preserving rescale of a sparsified delta."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def block_seed(seed: int, expert: int, tensor: str, block: int) -> int:
    """Seed of the random stream for one (expert, tensor, block): independent of traversal order."""
    h = hashlib.blake2b(f"{seed}|{expert}|{tensor}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def uniform(seed: int, shape) -> torch.Tensor:
    """The random stream of one block: float32 in [0, 1), element i (C order) a hash of (seed, i)
    (counter-based, see kernels._u01), so any part of it can be drawn without the rest: the fused
    kernel draws it element by element, the torch path and the reference as whole blocks."""
    import torch

    from mergepipe.ops import kernels  # numba: imported on first use, not by every importer of ops (planner, CLI)
    shape = tuple(shape)
    n = 1
    for s in shape:
        n *= s
    return torch.from_numpy(kernels.uniform_array(seed, n)).reshape(shape)


def _abs_sum64(t: torch.Tensor) -> float:
    from mergepipe.ops import kernels
    return kernels.abs_sum64(t.detach().contiguous().reshape(-1).float().numpy())


def l1_ratio(original: torch.Tensor, kept: torch.Tensor) -> float | None:
    """||original||_1 / ||kept||_1, summed in float64 in a fixed order (kernels.abs_sum64), so the
    torch path, the fused kernel and the reference get the same bits."""
    org, new = _abs_sum64(original), _abs_sum64(kept)
    return org / new if org >= 1e-8 and new >= 1e-8 else None


def l1_rescale(original: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    ratio = l1_ratio(original, kept)
    return kept if ratio is None else kept * ratio

