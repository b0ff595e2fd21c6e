"""ANALYZE: one pass over base and experts computing per-block statistics of each expert's delta.

Per block of delta = expert - base: L2 and L1 norms, max |delta|, non-zero count, a sketch
(see catalog/sketch.py) and the count of non-finite deltas (NaN/Inf in the expert or the base; of them,
how many entries of the base block are NaN/Inf). Per (expert, tensor): the same totals and exact top-k magnitude thresholds for a
grid of densities (what TIES/breadcrumbs need) and, per density, the count of entries above and equal to
the threshold and the L1 norm of exactly k top entries (``topk``: what TIES' L1 ``rescale`` needs;
summed from a per-bin L1 histogram kept in the first pass, so it costs no extra pass), so a budgeted merge never reads a whole tensor to
learn them. Thresholds are found by a radix select on the float32 bit pattern of |delta|: pass one
histograms the top 16 bits; pass two counts the low 16 bits of only the bins that hold a k-th largest
(from memory for small tensors, otherwise re-read from the page cache the first pass just filled).

Both passes are compiled loops over the checkpoints' raw bytes (analyze/kernels.py); (expert, tensor)
tasks run on a pool of threads, one per core plus one so that a read never leaves a core idle, in
tensor-major order so that the experts of one base share its pages in the page cache. The engine
runs the same :class:`ExpertAnalysis` during a first merge (analysis on the way).

Non-finite values are recorded, not refused, here: ANALYZE stores the counts (read from the first
pass's histogram, so healthy data costs no extra pass) and the planner refuses to merge an expert whose
delta has any (``planner/context.py``); a first merge refuses them as its analysis on the way finds
them (``engine/inflight.py``).

This module holds one expert's analysis and the per-tensor passes; second_pass.py the select's low
bits and the exact-k cuts, thresholds.py the radix select, runner.py what ANALYZE runs (preparing jobs,
the task pool, storing the results).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time

import numpy as np

from mergepipe.analyze import bins, buffers, finish, kernels, rows
from mergepipe.analyze.compact_store import CompactWriter
from mergepipe.analyze.gram import GramAccumulator
from mergepipe.analyze.second_pass import NO_KEYS, SecondPass
from mergepipe.analyze.thresholds import HIST_BINS, _density_ks, density_names, kth_largest_thresholds
from mergepipe.catalog.db import now
from mergepipe.catalog.sketch import DEFAULT_SKETCH_SIZE, sample_positions, sketch_bytes
from mergepipe.storage.grid import BlockSpan, tensor_grid
from mergepipe.storage.base import Reader
from mergepipe.storage.safetensors import Checkpoint, FLOAT_DTYPES, TensorInfo
from mergepipe.storage.sources import open_source


# Top-k fractions with stored thresholds: every percent, plus two below 1 % and 1 (the top n and n - 1:
# breadcrumbs where gamma + density = 1 keeps the top n - 1 when int(gamma n) + int(density n) = n - 1).
DEFAULT_DENSITIES = (0.001, 0.005) + tuple(round(i / 100, 2) for i in range(1, 100)) + (1.0,)
IN_MEMORY_TENSOR_BYTES = 64 << 20
KEY_CAP = 4 << 20  # most |d| patterns kept per (expert, tensor) for the select (16 MiB)
L1_FOLD_NUMEL = 1 << 29  # below: l1hist's per-bin sums are exact, block_stats folds the common entries at the end
PREFETCH_BLOCKS = 8  # blocks read ahead of the one being analyzed, per file
KEEP_TASK_BYTES = 512 << 20  # base and expert bytes of one tensor kept for the second pass, all experts
_NO_BINS = np.empty(0, dtype=np.int32)


def analysis_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1) + 1))


class ExpertAnalysis:
    """ANALYZE of one expert against its base: its own readers (so bytes are counted per expert),
    its settings, and the rows of every tensor analyzed so far. Tensors may be analyzed concurrently."""

    def __init__(self, expert: dict, base: dict, base_ck: Checkpoint, block_bytes: int,
                 sketch_size: int = DEFAULT_SKETCH_SIZE, densities=DEFAULT_DENSITIES, grid_seen: int | None = None,
                 with_gram: bool = False, with_arcee: bool = False, sce_topk=(), compact: "CompactWriter | None" = None):
        self.expert, self.base = expert, base
        self.compact = compact  # the compact deltas this analysis writes on the way (analyze/compact_store.py)
        # arcee_fusion's importance thresholds (analyze/gram.py): opt-in as well, measured 1.7x the time of
        # ANALYZE --gram on the small family (a softmax of every row of base and expert, a sort per tensor)
        self.with_arcee = with_arcee
        self.sce_topk = tuple(sce_topk)  # sce's select_topk values < 1 to select for (analyze/sce.py)
        # the interpolation methods' Gram statistics: opt-in, their K^2 dot products cost more than
        # everything else ANALYZE computes (measured: ANALYZE of 4 experts 2.7x slower with them)
        self.with_gram = with_gram
        self.grid_seen = grid_seen  # the base's grid when the job was made (compare-and-set on store)
        self.base_ck = base_ck
        self.source = open_source(expert["kind"], expert["uri"])
        self.block_bytes = block_bytes
        self.sketch_size = sketch_size
        self.densities = tuple(sorted(set(float(d) for d in densities)))
        self.rb = base_ck.reader(sequential=True)
        self.re = self.source.checkpoint.reader(sequential=True)
        self.results: dict[str, tuple[list[dict], dict]] = {}
        self.gram: dict[str, list[tuple[str, str, float]]] = {}  # tensor -> Gram rows (analyze/gram.py)
        self.seconds = 0.0
        self.base_read = 0  # base bytes this expert's statistics used (a shared read counts for each)
        self._lock = threading.Lock()

    @property
    def expert_id(self) -> str:
        return self.expert["id"]

    @property
    def bytes_read(self) -> int:
        return self.base_read + self.rb.bytes_read + self.re.bytes_read

    def tensor_order(self) -> list[TensorInfo]:
        """Base tensors in the order of the expert's bytes, so the pass over its files is sequential."""
        return sorted(self.base_ck.tensors.values(), key=self._read_position)

    def _read_position(self, binfo: TensorInfo):
        if not self.source.has_delta(binfo.name, binfo.shape):  # tensors without a delta go last
            return (1, "", 0)
        fname, offset, _ = self.source.block_ranges(binfo.name, tensor_grid(binfo, 1 << 62)[0])[0]
        return (0, fname, offset)

    def store(self, name: str, result: tuple[list[dict], dict], seconds: float) -> None:
        with self._lock:
            self.results[name] = result
            self.seconds += seconds

    def store_gram(self, name: str, rows: list) -> None:
        with self._lock:
            self.gram[name] = rows

    def record(self, seconds: float | None = None) -> dict:
        """The ``analyses`` row of this expert (all of its tensors must be analyzed)."""
        return {"model_id": self.expert_id, "base_id": self.base["id"], "fingerprint": self.expert["fingerprint"],
                "base_fingerprint": self.base["fingerprint"], "block_bytes": self.block_bytes,
                "sketch_size": self.sketch_size, "densities": json.dumps(list(self.densities)),
                "n_blocks": self.n_blocks, "bytes_read": self.bytes_read,
                "seconds": round(self.seconds if seconds is None else seconds, 4), "analyzed_at": now()}

    @property
    def n_blocks(self) -> int:
        return sum(len(rows) for rows, _ in self.results.values())

    def close(self) -> None:
        self.rb.close()
        self.re.close()
        if self.compact is not None:
            self.compact.close()


