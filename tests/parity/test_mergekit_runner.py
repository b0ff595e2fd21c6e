"""The parity suite's mergekit runner works on the test families: a linear merge by mergekit equals
an independent torch computation of the same weighted average."""

from __future__ import annotations

import pytest
import torch

from mergepipe.research.family import make_family

from merge_helpers import load_dir
from mergekit_runner import mergekit_merge


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("mk") / "fam", experts=2, size="tiny", dtype="fp32",
                       shard_bytes=1 << 30, seed=2)


def test_mergekit_linear_is_the_weighted_average(fam, tmp_path):
    config = {"merge_method": "linear", "dtype": "float32",
              "models": [{"model": fam["experts"][0], "parameters": {"weight": 0.25}},
                         {"model": fam["experts"][1], "parameters": {"weight": 0.75}}]}
    out = mergekit_merge(config, tmp_path / "mk")
    a, b = load_dir(fam["experts"][0]), load_dir(fam["experts"][1])
    assert set(out) == set(a)
    for name in a:
        expected = (0.25 * a[name] + 0.75 * b[name]) / 1.0
        assert torch.allclose(out[name], expected, atol=1e-6, rtol=0), name
