"""ANALYZE's per-tensor Gram statistics, gathered in the existing single pass (``stats._first_pass``).

For each base tensor and the experts analyzed together (one task covers every expert of that base):
||base||^2, <base, delta_i> and <delta_i, delta_j> for i <= j, where delta_i = x_i - base is formed in
float32 exactly as mergekit forms it, and the products are accumulated in float64 block by block. These
are what the interpolation methods need (slerp's angle, model_stock's pairwise angles, nuslerp's,
multislerp's and karcher's norms and dots): the planner derives each tensor's coefficients from them, so a
budgeted merge never reads a whole tensor to learn an angle.

For ramplus_tl it also counts, per expert, the entries with |delta| > 1e-5 that another expert of the run
also changes (shared) or that only it changes (unique): rows keyed by the set of experts of the run.

Pairwise dots exist only between experts analyzed in the same run: ``mergepipe analyze --force A B C``
analyzes a set together. Experts whose deltas are stored as delta checkpoints do not read the base: then
||base||^2 and <base, delta_i> are not known (methods that need them refuse).
"""

from __future__ import annotations

import numpy as np

from mergepipe.catalog.gram import set_key

RAM_EPSILON = 1e-5  # mergekit's default epsilon of ram / ramplus_tl (ops/ram.py)
CHUNK = 1 << 16  # entries per matrix product: (K+1) x 64 Ki float64 (8 MiB for K = 15)


def as_float(arr: np.ndarray | None, dtype: str) -> np.ndarray | None:
    """The float32 (float64 for F64) values of a kernels' raw view (stats.RAW_VIEW)."""
    if arr is None:
        return None
    if arr.dtype == np.float32 or arr.dtype == np.float64:
        return arr
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return arr.view(np.float16).astype(np.float32)
    return arr.astype(np.float32)


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

    def add(self, base_raw: np.ndarray | None, expert_arrays: list[np.ndarray]) -> None:
        """One block: the float32 deltas as mergekit forms them, then their Gram matrix (with the base
        first when it was read) as float64 matrix products over chunks of CHUNK entries."""
        b = as_float(base_raw, self.binfo.dtype)
        rows = [] if b is None else [b.reshape(-1)]
        for p, e in zip(self.passes, expert_arrays):
            if p.source.kind == "full":
                x = as_float(e, p.source.checkpoint.tensors[self.binfo.name].dtype)
                d = x - b  # float32, as mergekit's x - base
            elif p.source.kind == "lora":
                d = e
            else:
                d = as_float(e, p.source.checkpoint.tensors[self.binfo.name].dtype)
            rows.append(np.asarray(d).reshape(-1))
        n = rows[0].size
        self._count(rows[1:] if b is not None else rows)
        g = np.zeros((len(rows), len(rows)))
        with np.errstate(invalid="ignore", over="ignore"):
            for c0 in range(0, n, CHUNK):
                m = np.stack([r[c0:c0 + CHUNK] for r in rows]).astype(np.float64)
                g += m @ m.T
        if b is not None:
            self.bb += float(g[0, 0])
            self.bd += g[0, 1:]
            g = g[1:, 1:]
        self.dd += g

    def _count(self, deltas) -> None:
        with np.errstate(invalid="ignore"):
            nonzero = np.stack([np.abs(d) > np.float32(RAM_EPSILON) for d in deltas])
        counts = nonzero.sum(axis=0)
        self.shared += (nonzero & (counts > 1)).sum(axis=1)
        self.unique += (nonzero & (counts == 1)).sum(axis=1)

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
        return out

    def finish(self) -> None:
        rows = self.rows()
        for p in self.passes:
            p.job.store_gram(self.binfo.name, rows)