def analyze_tensor(jobs: list[ExpertAnalysis], binfo: TensorInfo) -> None:
    """One base tensor for several experts of that base: each base block is read once for all of them
    (the base's bytes are still counted for every expert that uses them)."""
    t0 = time.perf_counter()
    passes = [_TensorPass(job, binfo) for job in jobs if job.source.has_delta(binfo.name, binfo.shape)]
    if passes and is_float(binfo):
        _first_pass(passes, binfo)
    for job in jobs:
        p = next((p for p in passes if p.job is job), None)
        job.store(binfo.name, p.finish() if p else rows.zero_tensor(binfo, job.block_bytes, job.expert_id),
                  (time.perf_counter() - t0) / len(jobs))


def _prefetch(base_reader: Reader | None, passes: list["_TensorPass"], binfo: TensorInfo,
              span: BlockSpan) -> None:
    """Start reading a block that comes PREFETCH_BLOCKS later, in every file: a task then finds its
    blocks in the page cache instead of waiting for each 1 MiB read in turn."""
    if base_reader is not None:
        base_reader.prefetch(binfo.file, binfo.offset + span.rel_offset, span.nbytes)
    for p in passes:
        if p.source.kind != "lora":
            p.job.re.prefetch(*p.ranges[span.index])


def _first_pass(passes: list["_TensorPass"], binfo: TensorInfo) -> None:
    spans = passes[0].spans
    needs_base = any(p.source.needs_base for p in passes)
    per_span = [(span.nbytes + 8 if needs_base else 0) + sum(p.expert_bytes(span) + 8 for p in passes)
                for span in spans]
    # blocks kept for a second look, which only a tensor of more entries than its key buffer may need, and
    # hardly a bf16 one (a difference of two bf16 values rarely has low bits: its keys fit; else it re-reads)
    keep = (KEY_CAP < binfo.numel <= IN_MEMORY_TENSOR_BYTES // 4 and sum(per_span) <= KEEP_TASK_BYTES
            and binfo.dtype != "BF16")
    arena = buffers.Arena(sum(per_span) if keep else max(per_span))
    gram = GramAccumulator(passes, binfo) if any(p.job.with_gram or p.job.with_arcee or p.job.sce_topk
                                                       for p in passes) else None
    with passes[0].job.base_ck.reader(sequential=True) as base_reader:
        for i, span in enumerate(spans):
            for ahead in spans[i + PREFETCH_BLOCKS:i + PREFETCH_BLOCKS + 1] if i else spans[:PREFETCH_BLOCKS + 1]:
                _prefetch(base_reader if needs_base else None, passes, binfo, ahead)
            if not keep:
                arena.pos = 0
            base = None
            if needs_base:
                rng = (binfo.file, binfo.offset + span.rel_offset, span.nbytes)
                base = buffers.read_view(base_reader, rng, binfo.dtype, arena.take(span.nbytes))
            blocks = [p.add_block(span, base, arena, keep) for p in passes]
            if gram is not None:
                gram.add(base, blocks)
    if gram is not None:
        gram.finish()


