"""Compiled ANALYZE kernels (numba): block statistics and the radix-select passes in one loop each.

Inputs are raw tensor bytes viewed as numpy arrays, so that no float32 copy of a block is ever made: bf16 as uint16,
fp16 as int16 (the two 16-bit float types need distinct array types to dispatch), fp32 as float32, fp64 as float64
(computed in float32). ``base`` is None for a delta that is stored directly (a delta checkpoint, or a LoRA block delta
computed as float32). The delta is formed exactly as torch does (both sides widened to float32, one subtraction), so
statistics equal the torch reference bit for bit where they are exact (max, nnz, thresholds, sketches).

Non-finite deltas (NaN/Inf in the expert or the base) cost nothing extra: |d| of such an entry has an all-ones exponent,
so block_stats' histogram already counts them in its top bins (:func:`nonfinite_in_hist`, 4 x 128 counters read per
block); only a block that has some is looked at again (:func:`count_nonfinite`, to tell how many of them the base
holds).
"""

from __future__ import annotations

import mergepipe.ops.numba_setup  # noqa: F401 (numba's start-up without scipy and cffi; before any @njit)
import numpy as np
from numba import njit, types
from numba.extending import overload

HIST_BINS = 1 << 16
NONFINITE_BIN = 0x7F80  # top 16 bits of +inf; every |d| pattern at or above it is Inf or NaN
_C = dict(nogil=True, cache=True)


def to_f32(x):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@njit(**_C)
def _half_to_f32(h):
    """IEEE binary16 bits (int16) -> float32, exactly (subnormals, inf and nan included)."""
    u = np.uint32(np.uint16(h))
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    exp = (u >> np.uint32(10)) & np.uint32(0x1F)
    man = u & np.uint32(0x3FF)
    if exp == 0:
        if man == 0:
            return np.uint32(sign).view(np.float32)
        mag = np.float32(man) * np.float32(5.960464477539063e-08)  # man * 2**-24, exact
        return -mag if sign else mag
    if exp == 31:
        bits = sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    else:
        bits = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))
    return np.uint32(bits).view(np.float32)


