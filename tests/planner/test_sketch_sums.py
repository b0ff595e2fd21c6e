"""The full-norm estimate's fast paths reproduce numpy's float16 cast and np.add.reduceat bit for bit, so plans
(their error bounds and digests) are what they were."""

import numpy as np
import pytest

from mergepipe.planner.bounds import _f16_table, _row_sums


def test_float16_table_is_numpys_cast_for_every_bit_pattern():
    every = np.arange(1 << 16, dtype=np.uint16)
    assert np.array_equal(_f16_table().take(every).view(np.uint32),
                          every.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("seed", range(6))
def test_row_sums_equal_reduceat_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 140, 12).tolist() + [1, 2, 7, 8, 9, 16, 17, 129, 130, 300]  # 130+: reduceat itself
    rows = sum(sizes)
    sk = (rng.standard_normal((rows, 33)) * 10.0 ** rng.integers(-6, 6, (rows, 1))).astype(np.float32)
    sk[rng.random(sk.shape) < 0.05] = -0.0
    if seed == 0:
        sk[3, 4], sk[40, 5], sk[41, 5] = np.inf, np.float32(3e38), np.float32(3e38)  # overflow and inf as numpy
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    want = np.add.reduceat(sk, starts, axis=0)
    got = np.array(_row_sums(sk, starts))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
