"""Fused block kernels (numba): the hot paths of ``ops.sparsify`` + ``ops.combine`` in one pass.

The torch path of the engine builds, per block and per expert, a float32 delta, a sparsified copy, a
weighted copy and masks: several full-size float32 temporaries per expert, which is both the compute
cost and why memory grew with K. The kernels here walk the block in chunks of ``CHUNK`` elements (a
few KiB, so every intermediate stays in L1) and, per chunk, go over the K experts' raw bytes (bf16 or
fp32) directly: delta, threshold / random mask (or a keep mask computed beforehand: breadcrumbs and DELLA,
ops/kernel_masks.py), L1 rescale, weight, sum, elected sign, agreeing
magnitude, divisor, lambda, base, and the conversion to the output dtype (the base's, or bf16/fp32 when
the plan converts). Nothing K-sized is materialised.

The arithmetic repeats the torch path operation for operation in float32 (scalars rounded to float32
as torch does for Python numbers, the same order of additions, no fused multiply-add: numba does not
contract without fastmath), so the output is bit-identical to ``ops.sparsify`` + ``ops.combine``;
``tests/ops/test_kernels.py`` checks that on random inputs.

Two pieces are shared with the torch path and the full-read reference rather than duplicated:
``uniform`` (the counter-based random stream of DARE/DELLA: a hash of (block seed, element index))
and ``abs_sum64`` (the float64 L1 norm of DARE's per-block rescale, summed in a fixed lane order).

This module holds the Python entry points; the compiled loops are in ``ops/kernel_loops.py`` and the
output guard (NaN/Inf counts of a block) in ``ops/nonfinite.py``, whose names it re-exports.
"""

from __future__ import annotations

import numpy as np

from mergepipe.ops.kernel_loops import (  # noqa: F401
    BF16, CHUNK, CODES, F32, KEEP_ALL, LANES, MAGNITUDE, MASKED, RANDOM, _abs_sum64, _affine_bf16, _fill_uniform,
    merge_block, random_l1, seed_keys,
)
from mergepipe.ops.kernel_masks import MASKED_SPARSIFY, floats, keep_mask
from mergepipe.ops.nonfinite import FLOAT_BITS, nonfinite_count, nonfinite_kinds  # noqa: F401
from mergepipe.ops.spec import Sparsify

FUSED_SPARSIFY = (None, Sparsify.MAGNITUDE, Sparsify.RANDOM, *MASKED_SPARSIFY)
_ITEMSIZE = {BF16: 2, F32: 4}


def uniform_array(seed: int, n: int) -> np.ndarray:
    """The first ``n`` values of the random stream of ``seed`` (float32, in [0, 1))."""
    out = np.empty(n, np.float32)
    k1, k2 = seed_keys(seed)
    _fill_uniform(out, k1, k2)
    return out


def abs_sum64(a: np.ndarray) -> float:
    """sum(|a|) of a float32 array in float64: element i into lane i % LANES, then the lanes in order.
    The order is fixed, so the fused kernel (which sums chunk by chunk) gets the same bits."""
    return float(_abs_sum64(np.ascontiguousarray(a, dtype=np.float32).reshape(-1)))


def affine_bf16(snap_raw, a: float, x_raw, x_dtype: str, b: float, base_raw, g: float) -> np.ndarray | None:
    """``bf16(a*snap + b*x + g*base)`` of raw bf16 blocks (``x_raw``/``base_raw`` may be None: left
    out), as a uint8 array; None when a buffer does not fit the kernel (then the torch path)."""
    n = len(snap_raw) // 2
    if x_raw is not None and (x_dtype not in CODES or len(x_raw) != n * _ITEMSIZE[CODES[x_dtype]]):
        return None
    if base_raw is not None and len(base_raw) != 2 * n:
        return None
    keep: list = []
    s_addr = _address(snap_raw, 2, keep)
    x_addr = _address(x_raw, _ITEMSIZE[CODES[x_dtype]], keep) if x_raw is not None else s_addr
    base_addr = _address(base_raw, 2, keep) if base_raw is not None else s_addr
    out = np.empty(2 * n, np.uint8)
    _affine_bf16(out.ctypes.data, n, s_addr, np.float32(a), a != 1, x_addr,
                 CODES[x_dtype] if x_raw is not None else BF16, np.float32(b), x_raw is not None,
                 base_addr, np.float32(g), base_raw is not None)
    del keep
    return out


