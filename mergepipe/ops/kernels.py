"""Fused block kernels (numba): the hot paths of ``ops.sparsify`` + ``ops.combine`` in one pass.

The torch path of the engine builds, per block and per expert, a float32 delta, a sparsified copy, a
weighted copy and masks: several full-size float32 temporaries per expert, which is both the compute
cost and why memory grew with K. The kernels here walk the block in chunks of ``CHUNK`` elements (a
few KiB, so every intermediate stays in L1) and, per chunk, go over the K experts' raw bytes (bf16 or
fp32) directly: delta, threshold / random mask, L1 rescale, weight, sum, elected sign, agreeing
magnitude, divisor, lambda, base, and the conversion back to the base's dtype. Nothing K-sized is
materialised.

The arithmetic repeats the torch path operation for operation in float32 (scalars rounded to float32
as torch does for Python numbers, the same order of additions, no fused multiply-add: numba does not
contract without fastmath), so the output is bit-identical to ``ops.sparsify`` + ``ops.combine``;
``tests/ops/test_kernels.py`` checks that on random inputs.

Two pieces are shared with the torch path and the full-read reference rather than duplicated:
``uniform`` (the counter-based random stream of DARE/DELLA: a hash of (block seed, element index))
and ``abs_sum64`` (the float64 L1 norm of DARE's per-block rescale, summed in a fixed lane order).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

from mergepipe.ops.spec import Sparsify

CHUNK = 2048  # elements per chunk; divides 2**32
LANES = 256  # float64 partial sums of abs_sum64: element i goes to lane i % LANES; divides CHUNK

# element codes of the raw buffers the kernel reads and writes
BF16, F32 = 0, 1
CODES = {"BF16": BF16, "F32": F32}
# per-expert sparsification
KEEP_ALL, MAGNITUDE, RANDOM = 0, 1, 2

_INV24 = np.float32(1.0 / (1 << 24))


@intrinsic
def _voidptr(typingctx, addr):
    sig = types.voidptr(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


# --- the counter-based random stream ---------------------------------------------------------------
# 32-bit integer arithmetic written in LLVM IR: numba types uint32 * uint32 as uint64, which keeps
# LLVM from using 8-lane 32-bit vector multiplies (measured 3x slower).
def _c32(n: int):
    return ir.Constant(ir.IntType(32), n)


@intrinsic
def _mix32(typingctx, x):
    """Chris Wellons' two-multiply 32-bit integer hash ("lowbias32", improved constants)."""
    sig = types.uint32(types.uint32)

    def codegen(context, builder, signature, args):
        v = args[0]
        v = builder.xor(v, builder.lshr(v, _c32(16)))
        v = builder.mul(v, _c32(0x21F0AAAD))
        v = builder.xor(v, builder.lshr(v, _c32(15)))
        v = builder.mul(v, _c32(0x735A2D97))
        return builder.xor(v, builder.lshr(v, _c32(15)))

    return sig, codegen


