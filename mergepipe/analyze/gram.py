"""ANALYZE's per-tensor Gram statistics, gathered in the existing single pass (``stats._first_pass``).

For each base tensor and the experts analyzed together (one task covers every expert of that base):
||base||^2, <base, delta_i> and <delta_i, delta_j> for i <= j, where delta_i = x_i - base is formed in
float32 exactly as mergekit forms it, and the products are accumulated in float64 block by block. These
are what the interpolation methods need (slerp's angle, model_stock's pairwise angles, nuslerp's,
multislerp's and karcher's norms and dots): the planner derives each tensor's coefficients from them, so a
budgeted merge never reads a whole tensor to learn an angle.

For ramplus_tl it also counts, per expert, the entries with |delta| > 1e-5 that another expert of the run
also changes (shared) or that only it changes (unique): rows keyed by the set of experts of the run.

With ``arcee`` (``mergepipe analyze --arcee``; a config merge asks for it) it gathers for arcee_fusion, per full-checkpoint expert whose base is read, the importance of every entry
(ops/arcee_fusion.py: |x - base| times the KL divergence of the rows' softmaxes, rows whole inside a block)
and stores the tensor's threshold (median + 1.5 IQR; from a fixed-seed sample of 1,000,000 entries above
that size, as mergekit samples): rows ``("~arcee", expert)``.

Pairwise dots exist only between experts analyzed in the same run: ``mergepipe analyze --force A B C``
analyzes a set together. Experts whose deltas are stored as delta checkpoints do not read the base: then
||base||^2 and <base, delta_i> are not known (methods that need them refuse).
"""

from __future__ import annotations

import threading

import numpy as np

from mergepipe.analyze.sce import SceSelection
from mergepipe.catalog.gram import set_key
from mergepipe.catalog.sketch import torch_random32, torch_random64

RAM_EPSILON = 1e-5  # mergekit's default epsilon of ram / ramplus_tl (ops/ram.py)


def as_float(arr: np.ndarray | None, dtype: str) -> np.ndarray | None:
    """The float32 (float64 for F64) values of a kernels' raw view (buffers.RAW_VIEW)."""
    if arr is None:
        return None
    if arr.dtype == np.float32 or arr.dtype == np.float64:
        return arr
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return arr.view(np.float16).astype(np.float32)
    return arr.astype(np.float32)


_SCRATCH = threading.local()


def _scratch(rows: int, n: int, dtype) -> np.ndarray:
    """This thread's reusable [rows, n] array for one block's values. A fresh one per block (tens of MB,
    mapped anew each time) cost more in page faults (system time) than the Gram statistics themselves."""
    need = rows * n * np.dtype(dtype).itemsize
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < need:
        buf = _SCRATCH.buf = np.empty(need, dtype=np.uint8)
    return buf[:need].view(dtype).reshape(rows, n)


def _fill(dst: np.ndarray, arr: np.ndarray, dtype: str) -> None:
    """Write the float values of a kernels' raw view (or a float32 LoRA delta) into ``dst``."""
    arr = arr.reshape(-1)
    if dtype == "BF16" and arr.dtype == np.uint16 and dst.dtype == np.float32:
        np.left_shift(arr, 16, out=dst.view(np.uint32), dtype=np.uint32)
    elif dtype == "F16" and arr.dtype == np.int16:
        dst[:] = arr.view(np.float16)
    elif arr.dtype == np.uint16:  # bf16 into a float64 row
        dst[:] = as_float(arr, "BF16")
    else:
        dst[:] = arr


