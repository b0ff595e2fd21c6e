"""The compiled loops of the fused block kernels (numba); ``ops/kernels.py`` holds their Python entry
points and describes the arithmetic (float32, operation for operation as the torch path).

Every jitted function the cached kernels inline lives in this one file: numba's on-disk cache keys a
kernel by its own file only, so a helper edited in another file would leave the kernels compiled from
it stale. The pieces: the raw elements (load, store), the counter-based random stream, the float64 L1
norm in a fixed lane order, one expert's weighted sparsified delta, DARE's per-block L1 sums
(``random_l1``), the merge of one block (``merge_block``) and the incremental merge's affine step.
"""

from __future__ import annotations

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy; before any @njit)
import numba
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

CHUNK = 2048  # elements per chunk; divides 2**32
LANES = 256  # float64 partial sums of abs_sum64: element i goes to lane i % LANES; divides CHUNK

# element codes of the raw buffers the kernel reads and writes
BF16, F32 = 0, 1
CODES = {"BF16": BF16, "F32": F32}
# per-expert sparsification (MASKED: a keep mask computed beforehand, ops/kernel_masks.py)
KEEP_ALL, MAGNITUDE, RANDOM, MASKED = 0, 1, 2, 3

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
def _weighted_delta(addr, code, n, start, m, sub, kind, w, thr, ties, k, dens, ratio, use_ratio, k1, k2, wd, acc,
                    mask):
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
    elif kind == MASKED:
        mk = mask[start:start + m]
        for j in range(m):
            kept = (v[j] - bs[j]) * (one if mk[j] else zero)
            x = w * (kept * ratio if use_ratio else kept)
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


# --- the merge of one block --------------------------------------------------------------------------------
@njit(inline="always")
def _elect_and_merge(a, r, sg, dv, wds, weights, K, m, normalize):
    """TIES on one chunk: per entry, the sign of the weighted sum ``a`` is elected and r = the sum of the
    weighted deltas that agree with it, divided by their weights' sum when ``normalize`` (``a``, ``sg``
    and ``dv`` are scratch)."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
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


@njit(inline="always")
def _weighted_sum(a, r, bb, m, normalize, divisor, scale_base, base_scale):
    """The additive operators on one chunk: r = the weighted sum ``a``, divided by ``divisor`` when
    ``normalize``; the base chunk ``bb`` scaled by ``base_scale`` when ``scale_base``."""
    for j in range(m):
        r[j] = a[j]
    if scale_base:
        for j in range(m):
            bb[j] = bb[j] * base_scale
    if normalize:
        for j in range(m):
            r[j] = r[j] / divisor


@njit(inline="always")
def _add_to_base(r, bb, m, lam, lam_is_one):
    """r = base + lambda * r on one chunk."""
    if lam_is_one:
        for j in range(m):
            r[j] = bb[j] + r[j]
    else:
        for j in range(m):
            r[j] = bb[j] + r[j] * lam


@njit(nogil=True, cache=True, error_model="numpy")
def merge_block(base_addr, base_code, out_addr, out_code, n, addrs, codes, is_delta, kinds, weights, thrs, ties,
                denss, ratios, use_ratio, k1s, k2s, consensus, normalize, lam, lam_is_one, divisor, scale_base,
                base_scale, masks):
    """Merge one block of ``n`` elements into the raw output buffer at ``out_addr``.

    Per expert k (in contribution order): raw buffer ``addrs[k]`` of element code ``codes[k]``, delta
    (``is_delta[k]``) or full checkpoint, sparsification ``kinds[k]`` with threshold ``thrs[k]`` or keep
    density ``denss[k]`` and rescale ``ratios[k]`` (when ``use_ratio[k]``), weight ``weights[k]``, random
    stream keys ``k1s[k], k2s[k]``, keep mask ``masks[k]`` (MASKED). ``consensus``: TIES sign election and disjoint merge (divisor of
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
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _load(base_addr, base_code, n, start, m, base)
        a = acc[:m]
        for j in range(m):
            a[j] = zero
        for k in range(K):
            _weighted_delta(addrs[k], codes[k], n, start, m, zeros if is_delta[k] else base, kinds[k], weights[k],
                            thrs[k], ties, k, denss[k], ratios[k], use_ratio[k], k1s[k], k2s[k],
                            wds[k if consensus else 0], acc, masks[k])
        bb = base[:m]
        r = res[:m]
        if consensus:
            _elect_and_merge(a, r, sign[:m], div[:m], wds, weights, K, m, normalize)
        else:
            _weighted_sum(a, r, bb, m, normalize, divisor, scale_base, base_scale)
        _add_to_base(r, bb, m, lam, lam_is_one)
        _store(out_addr, out_code, n, start, m, res)


# --- the incremental merge's affine step ---------------------------------------------------------------------
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
