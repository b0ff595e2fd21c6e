"""Exact top-k masks shared by the magnitude-pruning families (ties, breadcrumbs): a block keeps the
entries above the tensor's threshold and, of those tied at it, the ones before the exact-k cut
(``ops.core.tensor_statistics`` derives the cut from ANALYZE's per-block tie counts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NO_CUT = (1 << 62, 0)  # an exact-k cut past every block: every entry tied at the threshold is kept


def top_mask(a: torch.Tensor, thr: float, cut_block: int, cut_rank: int, block: int) -> torch.Tensor:
    """Whether each entry of block ``block`` (|delta| ``a``) is in the tensor's top k: |d| > thr, or
    |d| == thr and, by the exact-k cut (ops.core.tensor_statistics), block < cut_block, or block ==
    cut_block and it is among the block's first ``cut_rank`` tied entries in C order."""
    import torch
    if block < cut_block:
        return a >= thr
    if block > cut_block:
        return a > thr
    tied = (a == thr).reshape(-1)
    first = tied & (torch.cumsum(tied, 0) <= cut_rank)
    return (a > thr) | first.reshape(a.shape)