class _TensorPass(SecondPass):
    """The block statistics and both radix-select passes of one (expert, tensor) (the second, and the
    exact-k cuts: :class:`~mergepipe.analyze.second_pass.SecondPass`)."""

    def __init__(self, job: ExpertAnalysis, binfo: TensorInfo):
        self.job, self.binfo = job, binfo
        self.source = job.source
        self.spans = tensor_grid(binfo, job.block_bytes)
        # each block's expert byte range, once (the passes asked block_ranges ~4 times a block)
        self.ranges = ([] if self.source.kind == "lora" or not is_float(binfo) else
                       [self.source.block_ranges(binfo.name, span)[0] for span in self.spans])
        fixed = self.source.fixed_ranges(binfo.name)
        self.fixed_bytes = sum(n for _, _, n in fixed)
        self.fixed = job.re.read_ranges(fixed) if fixed and is_float(binfo) else []
        self.buf = buffers.take(binfo.numel)  # histograms and scratch, reused (analyze/buffers.py)
        self.hist, self.l1hist = self.buf.hist, self.buf.l1hist  # |d| patterns' top 16 bits; sum of |d| per bin
        self.lowcnt = self.buf.lowcnt if binfo.numel < L1_FOLD_NUMEL else None  # kernels.fold_l1
        # per block, for the exact-k cuts: its sparse histogram counts (bins / counts, appended in block order:
        # block i's end at blk[i, 0]) and its keys (keys[blk[i, 1]:blk[i, 2]]); ``nblk`` blocks recorded
        self.bb_bins = self.bb_counts = _NO_BINS
        self.blk = np.empty((len(self.spans), 3), dtype=np.int64)
        self.nblk = 0
        self.rows: list[dict] = []
        self.compacts: list[tuple] = []  # (block, entries, record, error norms) when the job writes compacts
        self.cached: list[tuple] = []  # (expert, base) arrays of every block, when the tensor is kept
        self.l2sq = self.l1 = self.mx = 0.0
        self.nnz = self.nonzero_low = 0
        self.nonfinite = self.base_nonfinite = 0
        # |d| bit patterns with non-zero low 16 bits, collected by the first pass up to a cap
        self.key_cap = min(binfo.numel, KEY_CAP)
        self.keys, self.nkeys = np.empty(min(self.key_cap, 1 << 16), dtype=np.uint32), 0

    def _collect_rest(self, e, b, before: int, low: int) -> None:
        """The key buffer was too small for this block: grow it (doubling, up to the cap) and collect
        the block's keys again; past the cap, give up on keys (the select then reads a second time)."""
        need = before + low
        if self.keys is NO_KEYS or need > self.key_cap:
            self.keys, self.nkeys = NO_KEYS, 0
            return
        grown = np.empty(min(self.key_cap, max(2 * self.keys.size, need, 1 << 16)), dtype=np.uint32)
        grown[:before] = self.keys[:before]
        self.keys = grown
        self.nkeys = kernels.collect_low_patterns(e, b, self.keys, before)

    def expert_bytes(self, span: BlockSpan) -> int:
        return 0 if self.source.kind == "lora" else self.ranges[span.index][2]

    def expert_block(self, span: BlockSpan, into: np.ndarray | None = None) -> np.ndarray:
        """The expert-side array of a block: raw bytes (full, delta) or the float32 delta (LoRA)."""
        name, job = self.binfo.name, self.job
        if self.source.kind == "lora":
            bufs = job.re.read_ranges(self.source.block_ranges(name, span))
            return self.source.delta(name, span, bufs, self.fixed, None).reshape(-1).numpy()
        rng = self.ranges[span.index]
        return buffers.read_view(job.re, rng, self.source.checkpoint.tensors[name].dtype,
                     np.empty(rng[2], dtype=np.uint8) if into is None else into)

    def reread(self, span: BlockSpan):
        """A block's (expert, base) arrays read again, for the second pass over a large tensor."""
        e = self.expert_block(span)
        if not self.source.needs_base:
            return e, None
        rng = (self.binfo.file, self.binfo.offset + span.rel_offset, span.nbytes)
        return e, buffers.read_view(self.job.rb, rng, self.binfo.dtype, np.empty(span.nbytes, dtype=np.uint8))

    def add_block(self, span: BlockSpan, base: np.ndarray | None, arena: buffers.Arena, keep: bool) -> None:
        e = self.expert_block(span, arena.take(self.expert_bytes(span)))
        b = base if self.source.needs_base else None
        if b is not None:
            self.job.base_read += b.nbytes
        before = self.nkeys
        s2, s1, m, n, low, self.nkeys = kernels.block_stats(e, b, self.hist, self.keys, before, self.l1hist, self.lowcnt)
        if self.nkeys - before < low:
            self._collect_rest(e, b, before, low)
        # this block's histogram counts, sparse: the exact-k cuts then need no second pass over the data;
        # the non-finite entries so far (a histogram read) and, for a block without any, its sketch: one call
        m = float(m)
        upto = (rows.top_bin(m) if math.isfinite(m) else self.hist.shape[1]) + 1
        pos = int(self.blk[self.nblk - 1, 0]) if self.nblk else 0
        positions = sample_positions(e.size, self.job.sketch_size)
        sketch = buffers.sketch_scratch(positions.size)
        n_bins, copied, nonfinite, sketched = kernels.block_tail(
            self.hist, self.buf.before, self.buf.bins, self.buf.counts, self.bb_bins, self.bb_counts, pos, upto,
            self.nonfinite, e, b, positions, m, sketch)
        if not copied:  # the pass's arrays were full
            self._grow_bins(pos + n_bins)
            self.bb_bins[pos:pos + n_bins] = self.buf.bins[:n_bins]
            self.bb_counts[pos:pos + n_bins] = self.buf.counts[:n_bins]
        self.blk[self.nblk] = (pos + n_bins, before, self.nkeys)
        self.nblk += 1
        nonfinite -= self.nonfinite  # this block's
        base_nonfinite = kernels.count_nonfinite(b) if nonfinite and b is not None else 0  # bad blocks only
        self.nonfinite += nonfinite
        self.base_nonfinite += base_nonfinite
        rng = self.ranges[span.index] if self.ranges else self.source.block_ranges(self.binfo.name, span)[0]
        if sketched:
            sketch = sketch.tobytes()
        else:
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf deltas (recorded, refused by the planner)
                sketch = sketch_bytes(kernels.gather_delta(e, b, positions), m)
        self.rows.append(rows.block_row(self.job.expert_id, self.binfo.name, span, rng, delta_l2=math.sqrt(s2), delta_l1=s1,
                              delta_max_abs=m, delta_nnz=n, nonfinite=nonfinite, base_nonfinite=base_nonfinite,
                              sketch=sketch))
        if self.job.compact is not None and n:
            self.compacts.append((span.index, e.size, *self.job.compact.encode(e, b)))
        self.l2sq, self.l1, self.mx = self.l2sq + s2, self.l1 + s1, max(self.mx, m)
        self.nnz, self.nonzero_low = self.nnz + n, self.nonzero_low + low
        if keep:
            self.cached.append((e, b))
        self.keep = keep
        return e

    def finish(self) -> tuple[list[dict], dict]:
        binfo, job = self.binfo, self.job
        if not is_float(binfo):  # not read: block rows with zero statistics
            self.rows = [rows.block_row(job.expert_id, binfo.name, span, self.source.block_ranges(binfo.name, span)[0])
                         for span in self.spans]
        # no |d| above the largest (a NaN is above every number, but then count them all)
        hist = self.buf.lane_sums(rows.top_bin(self.mx) + 1 if self.nonfinite == 0 else buffers.WIDTH)
        if self.lowcnt is not None:
            bins.fold_l1(hist, self.lowcnt, self.l1hist, bins.BIN_VALUES, *self.buf.used)
        texts = self._fused_select(hist) if self._fusable() else None
        if texts is None:
            topk: dict = {}
            thresholds = (kth_largest_thresholds(hist[:HIST_BINS], binfo.numel, self.nnz, job.densities, self.select,
                                                 self.l1hist, topk)
                          if self.nnz else {})
            self.tie_cuts(topk, thresholds)
            names = density_names(job.densities)
            texts = (json.dumps({names[k]: v for k, v in thresholds.items()}),
                     json.dumps({names[k]: v for k, v in topk.items()}))
        stats = {"model_id": job.expert_id, "tensor": binfo.name, "numel": binfo.numel, "delta_l2": self.l2sq ** 0.5,
                 "delta_l1": self.l1, "delta_max_abs": self.mx, "delta_nnz": self.nnz,
                 "thresholds": texts[0], "topk": texts[1],
                 "fixed_bytes": self.fixed_bytes if self.nnz else 0,
                 "nonfinite": self.nonfinite, "base_nonfinite": self.base_nonfinite}
        self.cached, self.keys = [], NO_KEYS
        self.bb_bins = self.bb_counts = _NO_BINS
        buffers.give_back(self.buf)
        self.buf = self.hist = self.l1hist = self.lowcnt = None
        if job.compact is not None and self.compacts:
            job.compact.append(binfo.name, self.compacts)
            self.compacts = []
        return self.rows, stats


    def _grow_bins(self, need: int) -> None:
        cap = max(need, self.bb_bins.size + self.bb_bins.size // 2, 256)
        for name in ("bb_bins", "bb_counts"):
            grown = np.empty(cap, dtype=np.int32)
            old = getattr(self, name)
            grown[:old.size] = old
            setattr(self, name, grown)

    @property
    def block_bins(self) -> list[tuple]:
        """Per block recorded: (bins, counts, first key, end key), as second_pass.SecondPass.tie_cuts reads them."""
        out, start = [], 0
        for end, k0, k1 in self.blk[:self.nblk].tolist():
            out.append((self.bb_bins[start:end].astype(np.int64), self.bb_counts[start:end].astype(np.int64), k0, k1))
            start = end
        return out

    def _fusable(self) -> bool:
        """The common case, which analyze/finish.py computes in two compiled calls: a float tensor with
        non-zeros, every low-bit key collected, no NaN/Inf, every block's histogram counts recorded."""
        return (bool(self.nnz) and self.keys is not NO_KEYS and self.nonfinite == 0 and is_float(self.binfo)
                and self.nblk == len(self.spans))

    def _fused_select(self, hist: np.ndarray) -> tuple[str, str] | None:
        """(thresholds JSON, topk JSON) as kth_largest_thresholds and tie_cuts make them, or None where
        analyze/finish.py leaves the case to them."""
        numel, densities = self.binfo.numel, self.job.densities
        pairs, all_ks = _density_ks(densities, numel, True)
        kk = all_ks[(all_ks > 0) & (all_ks <= self.nnz)]
        q = kk.size
        j, n_hi, s_hi = np.empty(q, np.int64), np.empty(q, np.int64), np.empty(q, np.float64)
        kbins = np.empty(q, np.int64)
        chosen = np.empty(self.nkeys, np.int64)
        m, nb = finish.choose_keys(hist, self.l1hist, kk, j, n_hi, s_hi, kbins, self.keys, self.nkeys,
                                   buffers.slot_scratch(), chosen)
        chosen = chosen[:m]
        chosen.sort()
        dens_k, names = rows.density_table(densities, numel)
        d = dens_k.size
        thr, has = np.empty(d, np.float64), np.zeros(d, np.int8)
        ti, tf = np.empty((d, 8), np.int64), np.empty((d, 2), np.float64)
        if not finish.finish_rest(hist, kk, j, n_hi, s_hi, kbins, nb, chosen, dens_k, self.keys, self.blk,
                                  self.bb_bins, self.bb_counts, buffers.span_index(self.spans), thr, has, ti, tf):
            return None
        topk = {name: [t[0], t[1], f[0], t[2], t[3], f[1], t[4], t[5], t[6], t[7]]
                for name, h, t, f in zip(names, has.tolist(), ti.tolist(), tf.tolist()) if h}
        return json.dumps(dict(zip(names, thr.tolist()))), json.dumps(topk)


def is_float(binfo: TensorInfo) -> bool:
    return binfo.dtype in FLOAT_DTYPES


