"""Helpers for the numeric-guard tests (issue 14): small families with NaN/Inf planted at known
elements, and where a planted element falls on the block grid."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import open_checkpoint

BLOCK = 4096
TENSOR = "model.layers.0.mlp.down_proj.weight"  # [64, 128]: several 4 KiB blocks in every dtype


def small_family(root: Path, dtype: str, experts: int = 2) -> dict:
    """A tiny single-file family (base + ``experts``), copied so that a test may modify it."""
    return make_family(Path(root), experts=experts, size="tiny", dtype=dtype, shard_bytes=1 << 30, seed=0)


def plant(model_dir: str | Path, tensor: str, values: dict[int, float]) -> None:
    """Set flat elements of one tensor of a single-file checkpoint (layout and other bytes unchanged)."""
    f = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(f))
    t = tensors[tensor]
    flat = t.reshape(-1).clone()
    for i, v in values.items():
        flat[i] = v
    tensors[tensor] = flat.reshape(t.shape)
    save_file(tensors, str(f), metadata={"format": "pt"})


def scale_tensor(model_dir: str | Path, tensor: str, factor: float) -> None:
    f = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(f))
    tensors[tensor] = (tensors[tensor].float() * factor).to(tensors[tensor].dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})


def copy_model(src: str | Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def block_of(model_dir: str | Path, tensor: str, element: int, block_bytes: int = BLOCK) -> int:
    """The grid block that holds a flat element of a tensor."""
    info = open_checkpoint(str(model_dir)).tensors[tensor]
    off = element * (info.nbytes // info.numel)
    return next(s.index for s in tensor_grid(info, block_bytes) if s.rel_offset <= off < s.rel_offset + s.nbytes)


def registered(path: Path, fam: dict, ids=None) -> Catalog:
    """A catalog with the family registered as base, e1, e2, ... (nothing analyzed)."""
    cat = Catalog(path)
    register(cat, "base", fam["base"])
    for i, e in enumerate(fam["experts"], start=1):
        register(cat, (ids or {}).get(i, f"e{i}"), e, base_id="base")
    return cat


def per_block(cat: Catalog, model_id: str, tensor: str = TENSOR) -> dict[int, tuple[int, int]]:
    """block -> (nonfinite, base_nonfinite) of the blocks that hold any."""
    return {r["block"]: (r["nonfinite"], r["base_nonfinite"]) for r in cat.query(
        "SELECT block, nonfinite, base_nonfinite FROM blocks WHERE model_id = ? AND tensor = ? AND nonfinite > 0",
        [model_id, tensor])}


INF, NAN = float("inf"), float("nan")
__all__ = ["BLOCK", "TENSOR", "INF", "NAN", "small_family", "plant", "scale_tensor", "copy_model", "block_of",
           "registered", "per_block", "torch"]
