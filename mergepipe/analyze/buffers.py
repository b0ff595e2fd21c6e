"""Working arrays of ANALYZE's tensor passes (analyze/stats.py), reused within each thread.

Every (expert, tensor) pass needs a histogram of its |delta| patterns ([4, 65536] counters), the L1 sum per
bin, the running lane sums and the low-bit counts (2.3 MB), and scratch for each block's sparse counts (one
per thread). Fresh zeroed arrays
of that size are new mappings whose pages fault in one by one as the kernels touch them, which cost more
than the statistics of a small tensor (measured ~0.75 ms a pass against ~0.2 ms for zeroing kept ones);
a medium-sized model has ~75 tensors per expert. A pass takes a set here and gives it back zeroed when it
finishes; sets not given back (a pass that failed) are simply collected.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from mergepipe.analyze import bins
from mergepipe.storage.base import Reader

WIDTH = 1 << 16  # top-16-bit bins of a float32 pattern
_LOCAL = threading.local()
_KEEP = 256  # sets kept per thread at most (one per expert of a task in flight)


class PassBuffers:
    """``hist`` [4, WIDTH] (int32, or int64 for tensors of 2**31 entries or more), ``l1hist`` [WIDTH] float64,
    ``before`` [WIDTH] int64 (the lane sums at the last block), ``lowcnt`` [WIDTH] int32: all zero when
    taken; ``bins``, ``counts`` and ``total`` [WIDTH] int64: this thread's scratch, shared by its passes
    (filled and read within one call: a block's sparse counts, the lane sums at the end)."""

    __slots__ = ("wide", "hist", "l1hist", "before", "lowcnt", "bins", "counts", "total", "used")

    def __init__(self, wide: bool):
        self.wide = wide
        self.hist = np.zeros((4, WIDTH), dtype=np.int64 if wide else np.int32)
        self.l1hist = np.zeros(WIDTH, dtype=np.float64)
        self.before = np.zeros(WIDTH, dtype=np.int64)
        self.lowcnt = np.zeros(WIDTH, dtype=np.int32)  # entries with low 16 bits set, per bin (kernels.fold_l1)
        scratch = getattr(_LOCAL, "scratch", None)
        if scratch is None:
            scratch = _LOCAL.scratch = tuple(np.zeros(WIDTH, dtype=np.int64) for _ in range(3))
        self.bins, self.counts, self.total = scratch
        self.used = (0, WIDTH)  # the bins that may be non-zero (all, until lane_sums says which)

    def lane_sums(self, upto: int = WIDTH) -> np.ndarray:
        """The histogram's four lanes added up (int64 [WIDTH]; valid until this thread's next lane_sums), no
        bin at or above ``upto`` counting anything."""
        # every non-zero entry of the set is in a bin that counts something: give_back zeroes only those
        self.used = bins.lane_sums(self.hist, self.total, upto)
        return self.total


def take(numel: int) -> PassBuffers:
    wide = numel >= 2**31
    pool = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = []
    for i in range(len(pool) - 1, -1, -1):
        if pool[i].wide == wide:
            return pool.pop(i)
    return PassBuffers(wide)


def give_back(buf: PassBuffers) -> None:
    """Zero the set (the bins it used: ``lane_sums`` says which) and keep it for this thread's next pass."""
    lo, hi = buf.used
    buf.hist[:, lo:hi] = 0
    for arr in (buf.l1hist, buf.before, buf.lowcnt):
        arr[lo:hi] = 0
    buf.used = (0, 0)
    pool = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = []
    if len(pool) < _KEEP:
        pool.append(buf)


# --- read buffers and per-block scratch (analyze/stats.py's passes) -------------------------------------------
_READ_BUFFER = threading.local()


def read_buffer(nbytes: int) -> np.ndarray:
    """This thread's reusable read buffer of at least ``nbytes``. Reusing it spares the page faults
    (kernel time) of a fresh mapping for every block, which cost as much as the reads themselves."""
    buf = getattr(_READ_BUFFER, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _READ_BUFFER.buf = np.empty(max(nbytes, 8 << 20), dtype=np.uint8)
    return buf


class Arena:
    """Bump allocation in this thread's reusable buffer, each piece 8-byte aligned."""

    def __init__(self, nbytes: int):
        self.buf = read_buffer(nbytes)
        self.pos = 0

    def take(self, nbytes: int) -> np.ndarray:
        piece = self.buf[self.pos:self.pos + nbytes]
        self.pos += -(-nbytes // 8) * 8
        return piece


_SCRATCH = threading.local()


def sketch_scratch(n: int) -> np.ndarray:
    """This thread's uint16 buffer for one block's sketch (its float16 bits), ``n`` long."""
    buf = getattr(_SCRATCH, "sketch", None)
    if buf is None or buf.size < n:
        buf = _SCRATCH.sketch = np.empty(max(n, 4096), dtype=np.uint16)
    return buf[:n]


@lru_cache(maxsize=1024)
def _span_index_of(key) -> np.ndarray:
    return np.array(key, dtype=np.int64)


def span_index(spans) -> np.ndarray:
    """The grid index of each span (block i of the pass is spans[i])."""
    return _span_index_of(tuple(s.index for s in spans))


def slot_scratch() -> np.ndarray:
    """This thread's slot table for finish.choose_keys (int32 [65536], all -1 between calls)."""
    table = getattr(_SCRATCH, "table", None)
    if table is None:
        table = _SCRATCH.table = np.full(1 << 16, -1, dtype=np.int32)
    return table


# numpy views of raw bytes the kernels accept (bf16 and fp16 need distinct 16-bit types)
RAW_VIEW = {"BF16": np.uint16, "F16": np.int16, "F32": np.float32, "F64": np.float64}


def read_view(reader: Reader, rng: tuple[str, int, int], dtype: str, into: np.ndarray) -> np.ndarray:
    """One byte range as the kernels' array type, read into ``into`` (a slice of the arena)."""
    buf = into[:rng[2]]
    assert buf.size == rng[2]
    reader.read_into(rng[0], rng[1], buf)
    return buf.view(RAW_VIEW[dtype])
