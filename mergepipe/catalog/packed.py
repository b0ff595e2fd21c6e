"""Per-tensor statistics stored packed (catalog schema v12): the ``thresholds`` and ``topk`` JSON of a
``tensor_stats`` row (a hundred densities each) are written zlib-compressed, about 3.6x smaller, and read
back as the very same JSON text, so nothing that reads them sees a difference (lossless: the plans made
from them, and their digests, are unchanged). Rows written before v12 hold plain text and are read as
they are."""

from __future__ import annotations

import zlib

PACKED_COLUMNS = ("thresholds", "topk")


def pack(text: str | None) -> bytes | None:
    """The stored form of a JSON text (None stays None)."""
    return None if text is None else zlib.compress(text.encode(), 9)


def unpack(value) -> str | None:
    """The JSON text of a stored value: packed (bytes) or plain text from before v12."""
    if isinstance(value, (bytes, memoryview)):
        return zlib.decompress(value).decode()
    return value


def packed_row(row: dict) -> dict:
    """A tensor_stats row as stored: its JSON columns packed."""
    return {**row, **{c: pack(row[c]) for c in PACKED_COLUMNS if c in row}}
