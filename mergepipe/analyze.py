"""ANALYZE: one sequential pass over base and expert computing per-block statistics of the delta.

Per block of delta = expert - base: L2 and L1 norms, max |delta|, non-zero count and a sketch
(see sketch.py). Per (expert, tensor): the same totals and exact top-k magnitude thresholds for a
grid of densities (what TIES/breadcrumbs need), so a budgeted merge never reads a whole tensor to
learn them. Thresholds are found by a radix select on the float32 bit pattern of |delta|: pass one
histograms the top 16 bits; pass two histograms the low 16 bits of only the bins that hold a k-th largest
(from memory for small tensors, otherwise re-read from the page cache the first pass just filled).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .catalog import Catalog, now
from .errors import CatalogError
from .grid import DEFAULT_BLOCK_BYTES, BlockSpan, tensor_grid
from .registry import check_unchanged
from .sketch import DEFAULT_SKETCH_SIZE, make_sketch
from .sources import open_source
from .storage import FLOAT_DTYPES, RangeReader, TensorInfo, open_checkpoint

# Top-k fractions with stored thresholds: every percent, plus two below 1 %.
DEFAULT_DENSITIES = (0.001, 0.005) + tuple(round(i / 100, 2) for i in range(1, 100))
IN_MEMORY_TENSOR_BYTES = 64 << 20
HIST_BINS = 1 << 15

Progress = Callable[[str, int, int], None]


@dataclass
class AnalyzeResult:
    model_id: str
    skipped: bool
    bytes_read: int = 0
    seconds: float = 0.0
    n_blocks: int = 0


class BinSelection:
    """Low 16 bits of the entries that fall in a few top-16 bins, keyed ``slot << 16 | low``.

    Few entries (small tensors): kept as sorted keys. Many: counted in a dense [slots, 65536]
    histogram, allocated only once the entries outnumber its cells, so small tensors never pay for it.
    """

    def __init__(self, n_slots: int):
        self.cells = n_slots * 65536
        self.pending: list[torch.Tensor] = []
        self.pending_n = 0
        self.dense: torch.Tensor | None = None
        self.sorted: torch.Tensor | None = None
        self._desc: dict[int, torch.Tensor] = {}

    def add(self, keys: torch.Tensor) -> None:
        self.pending.append(keys)
        self.pending_n += keys.numel()
        if self.pending_n >= self.cells:
            self._flush()

    def _flush(self) -> None:
        if self.dense is None:
            self.dense = torch.zeros(self.cells, dtype=torch.int64)
        if self.pending:
            self.dense += torch.bincount(torch.cat(self.pending), minlength=self.cells)
        self.pending, self.pending_n = [], 0

    def finish(self) -> "BinSelection":
        if self.dense is not None:
            self._flush()
        else:
            keys = torch.cat(self.pending) if self.pending else torch.zeros(0, dtype=torch.int64)
            self.sorted = keys.sort().values
            self.pending = []
        return self

    def kth_low_bits(self, slot: int, rank: int) -> int:
        """The low 16 bits of the rank-th largest entry (1-based) within ``slot``."""
        if self.sorted is not None:
            end = int(torch.searchsorted(self.sorted, torch.tensor((slot + 1) << 16)))
            return int(self.sorted[end - rank]) & 0xFFFF
        if slot not in self._desc:
            self._desc[slot] = self.dense[slot * 65536:(slot + 1) * 65536].flip(0).cumsum(0)
        return 65535 - int(torch.searchsorted(self._desc[slot], torch.tensor(rank)))


def kth_largest_thresholds(hist: torch.Tensor, numel: int, nnz: int, densities, select) -> dict[float, float]:
    """Exact k-th largest |delta| for k = int(d * numel), d in ``densities``, by radix select.

    ``hist`` counts the top 16 bits of |delta|'s float32 pattern; ``select(bins)`` returns a
    :class:`BinSelection` of the entries in those top-16 bins (a second pass over the tensor).
    """
    desc = hist.flip(0).cumsum(0)  # desc[j] = entries in the top j+1 bins
    wanted: dict[float, tuple[int, int]] = {}
    for d in densities:
        k = int(d * numel)
        if 0 < k <= nnz:
            j = int(torch.searchsorted(desc, torch.tensor(k)))
            above = int(desc[j - 1]) if j > 0 else 0
            wanted[d] = (HIST_BINS - 1 - j, k - above)
    bins = sorted({b for b, _ in wanted.values()})
    selection = select(bins) if bins else None
    out = {}
    for d in densities:
        k = int(d * numel)
        if k <= 0:
            out[d] = float("inf")  # keep nothing
        elif d not in wanted:
            out[d] = 0.0  # fewer non-zeros than k: every non-zero entry is kept
        else:
            b, rank = wanted[d]
            lo = selection.kth_low_bits(bins.index(b), rank)
            bits = torch.tensor([(b << 16) | lo], dtype=torch.int32)
            out[d] = float(bits.view(torch.float32)[0])
    return out


def analyze_expert(
    catalog: Catalog,
    expert_id: str,
    block_bytes: int | None = None,
    sketch_size: int = DEFAULT_SKETCH_SIZE,
    densities=DEFAULT_DENSITIES,
    force: bool = False,
    progress: Progress | None = None,
) -> AnalyzeResult:
    """Analyze one expert against its base; skipped when nothing it depends on changed."""
    expert = catalog.model(expert_id)
    if not expert["base_id"]:
        raise CatalogError(f"{expert_id} has no base; register it with --base to analyze it")
    base = catalog.model(expert["base_id"])
    grid_bytes = catalog.grid_block_bytes(base["id"])
    if block_bytes is None:
        block_bytes = grid_bytes or DEFAULT_BLOCK_BYTES
    if block_bytes <= 0:
        raise CatalogError("--block-bytes must be positive")
    densities = tuple(sorted(set(float(d) for d in densities)))
    # Headers only: a model whose files changed since registration must never be skipped as unchanged.
    check_unchanged(base)
    check_unchanged(expert)
    prev = catalog.analysis(expert_id)
    if (
        not force and prev and grid_bytes == block_bytes and catalog.is_analyzed(expert_id)
        and prev["sketch_size"] == sketch_size and set(json.loads(prev["densities"])) >= set(densities)
    ):
        return AnalyzeResult(expert_id, skipped=True)

    base_ck = open_checkpoint(base["uri"])
    source = open_source(expert["kind"], expert["uri"])
    t0 = time.perf_counter()
    block_rows, stat_rows = [], []
    with RangeReader(base_ck, sequential=True) as rb, RangeReader(source.checkpoint, sequential=True) as re_:
        # in the order of the expert's bytes, so the pass over its files is sequential
        order = sorted(base_ck.tensors.values(), key=lambda t: _read_position(source, t))
        total = sum(t.nbytes for t in order)
        done = 0

        def one(binfo):
            if not source.has_delta(binfo.name):
                return _zero_tensor(binfo, block_bytes, expert_id)
            return _analyze_tensor(rb, re_, source, binfo, block_bytes, sketch_size, densities, expert_id)

        # Tensors are analyzed on a small pool of single-threaded workers (one per core).
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                initializer=torch.set_num_threads, initargs=(1,)) as pool:
            results = pool.map(one, order)
            for binfo, (blocks, stats) in zip(order, results):
                block_rows += blocks
                stat_rows.append(stats)
                done += binfo.nbytes
                if progress:
                    progress(expert_id, done, total)
        bytes_read = rb.bytes_read + re_.bytes_read
    seconds = time.perf_counter() - t0
    with catalog.transaction():
        if grid_bytes != block_bytes:
            catalog.db["grids"].upsert(
                {"base_id": base["id"], "block_bytes": block_bytes, "n_blocks": len(block_rows),
                 "created_at": now()}, pk="base_id")
        for table in ("blocks", "tensor_stats"):
            catalog.conn.execute(f"DELETE FROM {table} WHERE model_id = ?", [expert_id])
        catalog.db["blocks"].insert_all(block_rows, batch_size=2000)
        catalog.db["tensor_stats"].insert_all(stat_rows, batch_size=2000)
        catalog.db["analyses"].upsert(
            {"model_id": expert_id, "base_id": base["id"], "fingerprint": expert["fingerprint"],
             "base_fingerprint": base["fingerprint"], "block_bytes": block_bytes, "sketch_size": sketch_size,
             "densities": json.dumps(list(densities)), "n_blocks": len(block_rows), "bytes_read": bytes_read,
             "seconds": round(seconds, 4), "analyzed_at": now()}, pk="model_id")
    return AnalyzeResult(expert_id, False, bytes_read, seconds, len(block_rows))


def _read_position(source, binfo: TensorInfo):
    """Where a tensor's delta starts in the expert's files (tensors without a delta go last)."""
    if not source.has_delta(binfo.name):
        return (1, "", 0)
    fname, offset, _ = source.block_ranges(binfo.name, tensor_grid(binfo, 1 << 62)[0])[0]
    return (0, fname, offset)


def _zero_tensor(binfo: TensorInfo, block_bytes: int, expert_id: str):
    """Rows for a tensor the expert does not change (untargeted by a LoRA adapter): nothing to read."""
    rows = [{"model_id": expert_id, "tensor": binfo.name, "block": s.index, "row_start": s.row_start,
             "row_end": s.row_end, "offset": None, "nbytes": 0, "delta_l2": 0.0, "delta_l1": 0.0,
             "delta_max_abs": 0.0, "delta_nnz": 0, "sketch": b""} for s in tensor_grid(binfo, block_bytes)]
    stats = {"model_id": expert_id, "tensor": binfo.name, "numel": binfo.numel, "delta_l2": 0.0, "delta_l1": 0.0,
             "delta_max_abs": 0.0, "delta_nnz": 0, "thresholds": "{}", "fixed_bytes": 0}
    return rows, stats


def _analyze_tensor(rb: RangeReader, re_: RangeReader, source, binfo: TensorInfo,
                    block_bytes: int, sketch_size: int, densities, expert_id: str):
    spans = tensor_grid(binfo, block_bytes)
    is_float = binfo.dtype in FLOAT_DTYPES
    keep_in_memory = binfo.numel * 4 <= IN_MEMORY_TENSOR_BYTES
    cached: list[torch.Tensor] = []
    hist = torch.zeros(HIST_BINS, dtype=torch.int64)
    rows = []
    tot = {"l2sq": 0.0, "l1": 0.0, "max": 0.0, "nnz": 0}
    fixed_ranges = source.fixed_ranges(binfo.name)
    fixed = re_.read_ranges(fixed_ranges) if fixed_ranges and is_float else []

    def delta_of(span: BlockSpan) -> torch.Tensor:
        bufs = re_.read_ranges(source.block_ranges(binfo.name, span))
        base = rb.tensor_rows(binfo, span.row_start, span.row_end).float() if source.needs_base else None
        return source.delta(binfo.name, span, bufs, fixed, base).reshape(-1)

    for span in spans:
        (rng,) = source.block_ranges(binfo.name, span)
        if is_float:
            d = delta_of(span)
            absd = d.abs()
            l2 = float(torch.linalg.vector_norm(d)) if d.numel() else 0.0
            l1 = float(absd.sum(dtype=torch.float64)) if d.numel() else 0.0
            mx = float(absd.max()) if d.numel() else 0.0
            nnz = int(torch.count_nonzero(d))
            if nnz:
                hist += torch.bincount((absd.view(torch.int32) >> 16).long(), minlength=HIST_BINS)
            sketch = make_sketch(d, mx, sketch_size)
            if keep_in_memory:
                cached.append(absd)
        else:
            l2 = l1 = mx = 0.0
            nnz = 0
            sketch = b""
        tot["l2sq"] += l2 * l2
        tot["l1"] += l1
        tot["max"] = max(tot["max"], mx)
        tot["nnz"] += nnz
        rows.append({
            "model_id": expert_id, "tensor": binfo.name, "block": span.index, "row_start": span.row_start,
            "row_end": span.row_end, "offset": rng[1], "nbytes": rng[2],
            "delta_l2": l2, "delta_l1": l1, "delta_max_abs": mx, "delta_nnz": nnz, "sketch": sketch,
        })

    def select(bins: list[int]) -> BinSelection:
        lut = torch.full((HIST_BINS,), -1, dtype=torch.int32)
        lut[torch.tensor(bins)] = torch.arange(len(bins), dtype=torch.int32)
        selection = BinSelection(len(bins))
        sources = cached if keep_in_memory else (delta_of(s).abs() for s in spans)
        for absd in sources:
            bits = absd.view(torch.int32)
            slot = lut[bits >> 16]
            sel = slot >= 0
            selection.add((slot[sel].long() << 16) | (bits[sel] & 0xFFFF).long())
        return selection.finish()

    thresholds = kth_largest_thresholds(hist, binfo.numel, tot["nnz"], densities, select) if tot["nnz"] else {}
    stats = {
        "model_id": expert_id, "tensor": binfo.name, "numel": binfo.numel, "delta_l2": tot["l2sq"] ** 0.5,
        "delta_l1": tot["l1"], "delta_max_abs": tot["max"], "delta_nnz": tot["nnz"],
        "thresholds": json.dumps({str(k): v for k, v in thresholds.items()}),
        "fixed_bytes": sum(n for _, _, n in fixed_ranges) if tot["nnz"] else 0,
    }
    return rows, stats


def analyze(catalog: Catalog, model_ids=None, progress: Progress | None = None, **kw) -> list[AnalyzeResult]:
    """Analyze the given experts (default: every registered model that has a base)."""
    if not model_ids:
        model_ids = [m["id"] for m in catalog.models() if m["base_id"]]
    for mid in model_ids:
        catalog.model(mid)  # fail before any work on an unknown id
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # block-sized kernels: intra-op threads only add spin-wait overhead
    try:
        return [analyze_expert(catalog, mid, progress=progress, **kw) for mid in model_ids]
    finally:
        torch.set_num_threads(saved)
