"""kernels.block_tail (one call per block after block_stats) against what it stands in for: hist_delta,
nonfinite_in_hist, and the sketch as catalog/sketch.sketch_bytes makes it (float32 division, numpy's
float16 rounding), bit for bit. (The float16 rounding was also checked once over every finite float32.)"""

from __future__ import annotations

import numpy as np
import pytest

from mergepipe.analyze import kernels
from mergepipe.catalog.sketch import sample_positions, sketch_bytes


def test_f16_rounding_equals_numpy():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
             rng.standard_normal(1 << 16).astype(np.float32) * np.float32(1e-5),
             rng.standard_normal(1 << 16).astype(np.float32) * np.float32(1e4)]
    # the edges: around the half subnormals, the smallest normal, ties, the largest half and past it
    edges = np.array([0.0, -0.0, 5.96e-8, 2.98e-8, 2.9802322e-08, 2.9802326e-08, 6.1035156e-05, 6.1e-05,
                      65504.0, 65519.99, 65520.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1e-45, 3.4e38],
                     dtype=np.float32)
    bits = np.arange(0x33000000 - 4096, 0x38800000 + 4096, 97, dtype=np.uint32)  # the subnormal range, densely
    v = np.concatenate(parts + [edges, -edges, bits.view(np.float32), -bits.view(np.float32)])
    v = v[np.isfinite(v)]
    out = np.empty(v.size, dtype=np.uint16)
    kernels.f32_to_f16_bits(v, out)
    with np.errstate(over="ignore"):
        ref = v.astype(np.float16).view(np.uint16)
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "delta"])
def test_block_tail_equals_the_steps_it_replaces(dtype):
    rng = np.random.default_rng(1)
    n = 70001
    base = rng.standard_normal(n).astype(np.float32)
    exp = base + rng.standard_normal(n).astype(np.float32) * np.float32(0.01)
    exp[:50] = base[:50]  # some zero deltas
    if dtype == "bf16":
        e, b = (exp.view(np.uint32) >> 16).astype(np.uint16), (base.view(np.uint32) >> 16).astype(np.uint16)
    elif dtype == "fp16":
        e, b = exp.astype(np.float16).view(np.int16), base.astype(np.float16).view(np.int16)
    elif dtype == "fp32":
        e, b = exp, base
    else:
        e, b = exp - base, None
    positions = sample_positions(n, 2048)
    for step in range(2):
        hist = np.zeros((4, 1 << 16), dtype=np.int32)
        l1 = np.zeros(1 << 16)
        keys = np.empty(n, dtype=np.uint32)
        prev_ref = np.zeros(1 << 16, dtype=np.int64)
        s2, s1, m, nnz, low, _ = kernels.block_stats(e, b, hist, keys, 0, l1, None)
        m = float(m)
        upto = (int(np.array([m], np.float32).view(np.uint32)[0]) >> 16) + 1
        bins, counts = np.zeros(1 << 16, np.int64), np.zeros(1 << 16, np.int64)
        n_ref = kernels.hist_delta(hist, prev_ref, bins, counts, upto)
        prev = np.zeros(1 << 16, dtype=np.int64)
        bb, bc = np.zeros(upto + 5, np.int32), np.zeros(upto + 5, np.int32)
        sketch = np.empty(positions.size, np.uint16)
        scratch = np.zeros(1 << 16, np.int64), np.zeros(1 << 16, np.int64)
        n_bins, copied, nonfinite, sketched = kernels.block_tail(hist, prev, *scratch, bb, bc, 5, upto, 0, e, b,
                                                                 positions, m, sketch)
        assert sketched and copied and nonfinite == kernels.nonfinite_in_hist(hist) == 0
        assert n_bins == n_ref
        assert np.array_equal(bb[5:5 + n_bins], bins[:n_ref]) and np.array_equal(bc[5:5 + n_bins], counts[:n_ref])
        assert np.array_equal(prev, prev_ref)
        assert sketch.tobytes() == sketch_bytes(kernels.gather_delta(e, b, positions), m)
        e = e.copy()
        e[::7] = b[::7] if b is not None else 0  # again with more zero deltas


def test_block_tail_leaves_a_nonfinite_block_to_the_caller():
    e = np.array([1.0, np.nan, 2.0, 3.0], dtype=np.float32)
    b = np.zeros(4, dtype=np.float32)
    hist = np.zeros((4, 1 << 16), dtype=np.int32)
    kernels.block_stats(e, b, hist, np.empty(4, np.uint32), 0, np.zeros(1 << 16), None)
    bb, bc = np.zeros(1 << 16, np.int32), np.zeros(1 << 16, np.int32)
    scratch = np.zeros(1 << 16, np.int64), np.zeros(1 << 16, np.int64)
    n_bins, copied, nonfinite, sketched = kernels.block_tail(hist, np.zeros(1 << 16, np.int64), *scratch, bb, bc, 0,
                                                             1 << 16, 0, e, b, np.arange(4), 3.0, np.empty(4, np.uint16))
    assert nonfinite == 1 and not sketched and copied


@pytest.mark.parametrize("view,nan_bits", [(np.uint16, 0x7FC0), (np.int16, 0x7E00)])
def test_an_unchanged_block_counts_only_zeros_and_a_nan_still_counts(view, nan_bits):
    """block_stats' shortcut for a block whose expert and base bits are equal (every delta +0.0): the same
    results and the same lane counts as its loop; equal bits that are NaN/Inf are not zeros (the loop runs)."""
    rng = np.random.default_rng(2)
    for n in (1001, 4096, 3):
        base = rng.integers(0, 0x3F00, n).astype(np.uint16).view(view)
        hist = np.zeros((4, 1 << 16), dtype=np.int32)
        out = kernels.block_stats(base.copy(), base, hist, np.empty(n, np.uint32), 7, np.zeros(1 << 16), None)
        assert out == (0.0, 0.0, 0.0, 0, 0, 7)
        assert hist[:, 0].tolist() == [n // 4 + n % 4, n // 4, n // 4, n // 4] and hist.sum() == n
        odd = base.copy()
        odd[n // 2] = np.uint16(nan_bits).view(view)
        hist[:] = 0
        kernels.block_stats(odd.copy(), odd, hist, np.empty(n, np.uint32), 0, np.zeros(1 << 16), None)
        assert kernels.nonfinite_in_hist(hist) == 1 and hist.sum() == n
        changed = base.copy()
        changed[-1] ^= np.uint16(1).view(view)
        hist[:] = 0
        s2, s1, m, nnz, low, _ = kernels.block_stats(changed, base, hist, np.empty(n, np.uint32), 0, np.zeros(1 << 16),
                                                     None)
        assert nnz == 1 and m > 0 and hist.sum() == n