@overload(to_f32, jit_options=_C)
def _to_f32(x):
    if x == types.uint16:  # bfloat16 bits
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    if x == types.int16:  # float16 bits
        return lambda x: _half_to_f32(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


@njit(**_C)
def _delta(e, b, i):
    if b is None:
        return to_f32(e[i])
    return to_f32(e[i]) - to_f32(b[i])


@njit(inline="always", **_C)
def _count_zeros(hist, n):
    """``n`` zero deltas counted in bin 0, spread over the lanes as block_stats' unrolled loop spreads them."""
    for lane in range(hist.shape[0]):
        hist[lane, 0] += n // 4
    hist[0, 0] += n % 4


@njit(**_C)
def block_stats(e, b, hist, keys, pos, l1hist, lowcnt=None):
    """(sum d^2, sum |d|, max |d|, non-zeros, entries whose low 16 bits are not all zero) of one
    block's delta; counts the top 16 bits of each |d| (its float32 pattern) in ``hist`` [4, 65536]
    (lane i % 4; zeros land in bin 0) and adds |d| to ``l1hist[top 16 bits]`` (float64 [65536]: the
    L1 norm per bin, from which the L1 of the top-k entries follows without another pass). While ``keys`` has room, the float32 pattern of every |d| whose
    low 16 bits are not all zero is appended at ``pos`` (returned advanced; fewer than the count of
    such entries when room ran out), so that the radix select needs no second pass over the tensor.

    Unrolled by four with independent float64 sums and four histogram lanes: the latency of a
    running sum and of back-to-back increments of one hot bin (quantised bf16 deltas fill few
    bins) is what a plain loop waits on. With ``lowcnt``, only entries with low bits set go to ``l1hist``
    (and are counted in ``lowcnt``): :func:`fold_l1` adds the others at the end, the same in every bit."""
    n = e.size
    if _unchanged(e, b):  # every delta +0.0: only the zeros' bin counts (a frozen tensor, an untouched block)
        _count_zeros(hist, n)
        return 0.0, 0.0, np.float32(0.0), 0, 0, pos
    s0 = s1 = s2 = s3 = 0.0
    a0 = a1 = a2 = a3 = 0.0
    mx = np.float32(0.0)
    nnz = 0
    low = 0
    for i in range(0, n - n % 4, 4):
        d0 = _delta(e, b, i)
        d1 = _delta(e, b, i + 1)
        d2 = _delta(e, b, i + 2)
        d3 = _delta(e, b, i + 3)
        x0, x1, x2, x3 = abs(d0), abs(d1), abs(d2), abs(d3)
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
        a0 += x0
        a1 += x1
        a2 += x2
        a3 += x3
        mx = max(mx, max(max(x0, x1), max(x2, x3)))
        nnz += _count(x0, hist, 0) + _count(x1, hist, 1) + _count(x2, hist, 2) + _count(x3, hist, 3)
        if lowcnt is None:
            _add_l1_4(x0, x1, x2, x3, l1hist)
        l0, l1, l2, l3 = _low(x0), _low(x1), _low(x2), _low(x3)
        if l0 | l1 | l2 | l3:
            pos = _keep(keys, _keep(keys, _keep(keys, _keep(keys, pos, x0, l0), x1, l1), x2, l2), x3, l3)
            if lowcnt is not None:
                _add_low_l1_4(x0, x1, x2, x3, l0, l1, l2, l3, l1hist, lowcnt)
        low += l0 + l1 + l2 + l3
    for i in range(n - n % 4, n):
        d0 = _delta(e, b, i)
        x0 = abs(d0)
        s0 += d0 * d0
        a0 += x0
        mx = max(mx, x0)
        nnz += _count(x0, hist, 0)
        l0 = _low(x0)
        if lowcnt is None:
            _add_l1(x0, l1hist)
        else:
            _add_low_l1(x0, l0, l1hist, lowcnt)
        pos = _keep(keys, pos, x0, l0)
        low += l0
    return (s0 + s1) + (s2 + s3), (a0 + a1) + (a2 + a3), mx, nnz, low, pos


def _unchanged(e, b):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_unchanged, jit_options=_C)
def _unchanged_impl(e, b):
    """Whether expert and base blocks hold the same bits and no Inf/NaN (then every delta is +0.0, and
    block_stats' loop would only count zeros in bin 0: it adds the same counts to the same lanes, and nothing
    else changes -- a sum plus +0.0, max(mx, 0) and l1hist[0] + 0.0 leave every bit as it was). A first
    difference ends the scan (chunks of 256 entries, so each is one vectorised loop). Raw 16-bit views only
    (bf16, fp16); other types, and a delta stored directly (no base), always run the loop."""
    if isinstance(b, types.NoneType) or not isinstance(e, types.Array) or not isinstance(b, types.Array):
        return lambda e, b: False
    if e.dtype == types.uint16 and b.dtype == types.uint16:
        exp = np.uint64(0x7F80)  # bfloat16's exponent
    elif e.dtype == types.int16 and b.dtype == types.int16:
        exp = np.uint64(0x7C00)  # float16's exponent
    else:
        return lambda e, b: False

    def impl(e, b):
        n = e.size
        if n == 0 or b.size != n or not (e.flags.c_contiguous and b.flags.c_contiguous):
            return False
        for i in range(n - n % 4, n):
            if e[i] != b[i] or (np.uint64(np.uint16(e[i])) & exp) == exp:
                return False
        zero, s16, s32, s48 = np.uint64(0), np.uint64(16), np.uint64(32), np.uint64(48)
        words = n // 4  # four entries a word
        ew, bw = e[:4 * words].view(np.uint64), b[:4 * words].view(np.uint64)
        for start in range(0, words, 64):
            diff = np.uint64(0)
            bad = False
            for j in range(start, min(words, start + 64)):
                w = ew[j]
                diff |= w ^ bw[j]
                t = ~w
                # a lane whose exponent bits are all ones (Inf/NaN): none of them set in ~w
                bad |= (((t & exp) == zero) | (((t >> s16) & exp) == zero) | (((t >> s32) & exp) == zero)
                        | (((t >> s48) & exp) == zero))
            if diff != zero or bad:
                return False
        return True
    return impl


@njit(inline="always", **_C)
def _keep(keys, pos, x, low):
    if low and pos < keys.size:
        keys[pos] = np.float32(x).view(np.uint32)
        return pos + 1
    return pos


