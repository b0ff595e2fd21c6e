"""Sign/value sketches of block deltas.

A sketch is the block's delta sampled at ``size`` fixed positions (the same positions for every
expert, chosen by a seeded generator from the block's element count), normalised by the block's
max |delta| and stored as float16. Two experts' sketches of the same block estimate the block's
sign-conflict rate and cosine without reading either expert again.

The positions are the first ``size`` entries of torch's CPU ``randperm(numel)`` drawn from a
generator seeded with ``_SEED ^ numel``, sorted (how catalogs already on disk were sampled), computed
here with numpy alone (:func:`randperm_head`, equal to torch's bit for bit: tests/analyze/
test_analyze_no_torch.py), so ANALYZE never imports torch for them.

Sampling error: a proportion or correlation estimated from n samples has standard error
<= 0.5/sqrt(n) and ~(1 - rho^2)/sqrt(n); at the default n = 2048 that is <= 0.011 and <= 0.022.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

DEFAULT_SKETCH_SIZE = 2048
_SEED = 0x5EED


# torch's CPU generator (at::CPUGeneratorImpl) is an mt19937 seeded with the 32 low bits of its seed, the
# standard init_genrand, as numpy's legacy RandomState seeds it; ``random()`` is one 32-bit output and
# ``random64()`` two, the first as the high word. RandomState.randint over [0, 2**32) returns the raw outputs.
_RANDPERM_SMALL = (2**32 - 1) // 20  # torch's randperm_cpu: below this n a forward swap, above it inside-out
_CHUNK = 1 << 22


def torch_random32(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of ``torch.Generator().manual_seed(seed)``'s ``random()`` (uint64 array)."""
    return np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 1 << 32, size=count, dtype=np.uint64)


def torch_random64(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of ``torch.Generator().manual_seed(seed)``'s ``random64()`` (uint64 array)."""
    return _random64(np.random.RandomState(seed & 0xFFFFFFFF), count)


def _random64(state: np.random.RandomState, count: int) -> np.ndarray:
    raw = state.randint(0, 1 << 32, size=2 * count, dtype=np.uint64)
    return (raw[0::2] << np.uint64(32)) | raw[1::2]


def randperm_head(n: int, size: int, seed: int) -> np.ndarray:
    """The first ``size`` (< n) entries of torch's CPU ``randperm(n, generator=manual_seed(seed))`` (int64)."""
    if n < _RANDPERM_SMALL:  # for i < n - 1: swap r[i] with r[i + random() % (n - i)]; r[:i+1] is final
        steps = np.arange(size, dtype=np.uint64)
        z = (torch_random32(seed, size) % (np.uint64(n) - steps) + steps).astype(np.int64)
        moved: dict[int, int] = {}
        out = np.empty(size, dtype=np.int64)
        for i, j in enumerate(z.tolist()):
            vi = moved.get(i, i)
            out[i] = moved.get(j, j)
            moved[j] = vi
        return out
    return _inside_out_head(n, size, seed)


def _inside_out_head(n: int, size: int, seed: int) -> np.ndarray:
    """torch's inside-out Fisher-Yates for large n: r[i] = r[z]; r[z] = i with z = random64() % (i + 1).
    Only writes into the first ``size`` slots matter: for i >= size those are r[z] = i with z < size."""
    state = np.random.RandomState(seed & 0xFFFFFFFF)
    out = np.empty(size, dtype=np.int64)
    z = (_random64(state, size) % np.arange(1, size + 1, dtype=np.uint64)).astype(np.int64)
    for i, j in enumerate(z.tolist()):
        out[i] = out[j]
        out[j] = i
    for start in range(size, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        z = _random64(state, stop - start) % np.arange(start + 1, stop + 1, dtype=np.uint64)
        for i in np.flatnonzero(z < np.uint64(size)).tolist():
            out[int(z[i])] = start + i
    return out


@lru_cache(maxsize=64)
def _positions(numel: int, size: int) -> np.ndarray:
    if numel <= size:
        out = np.arange(numel, dtype=np.int64)
    else:
        out = np.sort(randperm_head(numel, size, _SEED ^ numel))
    return out


def sample_positions(numel: int, size: int) -> np.ndarray:
    """Sorted sample positions (int64; shared: do not modify) for a block of ``numel`` elements (all of them if it is small)."""
    return _positions(int(numel), int(size))


sample_positions.cache_clear = _positions.cache_clear  # type: ignore[attr-defined]


def make_sketch(delta_flat, max_abs: float, size: int) -> bytes:
    """The sketch of a flat delta (a numpy array, or anything ``np.asarray`` takes)."""
    flat = np.asarray(delta_flat).reshape(-1)
    vals = flat[sample_positions(flat.size, size)].astype(np.float32)
    return sketch_bytes(vals, max_abs)


def sketch_bytes(values: np.ndarray, max_abs: float) -> bytes:
    """A sketch from the delta at the sample positions (float32): divided by max |delta|, as float16."""
    if max_abs > 0:
        values = values / np.float32(max_abs)
    return values.astype(np.float16).tobytes()


def decode(blob: bytes | None) -> np.ndarray:
    if not blob:
        return np.zeros(0, dtype=np.float32)
    return np.frombuffer(blob, dtype=np.float16).astype(np.float32)


def conflict_rate(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of positions, among those where both deltas are non-zero, whose signs differ."""
    both = (a != 0) & (b != 0)
    n = int(both.sum())
    if n == 0:
        return 0.0
    return float(((np.sign(a) != np.sign(b)) & both).sum() / n)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.dot(a, a)), float(np.dot(b, b))
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / np.sqrt(na * nb))
