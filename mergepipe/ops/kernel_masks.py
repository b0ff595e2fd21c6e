"""The keep masks of breadcrumbs (``magnitude_outliers``) and DELLA (MAGPRUNE) for the fused kernel, in numpy.

The fused kernel (``kernel_loops.merge_block``) applies a mask it is given (kind MASKED) with the operations
of the torch path: ``delta * mask``, times the block's L1 ratio when rescaling, times the weight. The masks
are the torch path's, computed the same way on the same float32 values:

* breadcrumbs (``ops/breadcrumbs.outliers``): the entries ranked [k_hi, k_lo) of the tensor's exact magnitude
  order, from the catalog's two thresholds and exact-k cuts (``ops/topk.top_mask``, ties by flat index);
* DELLA (``ops/della.della_block``): per row, the stable rank of |delta|, the keep probability
  ``(density - epsilon) + rank / (n - 1) * 2 * epsilon`` in float32, kept where the block's random stream
  (``kernels.uniform_array``) is below it.

The L1 ratio is ``ops.streams.l1_ratio``'s: both sums by ``kernels.abs_sum64`` (float64, fixed lane order).
"""

from __future__ import annotations

import numpy as np

from mergepipe.ops.kernel_loops import _abs_sum64, _fill_uniform, seed_keys
from mergepipe.ops.spec import Sparsify
from mergepipe.ops.topk import NO_CUT

MASKED_SPARSIFY = (Sparsify.OUTLIERS, Sparsify.DELLA)


def floats(raw, code: str) -> np.ndarray:
    """A raw bf16 or fp32 block as a new (writable) array of float32 values (bf16 widened exactly)."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if code == "BF16":
        bits = data.view(np.uint16) if data.ctypes.data % 2 == 0 else data.copy().view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return data.copy().view(np.float32)


def _top(a: np.ndarray, thr: float, cut_block: int, cut_rank: int, block: int) -> np.ndarray:
    """ops.topk.top_mask on a flat float32 block."""
    thr = np.float32(thr)
    if block < cut_block:
        return a >= thr
    if block > cut_block:
        return a > thr
    tied = a == thr
    return (a > thr) | (tied & (np.cumsum(tied) <= cut_rank))


def outliers_mask(delta: np.ndarray, thresholds: list, block: int) -> np.ndarray:
    """breadcrumbs' kept entries: in the top k_lo and not in the top k_hi (ops/breadcrumbs.outliers)."""
    a = np.abs(delta)
    cuts = thresholds[2:6] if len(thresholds) > 5 else [*NO_CUT, *NO_CUT]
    return _top(a, thresholds[1], int(cuts[2]), int(cuts[3]), block) & \
        ~_top(a, thresholds[0], int(cuts[0]), int(cuts[1]), block)


def della_mask(delta: np.ndarray, row: int, density: float, epsilon: float, seed: int) -> np.ndarray:
    """DELLA's kept entries of a block of rows of ``row`` entries (ops/della.della_block)."""
    rows = delta.reshape(-1, row)
    u = np.empty(delta.size, np.float32)  # the block's random stream (kernels.uniform_array)
    _fill_uniform(u, *seed_keys(seed))
    u = u.reshape(rows.shape)
    if row <= 1:
        p = np.full(rows.shape, np.float32(density), np.float32)
    else:
        order = np.argsort(np.abs(rows), axis=1, kind="stable")
        ranks = np.empty(rows.shape, np.float32)
        np.put_along_axis(ranks, order, np.broadcast_to(np.arange(row, dtype=np.float32), rows.shape), axis=1)
        rank_norm = np.clip(ranks / np.float32(row - 1), np.float32(0), np.float32(1))
        p = np.float32(density - epsilon) + rank_norm * np.float32(2) * np.float32(epsilon)
    return (u < p).reshape(-1)


def keep_mask(kind, delta: np.ndarray, density: float, params: dict, thresholds: list, seed: int, block: int,
              row: int) -> tuple[np.ndarray, float | None] | None:
    """(the keep mask, the block's L1 ratio when the operator rescales, else None) of one expert's delta
    block; None when the catalog statistics the operator needs are missing (then the torch path)."""
    if kind is Sparsify.OUTLIERS:
        if len(thresholds) < 2:
            return None
        mask = outliers_mask(delta, thresholds, block)
    else:
        mask = della_mask(delta, row, density, params["epsilon"], seed)
    if not params["rescale"]:
        return mask, None
    org, new = float(_abs_sum64(delta)), float(_abs_sum64(delta * mask))  # as kernels.abs_sum64
    return mask, (org / new if org >= 1e-8 and new >= 1e-8 else None)