@intrinsic
def _add32(typingctx, a, b):
    sig = types.uint32(types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        return builder.add(args[0], args[1])

    return sig, codegen


@intrinsic
def _mul32(typingctx, a, b):
    sig = types.uint32(types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        return builder.mul(args[0], args[1])

    return sig, codegen


@njit(inline="always")
def _stream_hi(start, k2):
    """The per-run part of element ``start``'s key: k2 + (start >> 32) * golden (mod 2**32)."""
    return _add32(k2, np.uint32((np.uint64(start) >> np.uint64(32)) * np.uint64(0x9E3779B9) & np.uint64(0xFFFFFFFF)))


@njit(inline="always")
def _u01(lo, k1, hi):
    """float32 in [0, 1), a multiple of 2**-24, for the element whose index has low 32 bits ``lo``
    (and high bits folded into ``hi`` by _stream_hi): mix32(lo * k1 + hi) >> 8, scaled, with k1 odd:
    the block's 63-bit seed picks one of 2**62 affine progressions, hashed."""
    x = _mix32(_add32(_mul32(lo, k1), hi))
    return np.float32(np.int32(x >> np.uint32(8))) * _INV24


def seed_keys(seed: int) -> tuple[np.uint32, np.uint32]:
    seed = int(seed) & ((1 << 64) - 1)
    return np.uint32((seed & 0xFFFFFFFF) | 1), np.uint32(seed >> 32)


@njit(nogil=True, cache=True, error_model="numpy")
def _fill_uniform(out, k1, k2):
    n = out.size
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        hi = _stream_hi(start, k2)
        lo0 = np.uint32(np.uint64(start) & np.uint64(0xFFFFFFFF))
        o = out[start:start + m]
        for j in range(m):
            o[j] = _u01(_add32(lo0, np.uint32(j)), k1, hi)


def uniform_array(seed: int, n: int) -> np.ndarray:
    """The first ``n`` values of the random stream of ``seed`` (float32, in [0, 1))."""
    out = np.empty(n, np.float32)
    k1, k2 = seed_keys(seed)
    _fill_uniform(out, k1, k2)
    return out


# --- float64 L1 norm in a fixed order ----------------------------------------------------------------
@njit(inline="always")
def _reduce_lanes(lanes):
    s = 0.0
    for j in range(LANES):
        s += lanes[j]
    return s


@njit(inline="always")
def _add_abs(lanes, a, m):
    """lanes[i % LANES] += |a[i]| for i < m, a chunk that starts at a multiple of LANES (an elementwise
    float64 accumulation vectorizes; a reduction in a fixed order would not)."""
    for j0 in range(0, m, LANES):
        aa = a[j0:min(m, j0 + LANES)]
        for j in range(aa.size):
            lanes[j] = lanes[j] + np.float64(abs(aa[j]))


@njit(nogil=True, cache=True, error_model="numpy")
def _abs_sum64(a):
    lanes = np.zeros(LANES, np.float64)
    n = a.size
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _add_abs(lanes, a[start:start + m], m)
    return _reduce_lanes(lanes)


def abs_sum64(a: np.ndarray) -> float:
    """sum(|a|) of a float32 array in float64: element i into lane i % LANES, then the lanes in order.
    The order is fixed, so the fused kernel (which sums chunk by chunk) gets the same bits."""
    return float(_abs_sum64(np.ascontiguousarray(a, dtype=np.float32).reshape(-1)))


# --- loading and storing raw elements ------------------------------------------------------------------
@njit(inline="always")
def _load(addr, code, n, start, m, out):
    """out[:m] = float32 elements [start, start + m) of the raw buffer at ``addr``."""
    if code == BF16:
        src = numba.carray(_voidptr(addr), (n,), np.uint16)[start:start + m]
        bits = out.view(np.uint32)[:m]
        for j in range(m):
            bits[j] = np.uint32(src[j]) << np.uint32(16)
    else:
        src32 = numba.carray(_voidptr(addr), (n,), np.float32)[start:start + m]
        o = out[:m]
        for j in range(m):
            o[j] = src32[j]


@njit(inline="always")
def _store(addr, code, n, start, m, vals):
    if code == BF16:
        dst = numba.carray(_voidptr(addr), (n,), np.uint16)[start:start + m]
        bits = vals.view(np.uint32)[:m]
        for j in range(m):
            b = bits[j]
            # round to nearest even; NaN -> quiet NaN as torch's scalar conversion
            r = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
            dst[j] = np.uint16(0x7FC0) if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r
    else:
        dst32 = numba.carray(_voidptr(addr), (n,), np.float32)[start:start + m]
        v = vals[:m]
        for j in range(m):
            dst32[j] = v[j]


@njit(inline="always")
def _weighted_delta(addr, code, n, start, m, sub, kind, w, thr, ties, k, dens, ratio, use_ratio, k1, k2, wd, acc):
    """wd[:m] = w * sparsify(delta) for elements [start, start + m) of one expert, and acc += wd, with
    the operations of ops.sparsify then ``w * d`` (float32, same order). delta = x - sub, where ``sub``
    is the base chunk for a full checkpoint and zeros for a stored delta (x - (+0.0) == x exactly)."""
    _load(addr, code, n, start, m, wd)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    v = wd[:m]
    a = acc[:m]
    bs = sub[:m]
    if kind == MAGNITUDE:
        for j in range(m):
            d = v[j] - bs[j]
            ad = abs(d)
            keep = ad > thr
            if ad == thr:  # exact k: the block's first ties[k] tied entries (C order) are in the top k
                keep = ties[k] > 0
                ties[k] -= 1
            x = w * (d * (one if keep else zero))  # delta * mask: -0.0 where a negative is dropped
            v[j] = x
            a[j] = a[j] + x
    elif kind == RANDOM:
        hi = _stream_hi(start, k2)
        lo0 = np.uint32(np.uint64(start) & np.uint64(0xFFFFFFFF))  # start: a multiple of CHUNK, no carry
        if use_ratio:
            for j in range(m):
                d = v[j] - bs[j]
                x = w * ((d * (one if _u01(_add32(lo0, np.uint32(j)), k1, hi) < dens else zero)) * ratio)
                v[j] = x
                a[j] = a[j] + x
        else:
            for j in range(m):
                d = v[j] - bs[j]
                x = w * (d * (one if _u01(_add32(lo0, np.uint32(j)), k1, hi) < dens else zero))
                v[j] = x
                a[j] = a[j] + x
    else:
        for j in range(m):
            x = w * (v[j] - bs[j])
            v[j] = x
            a[j] = a[j] + x


@njit(nogil=True, cache=True, error_model="numpy")
def random_l1(base_addr, base_code, n, addrs, codes, is_delta, kinds, denss, k1s, k2s):
    """Per expert with kinds[k] == RANDOM: (sum |delta|, sum |kept delta|) of the block under DARE's
    random mask, in float64 in the lane order of abs_sum64 (ops.l1_ratio's two sums, bit for bit).
    One pass over the block: the base chunk is loaded once for all experts."""
    K = addrs.size
    org = np.zeros((K, LANES), np.float64)
    new = np.zeros((K, LANES), np.float64)
    b = np.empty(CHUNK, np.float32)
    zeros = np.zeros(CHUNK, np.float32)
    d = np.empty(CHUNK, np.float32)
    kept = np.empty(CHUNK, np.float32)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _load(base_addr, base_code, n, start, m, b)
        hi0 = np.uint32(np.uint64(start) & np.uint64(0xFFFFFFFF))
        for k in range(K):
            if kinds[k] != RANDOM:
                continue
            _load(addrs[k], codes[k], n, start, m, d)
            hi = _stream_hi(start, k2s[k])
            k1 = k1s[k]
            dens = denss[k]
            sub = zeros[:m] if is_delta[k] else b[:m]
            dd = d[:m]
            kk = kept[:m]
            for j in range(m):
                x = dd[j] - sub[j]
                dd[j] = x
                kk[j] = x * (one if _u01(_add32(hi0, np.uint32(j)), k1, hi) < dens else zero)
            _add_abs(org[k], d, m)
            _add_abs(new[k], kept, m)
    orgs = np.empty(K, np.float64)
    news = np.empty(K, np.float64)
    for k in range(K):
        orgs[k] = _reduce_lanes(org[k])
        news[k] = _reduce_lanes(new[k])
    return orgs, news


@njit(nogil=True, cache=True, error_model="numpy")
def merge_block(base_addr, base_code, out_addr, out_code, n, addrs, codes, is_delta, kinds, weights, thrs, ties,
                denss, ratios, use_ratio, k1s, k2s, consensus, normalize, lam, lam_is_one, divisor, scale_base,
                base_scale):
    """Merge one block of ``n`` elements into the raw output buffer at ``out_addr``.

    Per expert k (in contribution order): raw buffer ``addrs[k]`` of element code ``codes[k]``, delta
    (``is_delta[k]``) or full checkpoint, sparsification ``kinds[k]`` with threshold ``thrs[k]`` or keep
    density ``denss[k]`` and rescale ``ratios[k]`` (when ``use_ratio[k]``), weight ``weights[k]``, random
    stream keys ``k1s[k], k2s[k]``. ``consensus``: TIES sign election and disjoint merge (divisor of
    agreeing weights when ``normalize``); else a weighted sum divided by ``divisor`` when ``normalize``,
    with the base scaled by ``base_scale`` when ``scale_base`` (linear without normalize).
    Scratch: a few chunks, plus K chunks of weighted deltas with consensus (K * 8 KiB)."""
    K = addrs.size
    base = np.empty(CHUNK, np.float32)
    zeros = np.zeros(CHUNK, np.float32)
    acc = np.empty(CHUNK, np.float32)
    sign = np.empty(CHUNK, np.float32)
    div = np.empty(CHUNK, np.float32)
    res = np.empty(CHUNK, np.float32)
    wds = np.empty((K if consensus else 1, CHUNK), np.float32)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _load(base_addr, base_code, n, start, m, base)
        a = acc[:m]
        for j in range(m):
            a[j] = zero
        for k in range(K):
            _weighted_delta(addrs[k], codes[k], n, start, m, zeros if is_delta[k] else base, kinds[k], weights[k],
                            thrs[k], ties, k, denss[k], ratios[k], use_ratio[k], k1s[k], k2s[k],
                            wds[k if consensus else 0], acc)
        bb = base[:m]
        r = res[:m]
        if consensus:
            sg = sign[:m]
            dv = div[:m]
            for j in range(m):
                sg[j] = one if a[j] >= zero else -one  # a zero sum elects +
                a[j] = zero  # from here on: the magnitude of the agreeing entries
                dv[j] = zero
            for k in range(K):
                v = wds[k][:m]
                w = weights[k]
                for j in range(m):
                    x = v[j] * sg[j]
                    agree = x > zero
                    a[j] = a[j] + (x if agree else zero)
                    dv[j] = dv[j] + (w if agree else zero)
            for j in range(m):
                r[j] = a[j] * sg[j]
            if normalize:
                for j in range(m):
                    r[j] = r[j] / (one if dv[j] == zero else dv[j])
        else:
            for j in range(m):
                r[j] = a[j]
            if scale_base:
                for j in range(m):
                    bb[j] = bb[j] * base_scale
            if normalize:
                for j in range(m):
                    r[j] = r[j] / divisor
        if lam_is_one:
            for j in range(m):
                r[j] = bb[j] + r[j]
        else:
            for j in range(m):
                r[j] = bb[j] + r[j] * lam
        _store(out_addr, out_code, n, start, m, res)


@njit(nogil=True, cache=True, error_model="numpy")
def _affine_bf16(out_addr, n, s_addr, a, scale_s, x_addr, x_code, b, has_x, base_addr, g, has_base):
    """out = bf16(a*s + b*x + g*base) over ``n`` bf16 elements, in float32, operation by operation as
    the torch path (each product and sum rounded to float32, no fused multiply-add)."""
    r = np.empty(CHUNK, np.float32)
    t = np.empty(CHUNK, np.float32)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _load(s_addr, BF16, n, start, m, r)
        rr = r[:m]
        tt = t[:m]
        if scale_s:
            for j in range(m):
                rr[j] = rr[j] * a
        if has_x:
            _load(x_addr, x_code, n, start, m, t)
            for j in range(m):
                rr[j] = rr[j] + tt[j] * b
        if has_base:
            _load(base_addr, BF16, n, start, m, t)
            for j in range(m):
                rr[j] = rr[j] + tt[j] * g
        _store(out_addr, BF16, n, start, m, r)


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


# --- the Python entry point ------------------------------------------------------------------------------
FUSED_SPARSIFY = (None, Sparsify.MAGNITUDE, Sparsify.RANDOM)
_ITEMSIZE = {BF16: 2, F32: 4}


def _address(raw, itemsize: int, keep: list) -> int:
    arr = np.frombuffer(raw, dtype=np.uint8)
    if arr.ctypes.data % itemsize:
        arr = arr.copy()  # an unaligned view (never seen in practice): copy rather than misread
    keep.append(arr)
    return arr.ctypes.data


def fused_merge(spec, params: dict, base_raw, base_dtype: str, n: int, contributions: list, weight_sum: float,
                block: int = 0):
    """Merge one block with the fused kernel, or return None when it does not apply (then the caller
    uses the torch path of ops.sparsify + ops.combine, which the kernel reproduces bit for bit).

    ``contributions``: per contributing expert, in order, ``(raw, dtype, is_delta, weight, density,
    thresholds, seed)``: the expert block's raw bytes and safetensors dtype code, whether they are a
    stored delta (else a full checkpoint: delta = expert - base), its weight and density for this
    tensor, the catalog statistics of the tensor (TIES: threshold, L1 ratio, exact-k cut) and the block's
    random seed; ``block``: the block's index in the grid (the exact-k cut). Returns a uint8 array
    of the merged block in the base's dtype."""
    if spec.sparsify not in FUSED_SPARSIFY or base_dtype not in CODES or not contributions:
        return None
    base_code = CODES[base_dtype]
    if len(base_raw) != n * _ITEMSIZE[base_code]:
        return None
    K = len(contributions)
    keep: list = []
    base_addr = _address(base_raw, _ITEMSIZE[base_code], keep)
    addrs = np.empty(K, np.int64)
    codes = np.empty(K, np.int64)
    is_delta = np.zeros(K, np.bool_)
    kinds = np.zeros(K, np.int64)
    weights = np.empty(K, np.float32)
    thrs = np.zeros(K, np.float32)
    ties = np.full(K, n, np.int64)  # entries tied at the threshold this block keeps (exact k; all: n)
    denss = np.ones(K, np.float32)
    ratios = np.ones(K, np.float32)
    use_ratio = np.zeros(K, np.bool_)
    k1s = np.zeros(K, np.uint32)
    k2s = np.zeros(K, np.uint32)
    for k, (raw, dtype, delta_kind, weight, density, thresholds, seed) in enumerate(contributions):
        if dtype not in CODES or weight is None:
            return None
        code = CODES[dtype]
        if len(raw) != n * _ITEMSIZE[code]:
            return None
        addrs[k] = _address(raw, _ITEMSIZE[code], keep)
        codes[k] = code
        is_delta[k] = bool(delta_kind)
        weights[k] = np.float32(weight)  # torch rounds a Python scalar to the tensor's dtype
        if spec.sparsify is None or density >= 1.0:
            kinds[k] = KEEP_ALL
        elif spec.sparsify is Sparsify.MAGNITUDE:
            if not thresholds or (len(thresholds) > 1 and thresholds[1] != 1.0):
                return None  # TIES with its per-tensor L1 rescale: the torch path
            kinds[k] = MAGNITUDE
            thrs[k] = np.float32(thresholds[0])
            if len(thresholds) > 3:  # the exact-k cut (cut_block, cut_rank): ops.ties.top_mask
                cut_block, cut_rank = int(thresholds[2]), int(thresholds[3])
                ties[k] = n if block < cut_block else (cut_rank if block == cut_block else 0)
        else:
            kinds[k] = RANDOM
            denss[k] = np.float32(density)
            k1s[k], k2s[k] = seed_keys(seed)
    if spec.sparsify is Sparsify.RANDOM and params["rescale"] and (kinds == RANDOM).any():
        orgs, news = random_l1(base_addr, base_code, n, addrs, codes, is_delta, kinds, denss, k1s, k2s)
        for k in range(K):
            org, new = float(orgs[k]), float(news[k])
            if kinds[k] == RANDOM and org >= 1e-8 and new >= 1e-8:  # as ops.l1_ratio
                ratios[k] = np.float32(org / new)
                use_ratio[k] = True
    lam = float(params["lambda"])
    normalize = bool(params["normalize"])
    divisor = weight_sum if abs(weight_sum) >= 1e-8 else 1.0
    scale_base = bool(spec.whole_models and not normalize)
    out = np.empty(n * _ITEMSIZE[base_code], np.uint8)
    merge_block(base_addr, base_code, out.ctypes.data, base_code, n, addrs, codes, is_delta, kinds, weights, thrs, ties,
                denss, ratios, use_ratio, k1s, k2s, bool(spec.consensus), normalize, np.float32(lam), lam == 1,
                np.float32(divisor), scale_base, np.float32(weight_sum))
    del keep
    return out


# --- the output guard -------------------------------------------------------------------------------------
# (unsigned view, exponent mask, largest finite value) per output dtype: an element is Inf or NaN exactly
# when its exponent bits are all ones
_FLOAT_BITS = {"BF16": (np.uint16, 0x7F80, 3.3895313892515355e38), "F16": (np.uint16, 0x7C00, 65504.0),
               "F32": (np.uint32, 0x7F800000, 3.4028234663852886e38),
               "F64": (np.uint64, 0x7FF0000000000000, 1.7976931348623157e308)}


@njit(nogil=True, cache=True)
def _count_exp_all_ones(bits, mask):
    n = 0
    for i in range(bits.size):
        n += (bits[i] & mask) == mask
    return n


def _bits(raw, dtype: str) -> np.ndarray:
    view, _, _ = _FLOAT_BITS[dtype]
    arr = np.frombuffer(raw, dtype=np.uint8)
    if arr.ctypes.data % np.dtype(view).itemsize:
        arr = arr.copy()
    return arr.view(view)


def nonfinite_count(raw, dtype: str) -> int:
    """NaN and Inf elements of a raw block in safetensors dtype ``dtype`` (0 for non-float dtypes): one
    compiled pass over the block's output bytes, so it also sees a finite float32 result that overflowed
    to Inf when it was rounded to bf16 or fp16."""
    spec = _FLOAT_BITS.get(dtype)
    if spec is None:
        return 0
    return int(_count_exp_all_ones(_bits(raw, dtype), spec[0](spec[1])))


def nonfinite_kinds(raw, dtype: str) -> tuple[int, int, float]:
    """(NaN count, Inf count, largest finite value of the dtype) of a raw block (for error messages)."""
    view, mask, largest = _FLOAT_BITS[dtype]
    bits = _bits(raw, dtype)
    sign = view(1) << view(8 * np.dtype(view).itemsize - 1)
    mag = bits & ~sign
    return int((mag > view(mask)).sum()), int((mag == view(mask)).sum()), largest


def warm_up() -> None:
    """Load (or compile, on a cold cache) the kernels the engine calls, on a tiny block."""
    from types import SimpleNamespace
    raw = bytes(2 * LANES)
    for sparsify, consensus in ((None, False), ("magnitude", True), ("random", True)):
        spec = SimpleNamespace(sparsify=sparsify, consensus=consensus, whole_models=False)
        params = {"normalize": True, "rescale": True, "lambda": 1.0}
        fused_merge(spec, params, raw, "BF16", LANES, [(raw, "BF16", False, 1.0, 0.5, [0.0], 1)], 1.0)
    uniform_array(1, LANES)
    affine_bf16(raw, 2.0, raw, "BF16", 1.0, raw, -1.0)
    for dtype in _FLOAT_BITS:
        nonfinite_count(raw, dtype)
    abs_sum64(np.zeros(LANES, np.float32))
