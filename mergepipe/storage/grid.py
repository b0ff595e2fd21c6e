"""The block grid: every tensor cut into contiguous row ranges of dim 0 (elements for 1-D tensors).

A block is a contiguous byte range of the tensor, so reading it is one positioned read. The grid is a
pure function of the tensor layout and ``block_bytes``; the catalog stores it per base model and
analyze, planner, engine and manifest all use that stored grid.
"""

from __future__ import annotations

from dataclasses import dataclass

from mergepipe.storage.safetensors import TensorInfo, n_rows, row_nbytes

DEFAULT_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class BlockSpan:
    """Rows [row_start, row_end) of a tensor; ``rel_offset`` is relative to the tensor's first byte."""

    index: int
    row_start: int
    row_end: int
    rel_offset: int
    nbytes: int


def tensor_grid(info: TensorInfo, block_bytes: int) -> list[BlockSpan]:
    """Cut one tensor into row-aligned blocks of about ``block_bytes`` (at least one row each)."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    rows = n_rows(info)
    rb = row_nbytes(info)
    if info.nbytes == 0 or rows == 0:
        return [BlockSpan(0, 0, rows, 0, info.nbytes)]
    per_block = max(1, block_bytes // rb)
    spans = []
    for i, start in enumerate(range(0, rows, per_block)):
        end = min(rows, start + per_block)
        spans.append(BlockSpan(i, start, end, start * rb, (end - start) * rb))
    return spans
