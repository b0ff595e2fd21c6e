"""ANALYZE's per-tensor Gram statistics, gathered in the existing single pass (``stats._first_pass``).

For each base tensor and the experts analyzed together (one task covers every expert of that base):
||base||^2, <base, delta_i> and <delta_i, delta_j> for i <= j, where delta_i = x_i - base is formed in
float32 exactly as mergekit forms it, and the products are accumulated in float64 block by block. These
are what the interpolation methods need (slerp's angle, model_stock's pairwise angles, nuslerp's,
multislerp's and karcher's norms and dots): the planner derives each tensor's coefficients from them, so a
budgeted merge never reads a whole tensor to learn an angle.

Pairwise dots exist only between experts analyzed in the same run: ``mergepipe analyze --force A B C``
analyzes a set together. Experts whose deltas are stored as delta checkpoints do not read the base: then
||base||^2 and <base, delta_i> are not known (methods that need them refuse).
"""

from __future__ import annotations

import numpy as np

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
        return out

    def finish(self) -> None:
        rows = self.rows()
        for p in self.passes:
            p.job.store_gram(self.binfo.name, rows)
