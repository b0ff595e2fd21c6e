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


def members(value, keys: list[str]) -> str | None:
    """The stored JSON object ``value`` (packed or plain) cut down to its members ``keys``, each found as
    ``"key": number`` or ``"key": [flat list]`` (json.dumps' layout), decompressing only as far as the last of
    them; None when one is not found that way (the caller then reads the whole text)."""
    if value is None:
        return None
    if not isinstance(value, (bytes, memoryview)):
        return _cut(value, keys)
    inflate, text, data = zlib.decompressobj(), "", bytes(value)
    at, step = 0, 256
    while at < len(data):  # doubling steps: linear in what is decompressed
        text += inflate.decompress(data[at:at + step]).decode("ascii", "replace")
        at, step = at + step, step * 2
        found = _cut(text, keys)
        if found is not None:
            return found
    return _cut(text + inflate.flush().decode("ascii", "replace"), keys)


def _cut(text: str, keys: list[str]) -> str | None:
    parts = []
    for k in keys:
        at = text.find(f'"{k}": ')
        start = at + len(k) + 4
        if at < 0:
            return None
        if text.startswith("[", start):
            end = text.find("]", start) + 1
            if end <= 0 or "[" in text[start + 1:end]:
                return None
        else:
            end = min((x for x in (text.find(",", start), text.find("}", start)) if x >= 0), default=-1)
            if end < 0:
                return None
        parts.append(text[at:end])
    return "{" + ", ".join(parts) + "}"
