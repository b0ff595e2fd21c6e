"""Float blocks converted between dtypes without torch (storage/convert.py, used for the blocks a merge copies
from the base into another output dtype) give torch's ``.to`` bytes: round to nearest even, overflow to Inf,
float64 to bf16/fp16 through float32 as torch does; NaN stays NaN (its payload may differ: such a block is
refused, never published)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergepipe.engine.blocks import converted_block
from mergepipe.errors import ExecutionError
from mergepipe.storage.base import TensorInfo
from mergepipe.storage.convert import convert
from mergepipe.storage.grid import BlockSpan

TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
PAIRS = [(s, d) for s in TORCH for d in TORCH if s != d]


def torch_bytes(raw: bytes, src: str, dst: str) -> np.ndarray:
    t = torch.frombuffer(bytearray(raw), dtype=TORCH[src]).to(TORCH[dst])
    return t.contiguous().view(torch.uint8).numpy()


def same_but_nan(got: np.ndarray, ref: np.ndarray, dst: str) -> None:
    words = {8: np.uint64, 4: np.uint32, 2: np.uint16}[SIZE[dst]]
    g, r = got.view(words), ref.view(words)
    nan = torch.frombuffer(bytearray(ref.tobytes()), dtype=TORCH[dst]).isnan().numpy()
    assert np.array_equal(g[~nan], r[~nan])
    assert torch.frombuffer(bytearray(got.tobytes()), dtype=TORCH[dst]).isnan().numpy()[nan].all()


@pytest.mark.parametrize("src, dst", PAIRS)
def test_every_bit_pattern_class_converts_as_torch(src, dst):
    rng = np.random.default_rng(len(src) * 7 + len(dst))
    raw = rng.integers(0, 256, 50_000 * SIZE[src], dtype=np.uint8).tobytes()  # every class: subnormal, Inf, NaN
    same_but_nan(convert(raw, src, dst), torch_bytes(raw, src, dst), dst)


@pytest.mark.parametrize("src, dst", PAIRS)
def test_values_at_the_rounding_boundaries_convert_as_torch(src, dst):
    """Values half way between two representable numbers of ``dst`` (ties to even), a hair either side, and
    values near the top of fp16's range (overflow to Inf)."""
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(200_000) * rng.choice([1e-6, 1e-3, 1.0, 300.0, 6e4], 200_000)).astype(np.float32)
    u = v.view(np.uint32)
    halfway = {"F16": (0x1FFF, 0x1000), "BF16": (0xFFFF, 0x8000)}.get(dst, (0, 0))
    u[::2] = (u[::2] & ~np.uint32(halfway[0])) | np.uint32(halfway[1])
    x = u.view(np.float32).astype(np.float64)
    x[1::4] += np.abs(x[1::4]) * 2.0 ** -40  # float64 just off the tie: rounded twice through float32, as torch
    t = torch.from_numpy(x).to(TORCH[src])
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    same_but_nan(convert(raw, src, dst), torch_bytes(raw, src, dst), dst)


def test_converted_block_refuses_an_overflow_and_converts_the_rest():
    info = TensorInfo(name="w", dtype="BF16", shape=(2, 3), file="m.safetensors", offset=0, nbytes=12)
    span = BlockSpan(index=0, row_start=0, row_end=2, rel_offset=0, nbytes=12)
    ok = torch.tensor([[1.0, -2.5, 3e-3], [0.0, -0.0, 65000.0]], dtype=torch.bfloat16)
    raw = ok.view(torch.uint8).numpy().tobytes()
    got = bytes(converted_block(info, span, raw, "F16"))
    assert got == ok.to(torch.float16).view(torch.uint8).numpy().tobytes()
    big = torch.tensor([[1.0, 7e4, 0.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(ExecutionError, match="non-finite"):
        converted_block(info, span, big, "F16")
