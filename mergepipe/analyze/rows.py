"""The catalog rows ANALYZE writes per block and per tensor (analyze/stats.py), and the small lookups they use."""

from __future__ import annotations

import struct
from functools import lru_cache

import numpy as np

from mergepipe.analyze.thresholds import _density_ks, density_names
from mergepipe.storage.grid import BlockSpan, tensor_grid
from mergepipe.storage.safetensors import TensorInfo


@lru_cache(maxsize=256)
def density_table(densities: tuple, numel: int) -> tuple[np.ndarray, list[str]]:
    """(int(d * numel) per density, str(d) per density), in the densities' order."""
    pairs, _ = _density_ks(densities, numel, True)
    names = density_names(densities)
    ks = np.array([k for _, k in pairs], dtype=np.int64)
    ks.flags.writeable = False
    return ks, [names[d] for d, _ in pairs]


def block_row(expert_id: str, tensor: str, span: BlockSpan, rng, **stats) -> dict:
    row = {"model_id": expert_id, "tensor": tensor, "block": span.index, "row_start": span.row_start,
           "row_end": span.row_end, "offset": rng[1], "nbytes": rng[2], "delta_l2": 0.0, "delta_l1": 0.0,
           "delta_max_abs": 0.0, "delta_nnz": 0, "sketch": b"", "nonfinite": 0, "base_nonfinite": 0}
    row.update(stats)
    return row


_PACK_F32, _UNPACK_U32 = struct.Struct("<f").pack, struct.Struct("<I").unpack


def top_bin(value) -> int:
    """The top 16 bits of a finite non-negative value's float32 pattern."""
    return _UNPACK_U32(_PACK_F32(value))[0] >> 16  # value is a float32 (exact in "<f")


def zero_tensor(binfo: TensorInfo, block_bytes: int, expert_id: str):
    """Rows for a tensor the expert does not change (untargeted by a LoRA adapter): nothing to read."""
    rows = [{"model_id": expert_id, "tensor": binfo.name, "block": s.index, "row_start": s.row_start,
             "row_end": s.row_end, "offset": None, "nbytes": 0, "delta_l2": 0.0, "delta_l1": 0.0,
             "delta_max_abs": 0.0, "delta_nnz": 0, "sketch": b"", "nonfinite": 0, "base_nonfinite": 0}
            for s in tensor_grid(binfo, block_bytes)]
    stats = {"model_id": expert_id, "tensor": binfo.name, "numel": binfo.numel, "delta_l2": 0.0, "delta_l1": 0.0,
             "delta_max_abs": 0.0, "delta_nnz": 0, "thresholds": "{}", "topk": "{}", "fixed_bytes": 0, "nonfinite": 0,
             "base_nonfinite": 0}
    return rows, stats
