"""The fused block kernels (mergepipe.ops.kernels) against the torch path (ops.sparsify + ops.combine):
bit for bit, signed zeros included, on random blocks with magnitude ties at the threshold, zeros,
negative and zero weights, normalize on/off, lambda != 1, stored deltas, mixed dtypes and tail chunks;
and the engine's output with and without the kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergepipe.ops import kernels
from mergepipe.engine.engine import Engine
from mergepipe.ops.streams import block_seed, l1_ratio, uniform
from mergepipe.ops.core import combine, get_op, resolve_params, sparsify
from mergepipe.planner.context import Planner

from merge_helpers import dir_hashes, open_copy, shared_family

TORCH = {"BF16": torch.bfloat16, "F32": torch.float32}


def torch_path(spec, params, base_raw, dtype, shape, contributions, weight_sum) -> np.ndarray:
    base = torch.frombuffer(bytearray(base_raw), dtype=TORCH[dtype]).reshape(shape).float()
    deltas = []
    for raw, edtype, is_delta, w, density, thr, seed in contributions:
        x = torch.frombuffer(bytearray(raw), dtype=TORCH[edtype]).reshape(shape)
        delta = x.float() if is_delta else torch.sub(x, base)
        deltas.append((w, sparsify(spec, delta, density, params, thr, seed)))
    merged = combine(spec, base, deltas, weight_sum, params).to(TORCH[dtype])
    return merged.contiguous().reshape(-1).view(torch.uint8).numpy()


def raw_bytes(values: np.ndarray, dtype: str) -> tuple[bytes, torch.Tensor]:
    t = torch.from_numpy(values).to(TORCH[dtype])
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), t.float()


def random_case(rng, op: str):
    spec = get_op(op)
    kw = {}
    if rng.random() < 0.5:
        kw["normalize"] = bool(rng.random() < 0.5)
    if rng.random() < 0.5:
        kw["lam"] = float(rng.choice([0.7, 1.0, 1.3]))
    if spec.rescale and rng.random() < 0.3:
        kw["rescale"] = False
    params = resolve_params(spec, **kw)
    dtype = str(rng.choice(["BF16", "F32"]))
    shape = ((int(rng.integers(1, 40)), int(rng.integers(1, 300))) if rng.random() < 0.7
             else (int(rng.integers(1, 3 * kernels.CHUNK + 7)),))
    n = int(np.prod(shape))
    base_raw, base = raw_bytes(rng.standard_normal(n).astype(np.float32), dtype)
    contributions = []
    for k in range(int(rng.integers(1, 7))):
        edtype = dtype if rng.random() < 0.8 else str(rng.choice(["BF16", "F32"]))
        is_delta = rng.random() < 0.15
        v = rng.standard_normal(n).astype(np.float32) * 0.01
        if not is_delta:
            v = base.numpy() + v
        zero = rng.random(n) < 0.05  # zero deltas
        v[zero] = 0.0 if is_delta else base.numpy()[zero]
        raw, x = raw_bytes(v, edtype)
        d = x if is_delta else x - base
        density = float(rng.choice([0.1, 0.3, 0.5, 0.7, 1.0]))
        weight = float(rng.choice([0.6, 1.3, 0.35, -0.5, 1.0, 0.0]))
        thr = []
        if spec.sparsify == "magnitude":  # an actual |delta|: entries tie with the threshold
            a = d.abs().reshape(-1)
            thr = [float(torch.topk(a, max(1, int(density * n))).values[-1])]
        contributions.append((raw, edtype, is_delta, weight, density, thr, block_seed(7, f"e{k}", "t", n)))
    weight_sum = sum(c[3] for c in contributions) + float(rng.choice([0.0, 0.5]))
    return spec, params, base_raw, dtype, shape, contributions, weight_sum


@pytest.mark.parametrize("op", ["ties", "dare_ties", "dare_linear", "linear", "task_arithmetic", "della",
                                "della_linear"])
def test_fused_kernel_equals_torch_path_bit_for_bit(op):
    rng = np.random.default_rng(sum(map(ord, op)))
    for _ in range(40):
        spec, params, base_raw, dtype, shape, contributions, weight_sum = random_case(rng, op)
        ref = torch_path(spec, params, base_raw, dtype, shape, contributions, weight_sum)
        n = int(np.prod(shape))
        row = int(np.prod(shape[1:])) if len(shape) >= 2 else n  # DELLA ranks within rows
        got = kernels.fused_merge(spec, params, base_raw, dtype, n, contributions, weight_sum, row=row)
        assert got is not None
        word = np.uint16 if dtype == "BF16" else np.uint32
        assert np.array_equal(ref.view(word), got.view(word)), (op, params, dtype, shape)


def test_fused_kernel_declines_what_it_does_not_cover():
    spec, params, base_raw, dtype, shape, contributions, ws = random_case(np.random.default_rng(0), "ties")
    n = int(np.prod(shape))
    assert kernels.fused_merge(spec, params, base_raw, dtype, n, contributions, ws, out_dtype="F16") is None
    assert kernels.fused_merge(spec, params, base_raw, "F16", n, contributions, ws) is None
    assert kernels.fused_merge(spec, params, base_raw, dtype, n, [], ws) is None
    no_thr = [c[:5] + ([],) + c[6:] for c in contributions]
    if any(c[4] < 1.0 for c in contributions):
        assert kernels.fused_merge(spec, params, base_raw, dtype, n, no_thr, ws) is None


def test_uniform_is_counter_based():
    """Element i depends on (seed, i) only: a prefix is the shorter stream, shape does not matter,
    another seed gives another stream, values lie in [0, 1) with the right mean."""
    u = uniform(123, (50_000,))
    assert u.dtype == torch.float32
    assert torch.equal(uniform(123, (7, 1000)).reshape(-1), u[:7000])
    assert torch.equal(uniform(123, (50_000,)), u)
    assert not torch.equal(uniform(124, (50_000,)), u)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float((u < 0.3).float().mean()) - 0.3) < 0.01
    # adjacent elements are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.02


def test_l1_ratio_fixed_order_sum():
    rng = np.random.default_rng(5)
    a = torch.from_numpy(rng.standard_normal(3 * kernels.CHUNK + 11).astype(np.float32))
    kept = a * (uniform(3, a.shape) < 0.4)
    ratio = l1_ratio(a, kept)
    exact = float(a.double().abs().sum() / kept.double().abs().sum())
    assert abs(ratio - exact) <= 1e-12 * exact
    assert l1_ratio(a, torch.zeros_like(a)) is None


@pytest.mark.parametrize("family", ["tiny-bf16", "tiny-fp32"])
@pytest.mark.parametrize("op, kw", [
    ("ties", dict(density=0.3)),
    ("ties", dict(density=0.3, normalize=False, lam=0.8)),
    ("dare_ties", dict(density=0.3, seed=4)),
    ("dare_linear", dict(density=0.5, seed=1, rescale=False)),
    ("linear", {}),
    ("task_arithmetic", dict(lam=0.7)),
    ("breadcrumbs", dict(density=0.3)),
    ("breadcrumbs_ties", dict(density=0.5, rescale=True)),
    ("della", dict(density=0.5, seed=2)),
    ("della_linear", dict(density=0.3, seed=1, rescale=False, epsilon=0.2)),
])
def test_engine_fused_equals_torch_path(tmp_path_factory, monkeypatch, family, op, kw):
    fam = shared_family(tmp_path_factory, family)
    used = []
    real = kernels.fused_merge

    def counting(*a, **k):
        out = real(*a, **k)
        used.append(out is not None)
        return out
    monkeypatch.setattr(kernels, "fused_merge", counting)
    d = tmp_path_factory.mktemp("fused")
    cat = open_copy(fam, d / "c.sqlite")
    try:
        plan = Planner(cat).plan("base", fam.expert_ids, op, weights=[0.6, -0.4, 1.35], budget="80%", **kw)
        Engine(cat, fused=True).execute(plan, out=d / "fused")
        assert used and all(used)  # every merged block went through the kernel
        n_fused = len(used)
        Engine(cat, fused=False).execute(plan, out=d / "torch")
        assert len(used) == n_fused
        assert dir_hashes(d / "fused", "*.safetensors") == dir_hashes(d / "torch", "*.safetensors")
    finally:
        cat.close()


# --- the incremental merge's affine kernel ------------------------------------------------------------
@pytest.mark.parametrize("a, b, g, x_dtype, with_x, with_base", [
    (1.0, 0.7, -0.7, "BF16", True, True),      # task_arithmetic extend: M + b*x - b*base
    (0.9375, 0.0625, 0.0, "BF16", True, False),  # linear extend: rescaled snapshot plus the new expert
    (1.6, 0.0, -0.3, "BF16", False, True),     # a reweight where the expert's block was not read
    (1.0, 0.25, -0.25, "F32", True, True),     # an fp32 expert folded into a bf16 merge
    (3.0, -2.0, 0.0, "BF16", True, False),     # removing 1.0 of 1.5 from a linear soup
])
def test_affine_kernel_matches_the_torch_operations_bit_for_bit(a, b, g, x_dtype, with_x, with_base):
    rng = np.random.default_rng(7)
    n = 3 * kernels.CHUNK + 123  # a tail chunk
    snap, s = raw_bytes(rng.standard_normal(n).astype(np.float32), "BF16")
    x_raw, x = raw_bytes((rng.standard_normal(n) * 0.01).astype(np.float32), x_dtype)
    base_raw, base = raw_bytes(rng.standard_normal(n).astype(np.float32), "BF16")
    expected = s * a if a != 1 else s.clone()
    if with_x:
        expected = expected + x * b
    if with_base:
        expected = expected + base * g
    expected = expected.to(torch.bfloat16).view(torch.uint16).numpy()
    got = kernels.affine_bf16(snap, a, x_raw if with_x else None, x_dtype, b, base_raw if with_base else None, g)
    assert np.array_equal(got.view(np.uint16), expected)


def test_affine_kernel_refuses_buffers_it_cannot_read():
    raw = bytes(8)
    assert kernels.affine_bf16(raw, 1.0, bytes(6), "BF16", 1.0, None, 0.0) is None  # x of another length
    assert kernels.affine_bf16(raw, 1.0, bytes(16), "F16", 1.0, None, 0.0) is None  # a dtype it does not know
    assert kernels.affine_bf16(raw, 1.0, None, "BF16", 0.0, bytes(4), 1.0) is None  # base of another length