def _address(raw, itemsize: int, keep: list) -> int:
    arr = np.frombuffer(raw, dtype=np.uint8)
    if arr.ctypes.data % itemsize:
        arr = arr.copy()  # an unaligned view (never seen in practice): copy rather than misread
    keep.append(arr)
    return arr.ctypes.data


# --- the fused merge -------------------------------------------------------------------------------------
class _ExpertArrays:
    """merge_block's per-expert arguments, one array each."""

    def __init__(self, K: int, n: int):
        self.addrs = np.empty(K, np.int64)
        self.codes = np.empty(K, np.int64)
        self.is_delta = np.zeros(K, np.bool_)
        self.kinds = np.zeros(K, np.int64)
        self.weights = np.empty(K, np.float32)
        self.thrs = np.zeros(K, np.float32)
        self.ties = np.full(K, n, np.int64)  # entries tied at the threshold this block keeps (exact k; all: n)
        self.denss = np.ones(K, np.float32)
        self.ratios = np.ones(K, np.float32)
        self.use_ratio = np.zeros(K, np.bool_)
        self.k1s = np.zeros(K, np.uint32)
        self.k2s = np.zeros(K, np.uint32)
        self.masks = np.zeros((K, 0), np.bool_)  # (K, n) once an expert's mask is computed beforehand


def _expert_arrays(spec, params: dict, n: int, contributions: list, block: int, keep: list, base: tuple,
                   row: int) -> _ExpertArrays | None:
    """The experts' arguments of merge_block from ``contributions`` (see :func:`fused_merge`), or None when
    one does not fit the kernel. ``base``: (raw, dtype) of the base block; ``row``: entries per row."""
    ex = _ExpertArrays(len(contributions), n)
    for k, (raw, dtype, delta_kind, weight, density, thresholds, seed, *own) in enumerate(contributions):
        if dtype not in CODES or weight is None:
            return None
        code = CODES[dtype]
        if len(raw) != n * _ITEMSIZE[code]:
            return None
        ex.addrs[k] = _address(raw, _ITEMSIZE[code], keep)
        ex.codes[k] = code
        ex.is_delta[k] = bool(delta_kind)
        ex.weights[k] = np.float32(weight)  # torch rounds a Python scalar to the tensor's dtype
        if spec.sparsify in MASKED_SPARSIFY and density < 1.0:
            delta = floats(raw, dtype) if delta_kind else floats(raw, dtype) - floats(*base)
            if not _set_mask(ex, k, spec, delta, density, own[0] if own else params, thresholds, seed, block, row):
                return None
        elif not _set_sparsify(ex, k, spec, n, density, thresholds, seed, block):
            return None
    return ex


def _set_mask(ex: _ExpertArrays, k: int, spec, delta, density: float, params: dict, thresholds, seed: int,
              block: int, row: int) -> bool:
    """Expert k's keep mask (breadcrumbs, DELLA: ops/kernel_masks.py) and L1 ratio; False when the kernel
    does not cover it."""
    got = keep_mask(spec.sparsify, delta, density, params, thresholds, seed, block, row)
    if got is None:
        return False
    if ex.masks.shape[1] != delta.size:
        ex.masks = np.zeros((len(ex.addrs), delta.size), np.bool_)
    ex.masks[k], ratio = got
    ex.kinds[k] = MASKED
    if ratio is not None:
        ex.ratios[k] = np.float32(ratio)
        ex.use_ratio[k] = True
    return True


def _set_sparsify(ex: _ExpertArrays, k: int, spec, n: int, density: float, thresholds, seed: int,
                  block: int) -> bool:
    """Expert k's sparsification arguments; False when the kernel does not cover it."""
    if spec.sparsify is None or density >= 1.0:
        ex.kinds[k] = KEEP_ALL
    elif spec.sparsify is Sparsify.MAGNITUDE:
        if not thresholds or (len(thresholds) > 1 and thresholds[1] != 1.0):
            return False  # TIES with its per-tensor L1 rescale: the torch path
        ex.kinds[k] = MAGNITUDE
        ex.thrs[k] = np.float32(thresholds[0])
        if len(thresholds) > 3:  # the exact-k cut (cut_block, cut_rank): ops.ties.top_mask
            cut_block, cut_rank = int(thresholds[2]), int(thresholds[3])
            ex.ties[k] = n if block < cut_block else (cut_rank if block == cut_block else 0)
    else:
        ex.kinds[k] = RANDOM
        ex.denss[k] = np.float32(density)
        ex.k1s[k], ex.k2s[k] = seed_keys(seed)
    return True