class GramAccumulator:
    """The Gram statistics of one base tensor for the passes (experts) of one ANALYZE task."""

    def __init__(self, passes, binfo):
        self.passes, self.binfo = passes, binfo
        k = len(passes)
        self.bb = 0.0
        self.has_base = any(p.source.needs_base for p in passes)  # the base is read
        self.bd = np.zeros(k)
        self.dd = np.zeros((k, k))
        # ramplus_tl: per expert, entries with |delta| > RAM_EPSILON shared with another expert / unique to it
        self.shared = np.zeros(k, dtype=np.int64)
        self.unique = np.zeros(k, dtype=np.int64)
        # arcee_fusion: per expert, the importance of its entries (or of a sample), full checkpoints only
        self.arcee = [ArceeImportance(binfo) for _ in passes] if self.has_base and any(
            getattr(p.job, "with_arcee", False) for p in passes) else None
        # sce with select_topk < 1: the top-k of the variance across the experts (analyze/sce.py)
        topks = sorted({t for p in passes for t in getattr(p.job, "sce_topk", ())})
        self.sce = SceSelection(binfo, passes[0].spans, k, topks, self._reread) if topks and k else None

    def add(self, base_raw: np.ndarray | None, expert_arrays: list[np.ndarray]) -> None:
        """One block: the float32 deltas as mergekit forms them (written into one [rows, n] array, the
        base first when it was read), then their Gram matrix accumulated in float64 and the shared/unique
        counts, by compiled loops (analyze/gram_kernels.py)."""
        from mergepipe.analyze import gram_kernels
        name = self.binfo.name
        kinds = [(p.source.kind, e, self.binfo.dtype if p.source.kind == "lora" else
                  p.source.checkpoint.tensors[name].dtype) for p, e in zip(self.passes, expert_arrays)]
        wide = self.binfo.dtype == "F64" or any(d == "F64" for _, _, d in kinds)
        first = 0 if base_raw is None else 1
        n = (base_raw if base_raw is not None else expert_arrays[0]).size
        m = _scratch(first + len(kinds), n, np.float64 if wide else np.float32)  # every row written below
        b = None
        if base_raw is not None:
            _fill(m[0], base_raw, self.binfo.dtype)
            b = m[0]
        for i, (kind, e, dtype) in enumerate(kinds, start=first):
            _fill(m[i], e, dtype)
            if self.arcee is not None:
                self.arcee[i - first].add(m[i], b, n, kind == "full")
            if kind == "full":
                np.subtract(m[i], b, out=m[i])  # float32, as mergekit's x - base
        gram_kernels.shared_unique_counts(m[first:], m.dtype.type(RAM_EPSILON), self.shared, self.unique)
        if self.sce is not None:
            self.sce.add(m[first:])
        g = np.zeros((len(m), len(m)))
        gram_kernels.gram_accumulate(m, g)
        if b is not None:
            self.bb += float(g[0, 0])
            self.bd += g[0, 1:]
            g = g[1:, 1:]
        self.dd += g

    def rows(self) -> list[tuple[str, str, float]]:
        """(a, b, value) with '' for the base: ('', '') = ||base||^2, ('', e) = <base, delta_e>,
        (e, f) = <delta_e, delta_f> with e <= f."""
        ids = [p.job.expert_id for p in self.passes]
        out = []
        if self.has_base:
            out.append(("", "", self.bb))
            out += [("", e, float(v)) for e, v in zip(ids, self.bd)]
        for i, e in enumerate(ids):
            for j in range(i, len(ids)):
                a, b = sorted((e, ids[j]))
                out.append((a, b, float(self.dd[i, j])))  # symmetric: the upper triangle
        key = set_key(ids)
        out += [(f"~shared:{key}", e, float(v)) for e, v in zip(ids, self.shared)]
        out += [(f"~unique:{key}", e, float(v)) for e, v in zip(ids, self.unique)]
        if self.sce is not None:
            out += self.sce.rows(ids, key)
        for e, acc in zip(ids, self.arcee or ()):
            value = acc.threshold()
            if value is not None:
                out.append(("~arcee", e, value))
        return out

    def _reread(self, span) -> np.ndarray:
        """A block's [K, n] float32 deltas read again (sce's passes over a tensor too large to keep)."""
        reads = [p.reread(span) for p in self.passes]
        base_raw = next((b for _, b in reads if b is not None), None)
        n = (base_raw if base_raw is not None else reads[0][0]).size
        out = _scratch(len(reads), n, np.float32)  # every row written below; used before the next block's
        base = None
        if base_raw is not None:
            base = np.empty(n, dtype=np.float32)
            _fill(base, base_raw, self.binfo.dtype)
        for i, (p, (e, _)) in enumerate(zip(self.passes, reads)):
            kind = p.source.kind
            _fill(out[i], e, self.binfo.dtype if kind == "lora" else p.source.checkpoint.tensors[self.binfo.name].dtype)
            if kind == "full":
                np.subtract(out[i], base, out=out[i])
        return out

    def finish(self) -> None:
        rows = self.rows()
        for p in self.passes:
            p.job.store_gram(self.binfo.name, rows)


