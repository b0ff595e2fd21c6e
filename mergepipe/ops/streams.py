"""Block math shared by the operator families: per-block random streams (counter-based, independent of
traversal order) and the L1-preserving rescale of a sparsified delta.

The random stream, exactly (enough to re-derive it without this code; tests/oracle/reference.py does):

* Block seed: ``s = int.from_bytes(blake2b(f"{seed}|{content}|{tensor}|{block}".encode(),
  digest_size=8).digest(), "little") & (2**63 - 1)``, where ``seed`` is the plan's seed (decimal),
  ``content`` the expert block's content identity (:func:`content_id`: ``blake2b(digest_size=16)``
  over the raw bytes the engine reads for this expert block -- for a full or delta checkpoint the
  block's bytes of the expert tensor as stored; for a LoRA adapter the block's rows of B as stored --
  as lowercase hex), ``tensor`` the base tensor's name and ``block`` the block's index in the
  base's grid (rows of dim 0, elements of a 1-D tensor).

  Why the content and not the catalog id (MergePipe before issue 15) or the registered fingerprint:
  an id and a fingerprint (mtimes) are properties of one catalog, so the same YAML over the same
  files gave different bits in another catalog. The safetensors headers' digest is catalog-free but
  is the same for every fine-tune of one base layout, which would give all experts the same mask
  (correlated drops, unlike mergekit's independent draws). The block's own bytes are catalog-free,
  differ between experts wherever their deltas differ, need no extra read (the engine holds them) and
  keep the stream independent of traversal order. Two experts with identical bytes in a block get the
  same mask there (e.g. one model listed twice); the same files merged with the same seed and grid
  (block_bytes) give the same bits in any catalog.
* Keys: ``k1 = (s mod 2**32) | 1`` (odd), ``k2 = s >> 32``.
* Element ``i`` of the block (0-based, C order of the block's rows; the i-th element of the block's
  bytes), all arithmetic mod 2**32: ``x = (i mod 2**32) * k1 + k2 + (i >> 32) * 0x9E3779B9``, then
  mix32 (Chris Wellons' "lowbias32"): ``x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97;
  x ^= x >> 15``; the value is ``u = (x >> 8) * 2**-24``: a float32 in [0, 1), a multiple of 2**-24.
* DARE keeps element i iff ``u < float32(density)``; DELLA iff ``u < p`` with its keep probability ``p``
  computed in float32 (ops/della.py).

The L1 rescale of a block (DARE, DELLA, breadcrumbs with ``rescale``): ``kept * (||delta||_1 / ||kept||_1)`` when
both norms are >= 1e-8, else ``kept``; the norms are summed in float64 over the float32 values.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def content_id(bufs) -> str:
    """The content identity of one expert block: blake2b (16 bytes, hex) over its raw input buffers."""
    h = hashlib.blake2b(digest_size=16)
    for b in bufs:
        h.update(b)
    return h.hexdigest()


def block_seed(seed: int, expert: str, tensor: str, block: int) -> int:
    """Seed of the random stream for one (expert block content, tensor, block): independent of traversal
    order and of the catalog (see the module docstring)."""
    h = hashlib.blake2b(f"{seed}|{expert}|{tensor}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def uniform(seed: int, shape) -> torch.Tensor:
    """The random stream of one block: float32 in [0, 1), element i (C order) a hash of (seed, i)
    (counter-based, see kernel_loops._u01), so any part of it can be drawn without the rest: the fused
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

