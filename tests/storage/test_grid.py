"""Block grid: row-aligned blocks covering each tensor exactly once on a byte target; the grid the
catalog stores is exactly tensor_grid of the base layout."""

from __future__ import annotations

import math

import pytest

from conftest import ANALYZE_BLOCK_BYTES
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES, tensor_grid
from mergepipe.storage.safetensors import TensorInfo, open_checkpoint, row_nbytes


def _check_grid(info: TensorInfo, block_bytes: int):
    spans = tensor_grid(info, block_bytes)
    rb = row_nbytes(info)
    rows = info.shape[0] if info.shape else 1
    assert [s.index for s in spans] == list(range(len(spans)))
    # contiguous, in order, covering [0, rows) exactly once
    assert spans[0].row_start == 0 and spans[-1].row_end == rows
    for a, b in zip(spans, spans[1:]):
        assert a.row_end == b.row_start
    for s in spans:
        assert s.row_end > s.row_start
        assert s.rel_offset == s.row_start * rb
        assert s.nbytes == (s.row_end - s.row_start) * rb
    # byte ranges tile the tensor: offsets are consecutive and sum to nbytes
    assert sum(s.nbytes for s in spans) == info.nbytes
    for a, b in zip(spans, spans[1:]):
        assert a.rel_offset + a.nbytes == b.rel_offset
    # byte target honoured: every block holds as many whole rows as fit (at least one row);
    # only the last block may be smaller
    per_block = max(1, block_bytes // rb)
    for s in spans[:-1]:
        assert s.row_end - s.row_start == per_block
        assert s.nbytes <= max(block_bytes, rb)
        assert s.nbytes > block_bytes - rb
    assert 0 < spans[-1].row_end - spans[-1].row_start <= per_block
    assert len(spans) == math.ceil(rows / per_block)
    return spans


@pytest.mark.parametrize("block_bytes", [1, 100, 1000, 4096, 65536, DEFAULT_BLOCK_BYTES])
def test_family_tensors(families, block_bytes):
    n_split = 0
    for name in ("fp32-sharded", "bf16-sharded"):
        ck = open_checkpoint(families[name].base)
        for info in ck.tensors.values():
            spans = _check_grid(info, block_bytes)
            n_split += len(spans) > 1
    if block_bytes <= 4096:
        assert n_split > 0


def test_matrix_rows_example():
    info = TensorInfo("w", "F32", (10, 100), "f", 0, 4000)  # 400-byte rows
    spans = tensor_grid(info, 1000)  # 2 rows per block
    assert [(s.row_start, s.row_end, s.rel_offset, s.nbytes) for s in spans] == [
        (0, 2, 0, 800), (2, 4, 800, 800), (4, 6, 1600, 800), (6, 8, 2400, 800), (8, 10, 3200, 800)]


def test_one_d_split_by_elements():
    info = TensorInfo("v", "F32", (1000,), "f", 0, 4000)
    spans = _check_grid(info, 256)  # 64 elements per block
    assert len(spans) == 16
    assert [(s.row_start, s.row_end) for s in spans[:2]] == [(0, 64), (64, 128)]
    assert (spans[-1].row_start, spans[-1].row_end, spans[-1].nbytes) == (960, 1000, 160)
    bf = TensorInfo("v", "BF16", (1000,), "f", 0, 2000)
    assert [s.nbytes for s in tensor_grid(bf, 500)] == [500, 500, 500, 500]


def test_rows_larger_than_target_make_one_row_blocks():
    info = TensorInfo("w", "F32", (5, 1024), "f", 0, 5 * 4096)
    spans = _check_grid(info, 1000)
    assert [(s.row_start, s.row_end, s.nbytes) for s in spans] == [(i, i + 1, 4096) for i in range(5)]


def test_3d_tensor_rows_are_dim0():
    info = TensorInfo("w", "F16", (6, 4, 8), "f", 0, 6 * 64)  # 64-byte rows
    spans = _check_grid(info, 200)  # 3 rows per block
    assert [(s.row_start, s.row_end, s.rel_offset) for s in spans] == [(0, 3, 0), (3, 6, 192)]


def test_whole_tensor_fits_one_block():
    info = TensorInfo("w", "BF16", (64, 64), "f", 0, 8192)
    spans = _check_grid(info, DEFAULT_BLOCK_BYTES)
    assert len(spans) == 1 and spans[0].nbytes == 8192


def test_degenerate_tensors():
    scalar = TensorInfo("s", "F32", (), "f", 0, 4)
    assert [(s.row_start, s.row_end, s.nbytes) for s in tensor_grid(scalar, 1)] == [(0, 1, 4)]
    empty = TensorInfo("e", "F32", (0, 8), "f", 0, 0)
    assert [(s.row_start, s.row_end, s.nbytes) for s in tensor_grid(empty, 1024)] == [(0, 0, 0)]


@pytest.mark.parametrize("bad", [0, -1])
def test_block_bytes_must_be_positive(bad):
    with pytest.raises(ValueError):
        tensor_grid(TensorInfo("v", "F32", (4,), "f", 0, 16), bad)


def test_catalog_stores_the_grid(analyzed, families):
    """analyze stores tensor_grid(base tensor, block_bytes) for every expert, with absolute offsets."""
    for name, cat in analyzed.items():
        assert cat.grid_block_bytes("base") == ANALYZE_BLOCK_BYTES
        ck = open_checkpoint(families[name].experts[0])
        base_ck = open_checkpoint(families[name].base)
        rows = cat.blocks("expert_1")
        by_tensor: dict[str, list[dict]] = {}
        for r in rows:
            by_tensor.setdefault(r["tensor"], []).append(r)
        assert set(by_tensor) == set(ck.tensors)
        n = 0
        for tname, info in ck.tensors.items():
            spans = tensor_grid(base_ck.tensors[tname], ANALYZE_BLOCK_BYTES)
            got = [(r["block"], r["row_start"], r["row_end"], r["offset"], r["nbytes"]) for r in by_tensor[tname]]
            want = [(s.index, s.row_start, s.row_end, info.offset + s.rel_offset, s.nbytes) for s in spans]
            assert got == want, tname
            n += len(spans)
        grid = cat.query("SELECT * FROM grids WHERE base_id='base'")[0]
        assert grid["n_blocks"] == n == len(rows)
        assert cat.analysis("expert_1")["n_blocks"] == n
        # every expert of the base uses the same grid (same rows, same row ranges)
        other = [(r["tensor"], r["block"], r["row_start"], r["row_end"], r["nbytes"]) for r in cat.blocks("expert_2")]
        assert other == [(r["tensor"], r["block"], r["row_start"], r["row_end"], r["nbytes"]) for r in rows]