@njit(inline="always", **_C)
def _count(x, hist, lane):
    bits = np.float32(x).view(np.uint32)
    hist[lane, bits >> np.uint32(16)] += 1
    return bits != 0


@njit(inline="always", **_C)
def _add_l1(x, l1hist):
    l1hist[np.float32(x).view(np.uint32) >> np.uint32(16)] += np.float64(x)


@njit(inline="always", **_C)
def _add_l1_4(x0, x1, x2, x3, l1hist):
    _add_l1(x0, l1hist)
    _add_l1(x1, l1hist)
    _add_l1(x2, l1hist)
    _add_l1(x3, l1hist)


@njit(inline="always", **_C)
def _add_low_l1_4(x0, x1, x2, x3, l0, l1, l2, l3, l1hist, lowcnt):
    _add_low_l1(x0, l0, l1hist, lowcnt)
    _add_low_l1(x1, l1, l1hist, lowcnt)
    _add_low_l1(x2, l2, l1hist, lowcnt)
    _add_low_l1(x3, l3, l1hist, lowcnt)


@njit(inline="always", **_C)
def _add_low_l1(x, low, l1hist, lowcnt):
    if low:
        top = np.float32(x).view(np.uint32) >> np.uint32(16)
        l1hist[top] += np.float64(x)
        lowcnt[top] += 1


@njit(inline="always", **_C)
def _low(x):
    return np.int64((np.float32(x).view(np.uint32) & np.uint32(0xFFFF)) != 0)


@njit(**_C)
def collect_low_patterns(e, b, keys, pos):
    """block_stats' key collection alone: the |d| patterns with non-zero low 16 bits, from ``pos``."""
    for i in range(e.size):
        bits = np.float32(abs(_delta(e, b, i))).view(np.uint32)
        if bits & np.uint32(0xFFFF):
            keys[pos] = bits
            pos += 1
    return pos


@njit(**_C)
def collect_nonzero_low_keys(e, b, slot_of, n_slots, out, pos):
    """Append ``slot << 16 | low`` for the entries in a selected bin whose low 16 bits are not all
    zero (the caller counts the others from the first pass's histogram). The differences of two bf16
    numbers rarely have any: then this is a well-predicted branch per entry and almost no stores."""
    for i in range(e.size):
        bits = np.float32(abs(_delta(e, b, i))).view(np.uint32)
        lo = bits & np.uint32(0xFFFF)
        if lo != 0:
            slot = slot_of[bits >> np.uint32(16)]
            if slot < n_slots:
                out[pos] = (np.int64(slot) << 16) | np.int64(lo)
                pos += 1
    return pos


@njit(**_C)
def count_low_bits(e, b, slot_of, dense):
    """For |d| whose top 16 bits fall in a selected bin, count its low 16 bits in
    ``dense[slot, low]``. Unselected bins map to the last row, a sink: branch-free, which is twice
    as fast as skipping them when a third of the entries are selected."""
    for i in range(e.size):
        bits = np.float32(abs(_delta(e, b, i))).view(np.uint32)
        dense[slot_of[bits >> np.uint32(16)], bits & np.uint32(0xFFFF)] += 1


@njit(**_C)
def count_patterns(e, b, pats, first, out):
    """out[p] += entries of one block whose |d| has the float32 pattern pats[p] (``pats`` sorted;
    ``first[top]``: the index of the first pattern whose top 16 bits are ``top``, -1 for none -- one
    table lookup per entry, as most entries share no top bits with any pattern)."""
    P = pats.size
    for i in range(e.size):
        bits = np.float32(abs(_delta(e, b, i))).view(np.uint32)
        top = bits >> 16
        p = first[top]
        if p < 0:
            continue
        while p < P and (pats[p] >> 16) == top:
            if pats[p] == bits:
                out[p] += 1
                break
            p += 1


@njit(**_C)
def hist_delta(hist, prev, bins, counts, upto):
    """The bins below ``upto`` of the (lanes, bins) histogram that grew since ``prev`` (the lane sums last
    time, updated) into bins[:n] / counts[:n] (how much each grew); returns n. One block's histogram,
    sparse (``upto``: one past the top bin of the block's max |d|: no entry of it lies above)."""
    n = 0
    for j in range(min(upto, hist.shape[1])):
        s = 0
        for lane in range(hist.shape[0]):
            s += hist[lane, j]
        d = s - prev[j]
        if d != 0:
            bins[n] = j
            counts[n] = d
            prev[j] = s
            n += 1
    return n