class ArceeImportance:
    """One (expert, tensor)'s arcee_fusion importance values, block by block (all of them, or mergekit-sized
    sample of them above QUANTILE_SAMPLE_SIZE entries), and their threshold at the end."""

    def __init__(self, binfo):
        from mergepipe.ops.arcee_fusion import QUANTILE_SAMPLE_SIZE, SAMPLE_SEED
        self.shape, self.numel = tuple(binfo.shape), binfo.numel
        self.row = self.shape[-1] if len(self.shape) >= 1 else 1
        self.ok = True  # False: not computable (a delta/LoRA expert, a 1-D tensor over several blocks)
        self.offset = 0
        self.parts: list = []
        self.sample = None
        if self.numel > QUANTILE_SAMPLE_SIZE:  # torch.randint(numel, (size,), generator) sorted, with numpy
            self.sample = np.sort(torch_randint(self.numel, QUANTILE_SAMPLE_SIZE, SAMPLE_SEED))

    def add(self, x: np.ndarray, base: np.ndarray | None, n: int, full: bool) -> None:
        """One block: ``x`` the expert's values, ``base`` the base's (float arrays of ``n`` entries)."""
        start, self.offset = self.offset, self.offset + n
        if not self.ok or base is None or not full or (len(self.shape) <= 1 and n != self.numel):
            self.ok = False
            return
        import torch  # arcee_fusion's importance (ops/arcee_fusion.py) is torch's softmax and KL divergence
        from mergepipe.ops.arcee_fusion import importance
        xt = torch.from_numpy(np.asarray(x, dtype=np.float32)).reshape(-1, self.row)
        bt = torch.from_numpy(np.asarray(base, dtype=np.float32)).reshape(-1, self.row)
        values = importance(xt, bt).reshape(-1)
        if self.sample is not None:  # the sampled indices that fall in this block (repeats kept)
            lo, hi = np.searchsorted(self.sample, [start, start + n])
            values = values[torch.from_numpy(self.sample[lo:hi] - start)]
        self.parts.append(values.clone())

    def threshold(self) -> float | None:
        from mergepipe.ops.arcee_fusion import threshold
        if not self.ok or not self.parts:
            return None
        import torch
        return threshold(torch.cat(self.parts))


def torch_randint(high: int, count: int, seed: int) -> np.ndarray:
    """``torch.randint(high, (count,), generator=torch.Generator().manual_seed(seed))`` on the CPU (int64), with
    numpy: one 32-bit draw modulo ``high`` each, two (a 64-bit draw) when ``high`` >= 2**28 (torch 2.13's
    switch, found by testing against it)."""
    if high < 1 << 28:
        return (torch_random32(seed, count) % np.uint64(high)).astype(np.int64)
    return (torch_random64(seed, count) % np.uint64(high)).astype(np.int64)