def _set_random_rescale(ex: _ExpertArrays, base_addr: int, base_code: int, n: int) -> None:
    """DARE's per-block L1 rescale of each randomly sparsified expert, as ops.l1_ratio."""
    orgs, news = random_l1(base_addr, base_code, n, ex.addrs, ex.codes, ex.is_delta, ex.kinds, ex.denss, ex.k1s,
                           ex.k2s)
    for k in range(len(ex.addrs)):
        org, new = float(orgs[k]), float(news[k])
        if ex.kinds[k] == RANDOM and org >= 1e-8 and new >= 1e-8:  # as ops.l1_ratio
            ex.ratios[k] = np.float32(org / new)
            ex.use_ratio[k] = True


def fused_merge(spec, params: dict, base_raw, base_dtype: str, n: int, contributions: list, weight_sum: float,
                block: int = 0, out_dtype: str | None = None, row: int | None = None):
    """Merge one block with the fused kernel, or return None when it does not apply (then the caller
    uses the torch path of ops.sparsify + ops.combine, which the kernel reproduces bit for bit).

    ``contributions``: per contributing expert, in order, ``(raw, dtype, is_delta, weight, density,
    thresholds, seed[, params])``: the expert block's raw bytes and safetensors dtype code, whether they are a
    stored delta (else a full checkpoint: delta = expert - base), its weight and density for this
    tensor, the catalog statistics of the tensor (TIES: threshold, L1 ratio, exact-k cut) and the block's
    random seed (and the expert's own operator parameters, DELLA's epsilon; default ``params``); ``block``: the
    block's index in the grid (the exact-k cut); ``row``: entries per row (DELLA's ranks; default n). Returns a uint8 array
    of the merged block in ``out_dtype`` (None: the base's dtype; the float32 result rounded once)."""
    out_dtype = out_dtype or base_dtype
    if spec.sparsify not in FUSED_SPARSIFY or base_dtype not in CODES or out_dtype not in CODES or not contributions:
        return None
    base_code, out_code = CODES[base_dtype], CODES[out_dtype]
    if len(base_raw) != n * _ITEMSIZE[base_code]:
        return None
    keep: list = []
    base_addr = _address(base_raw, _ITEMSIZE[base_code], keep)
    ex = _expert_arrays(spec, params, n, contributions, block, keep, (base_raw, base_dtype), row or n)
    if ex is None:
        return None
    if spec.sparsify is Sparsify.RANDOM and params["rescale"] and (ex.kinds == RANDOM).any():
        _set_random_rescale(ex, base_addr, base_code, n)
    lam = float(params["lambda"])
    normalize = bool(params["normalize"])
    divisor = weight_sum if abs(weight_sum) >= 1e-8 else 1.0
    scale_base = bool(spec.whole_models and not normalize)
    out = np.empty(n * _ITEMSIZE[out_code], np.uint8)
    merge_block(base_addr, base_code, out.ctypes.data, out_code, n, ex.addrs, ex.codes, ex.is_delta, ex.kinds,
                ex.weights, ex.thrs, ex.ties, ex.denss, ex.ratios, ex.use_ratio, ex.k1s, ex.k2s, bool(spec.consensus),
                normalize, np.float32(lam), lam == 1, np.float32(divisor), scale_base, np.float32(weight_sum),
                ex.masks)
    del keep
    return out


# --- start-up ------------------------------------------------------------------------------------------
def warm_up() -> None:
    """Load (or compile, on a cold cache) the kernels the engine calls, on a tiny block."""
    from types import SimpleNamespace
    raw = bytes(2 * LANES)
    for sparsify, consensus in ((None, False), (Sparsify.MAGNITUDE, True), (Sparsify.RANDOM, True),
                                (Sparsify.DELLA, False)):
        spec = SimpleNamespace(sparsify=sparsify, consensus=consensus, whole_models=False)
        params = {"normalize": True, "rescale": True, "lambda": 1.0, "epsilon": 0.1}
        fused_merge(spec, params, raw, "BF16", LANES, [(raw, "BF16", False, 1.0, 0.5, [0.0], 1)], 1.0)
    uniform_array(1, LANES)
    affine_bf16(raw, 2.0, raw, "BF16", 1.0, raw, -1.0)
    for dtype in FLOAT_BITS:
        nonfinite_count(raw, dtype)
    abs_sum64(np.zeros(LANES, np.float32))
