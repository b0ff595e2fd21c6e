"""Compact deltas: a progressive, group-quantized approximation of an expert block's delta (the compact tier).

The written definition (the oracle in tests/oracle/ decodes by it, not by this code). A block's delta d
(float32, n entries in the block's C order, formed as the engine forms it: expert - base in float32, a delta
checkpoint's values, a LoRA block's scale * B @ A) is cut into groups of G consecutive entries (the last one
may be shorter). Per group g, with bf16(x) the round-to-nearest-even bfloat16 of a float32:

* ``m_g = bf16(mean |d|)`` over the group, ``a_g = bf16(max |d|)``;
* per entry: sign bit ``s_i = 1`` where ``d_i < 0``; magnitude code ``q_i = min(7, floor(|d_i| * r_g))`` with
  ``r_g = 8 / a_g`` rounded to float32 (0 where ``a_g = 0``), the product in float32.

A block's record is three segments, each a prefix of the next precision:

====== ========================================= =============================================
bits   bytes                                     decode (float32, exact: at most 12 bits)
====== ========================================= =============================================
1      m_g (uint16 bf16 bits, per group), sign    ``d_i = (-1)^s_i m_g``
       plane (ceil(n/8) bytes)
2      + a_g (per group), the plane of q_i >> 2   ``d_i = (-1)^s_i 0.75 a_g`` where ``q_i >= 4``, else 0
4      + the planes of (q_i >> 1) & 1, q_i & 1    ``d_i = (-1)^s_i (q_i + 0.5) a_g / 8``
====== ========================================= =============================================

Bit planes are little-endian within a byte (entry i is bit i % 8 of byte i // 8), padded with zeros. Every
level's exact error norm ``||d - decode(d)||_2`` is stored with the block (catalog/compacts.py), so a plan's
bound stays sound. The codecs are what a catalog stores and which levels a plan may read:
``sign1`` (level 1 only), ``q2`` (level 2, ternary), ``q4`` (level 4) and ``progressive`` (levels 1, 2 and 4
of one stored record: the planner chooses per block).
"""

from __future__ import annotations

import math

import numpy as np

from mergepipe.storage.codecs import (  # noqa: F401  (re-exported)
    CODECS, DEFAULT_GROUP, GROUP_RANGE, LEVELS, MAGIC, Codec, bits_per_entry, check_group, codec, groups, growth_text,
    level_bytes, plane_bytes,
)

def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even bfloat16 bits of float32 values (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _unpack(plane: memoryview | np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(plane, dtype=np.uint8), count=n, bitorder="little")


def decode(record, n: int, group: int, level: int) -> np.ndarray:
    """The float32 delta of one block's record read at ``level`` bits (``record``: at least its prefix)."""
    buf = memoryview(record)
    ng, p = groups(n, group), plane_bytes(n)
    if len(buf) < level_bytes(n, group, level):
        raise ValueError(f"a compact record of {len(buf)} bytes is too short for {n} entries at {level} bits")
    sign = np.where(_unpack(buf[2 * ng:2 * ng + p], n).astype(bool), np.float32(-1), np.float32(1))
    if level == 1:
        m = bf16_bits_to_f32(np.frombuffer(buf[:2 * ng], dtype="<u2"))
        return sign * np.repeat(m, group)[:n]
    at = 2 * ng + p
    a = np.repeat(bf16_bits_to_f32(np.frombuffer(buf[at:at + 2 * ng], dtype="<u2")), group)[:n]
    hi = _unpack(buf[at + 2 * ng:at + 2 * ng + p], n)
    if level == 2:
        return sign * np.where(hi.astype(bool), a * np.float32(0.75), np.float32(0))
    at += 2 * ng + p
    q = (hi.astype(np.int32) << 2) | (_unpack(buf[at:at + p], n).astype(np.int32) << 1) \
        | _unpack(buf[at + p:at + 2 * p], n).astype(np.int32)
    return sign * ((q.astype(np.float32) + np.float32(0.5)) * a * np.float32(0.125))


def encode(delta: np.ndarray, group: int, level: int = 4) -> tuple[bytes, list[float]]:
    """(the record up to ``level``, [error norm at each stored level]) of one block's float32 delta (numpy; the
    analysis uses the compiled kernel in analyze/compact.py, which writes the same bytes)."""
    d = np.ascontiguousarray(delta, dtype=np.float32).reshape(-1)
    n = d.size
    ng = groups(n, group)
    pad = np.zeros(ng * group, dtype=np.float32)
    pad[:n] = np.abs(d)
    grouped = pad.reshape(ng, group)
    counts = np.full(ng, group, dtype=np.float64)
    counts[-1] = n - (ng - 1) * group
    m_bits = f32_to_bf16_bits((grouped.astype(np.float64).sum(axis=1) / counts).astype(np.float32))
    a_bits = f32_to_bf16_bits(grouped.max(axis=1))
    a = np.repeat(bf16_bits_to_f32(a_bits), group)[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(a > 0, np.float32(8) / a, np.float32(0)).astype(np.float32)
        q = np.minimum(np.floor(np.abs(d) * inv), 7).astype(np.uint8)
    pack = lambda bits: np.packbits(bits.astype(np.uint8), bitorder="little").tobytes()  # noqa: E731
    parts = [m_bits.astype("<u2").tobytes(), pack(d < 0), a_bits.astype("<u2").tobytes(), pack(q >> 2),
             pack((q >> 1) & 1), pack(q & 1)]
    record = b"".join(parts)[:level_bytes(n, group, level)]
    errors = [error_norm(d, decode(record, n, group, lv))
              for lv in LEVELS if lv <= level]
    return record, errors


def error_norm(delta: np.ndarray, approx: np.ndarray) -> float:
    """||delta - approx||_2, each entry's difference taken in float64 (as the analysis kernel does)."""
    diff = delta.astype(np.float64) - approx.astype(np.float64)
    return float(math.sqrt(float(np.dot(diff, diff))))


class CompactBlock:
    """One block's compact record as read for a merge (the engine decodes it: engine/blocks.decoded)."""

    __slots__ = ("record", "n", "group", "level")

    def __init__(self, record: bytes, n: int, group: int, level: int):
        self.record, self.n, self.group, self.level = record, n, group, level


class CompactReader:
    """Positioned reads of one compact file, counted (``bytes_read``), safe from several threads."""

    def __init__(self, path: str, nbytes: int):
        import os
        import threading
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        if size != nbytes:
            os.close(self.fd)
            from mergepipe.errors import ExecutionError
            raise ExecutionError(f"compact file {path} has {size} bytes, the catalog recorded {nbytes}: run "
                                 f"`mergepipe analyze --compact ... --force` for its expert")
        # positioned reads of a plan's records: no read-ahead (the kernel's default would pull in whole runs of
        # records the plan does not read)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.bytes_read = 0
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        import os
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            from mergepipe.errors import ExecutionError
            raise ExecutionError(f"compact file {self.path} ended at offset {offset + len(data)} (needed "
                                 f"{offset + length})")
        with self._lock:
            self.bytes_read += length
        return data

    def close(self) -> None:
        import os
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