@njit(**_C)
def gather_delta(e, b, positions):
    """The delta at ``positions`` (a block's sketch sample), float32."""
    out = np.empty(positions.size, np.float32)
    for j in range(positions.size):
        out[j] = _delta(e, b, positions[j])
    return out


@njit(**_C)
def nonfinite_in_hist(hist):
    """Entries counted in ``hist`` [lanes, 65536] whose |d| is Inf or NaN (exponent all ones; both
    signs, although |d| has its sign bit clear). Compiled: numpy's two sums cost ~10 us a block."""
    total = 0
    for lane in range(hist.shape[0]):
        for j in range(NONFINITE_BIN, 0x8000):
            total += hist[lane, j]
        for j in range(0x8000 | NONFINITE_BIN, hist.shape[1]):
            total += hist[lane, j]
    return total


@njit(**_C)
def count_nonfinite(x):
    """Entries of a raw block (the kernels' array types) that are Inf or NaN."""
    n = 0
    for i in range(x.size):
        v = to_f32(x[i])
        n += not (abs(v) <= np.float32(3.4028235e38))
    return n


@njit(**_C)
def _f32_to_f16_bits(x):
    """A finite float32 -> IEEE binary16 bits, rounded to nearest even, as numpy's astype(np.float16) does
    (overflow to +-inf; subnormals; underflow to +-0). Checked against numpy over every finite float32
    (tests/analyze/test_block_tail.py checks a sample and the edges)."""
    f = np.float32(x).view(np.uint32)
    sign = np.uint16((f >> np.uint32(16)) & np.uint32(0x8000))
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):  # |x| >= 65536: overflow (the caller passes finite values)
        return np.uint16(sign | np.uint16(0x7C00))
    if f_exp <= np.uint32(0x38000000):  # a half subnormal or zero
        if f_exp < np.uint32(0x33000000):
            return sign
        e = f_exp >> np.uint32(23)
        sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        lost = f & np.uint32(0x000007FF)  # bits the shift below may lose
        sig = sig >> (np.uint32(113) - e)
        if (sig & np.uint32(0x00003FFF)) != np.uint32(0x00001000) or lost:
            sig += np.uint32(0x00001000)
        return np.uint16(sign + np.uint16(sig >> np.uint32(13)))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x00003FFF)) != np.uint32(0x00001000):
        sig += np.uint32(0x00001000)
    h = (sig >> np.uint32(13)) + h_exp  # a carry out of the significand bumps the exponent (to inf at most)
    return np.uint16(sign + np.uint16(h))


@njit(**_C)
def f32_to_f16_bits(values, out):
    """:func:`_f32_to_f16_bits` over an array (finite float32 values), into uint16 ``out``."""
    for i in range(values.size):
        out[i] = _f32_to_f16_bits(values[i])


@njit(**_C)
def block_tail(hist, prev, bins, counts, dest_bins, dest_counts, pos, upto, prev_nonfinite, e, b, positions, mx,
               sketch):
    """What add_block needs after block_stats, in one call: this block's sparse histogram counts (hist_delta
    into the scratch bins / counts, and copied to dest_bins / dest_counts from ``pos`` when they have room),
    the non-finite entries counted so far (nonfinite_in_hist), and, when the block has none, its sketch: the
    delta at ``positions`` divided by max |delta| ``mx`` (when > 0) in float32, as float16 bits in ``sketch``
    (catalog/sketch.sketch_bytes, equal bit for bit). Returns (sparse bins, copied, non-finite so far,
    sketched: False where the block has NaN/Inf and the caller makes its sketch)."""
    n = hist_delta(hist, prev, bins, counts, upto)
    copied = pos + n <= dest_bins.size
    if copied:
        for i in range(n):
            dest_bins[pos + i] = bins[i]
            dest_counts[pos + i] = counts[i]
    total = nonfinite_in_hist(hist)
    if total != prev_nonfinite:
        return n, copied, total, False
    m = np.float32(mx)
    for p in range(positions.size):
        v = _delta(e, b, positions[p])
        if m > 0:
            v = v / m
        sketch[p] = _f32_to_f16_bits(v)
    return n, copied, total, True