def composed_gram(base: np.ndarray, xs: list[np.ndarray], blocks: list[tuple[int, int]]):
    """The Gram statistics of whole float32 tensors held in memory (a re-ordered vocabulary's composed
    embedding rows, engine/vocab.py): per block (``blocks``: flat entry ranges of the grid), the float32
    deltas x_i - base, their products summed in float64 by the same kernel as :meth:`GramAccumulator.add`
    and added up block by block, as ANALYZE does for a full checkpoint's tensor."""
    from mergepipe.analyze import gram_kernels
    from mergepipe.ops.interp import Gram
    k = len(xs)
    total = np.zeros((k + 1, k + 1))
    for start, stop in blocks:
        m = np.empty((k + 1, stop - start), dtype=np.float32)
        m[0] = base[start:stop]
        for i, x in enumerate(xs, start=1):
            np.subtract(x[start:stop], m[0], out=m[i])  # float32, as mergekit's x - base
        g = np.zeros_like(total)
        gram_kernels.gram_accumulate(m, g)
        total += g
    dd = tuple(tuple(float(v) for v in row[1:]) for row in total[1:])
    return Gram(float(total[0, 0]), tuple(float(v) for v in total[0, 1:]), dd, int(base.size))


def _deltas(base: np.ndarray, xs: list[np.ndarray], start: int, stop: int) -> np.ndarray:
    """[K, n] float32 deltas x_i - base of one block (flat entries start:stop)."""
    out = np.empty((len(xs), stop - start), dtype=np.float32)
    for i, x in enumerate(xs):
        np.subtract(x[start:stop], base[start:stop], out=out[i])  # float32, as mergekit's x - base
    return out


def composed_counts(base: np.ndarray, xs: list[np.ndarray], blocks: list[tuple[int, int]]):
    """ramplus_tl's per-expert counts of entries with |delta| > 1e-5 shared with another expert / unique to it,
    of whole float32 tensors held in memory (a re-ordered vocabulary's composed rows), by ANALYZE's kernel."""
    from mergepipe.analyze import gram_kernels
    shared = np.zeros(len(xs), dtype=np.int64)
    unique = np.zeros(len(xs), dtype=np.int64)
    for start, stop in blocks:
        gram_kernels.shared_unique_counts(_deltas(base, xs, start, stop), np.float32(RAM_EPSILON), shared, unique)
    return [int(v) for v in shared], [int(v) for v in unique]


def composed_arcee(base: np.ndarray, x: np.ndarray, shape: tuple, blocks: list[tuple[int, int]]) -> float | None:
    """arcee_fusion's importance threshold of a whole float32 tensor held in memory (composed rows), block by
    block as ANALYZE takes it (:class:`ArceeImportance`: the same sample above 1,000,000 entries)."""
    from types import SimpleNamespace
    acc = ArceeImportance(SimpleNamespace(shape=tuple(shape), numel=int(base.size)))
    for start, stop in blocks:
        acc.add(x[start:stop], base[start:stop], stop - start, True)
    return acc.threshold()


def composed_sce(base: np.ndarray, xs: list[np.ndarray], spans, itemsize: int, topk: float):
    """sce's selection for ``select_topk`` < 1 of whole float32 tensors held in memory (composed rows):
    (each expert's sum of kept delta^2, threshold, cut block, cut rank), by ANALYZE's own radix select over
    the output grid's blocks (``spans``), the blocks' deltas formed again from memory for its later passes."""
    from types import SimpleNamespace
    ranges = {s.index: (s.rel_offset // itemsize, (s.rel_offset + s.nbytes) // itemsize) for s in spans}
    sel = SceSelection(SimpleNamespace(numel=int(base.size)), spans, len(xs), (topk,),
                       lambda s: _deltas(base, xs, *ranges[s.index]))
    sel.cache = None  # the deltas are formed again from the composed rows, not copied
    for s in spans:
        sel.add(_deltas(base, xs, *ranges[s.index]))
    thr, cut, rank, sums = sel._select(topk)
    return [float(v) for v in sums], float(thr), int(cut), int(rank)
