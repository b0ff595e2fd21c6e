"""When the watcher takes a checkpoint: a content check that a stalled writer cannot fake (issue 28).

A quiet period alone (the same size and mtime on two scans) is faked by a writer that preallocated its
files (header written, file at full size) and stalled: its data is still zeros. So a full checkpoint is
also sampled before it is registered: a few windows of every tensor's data (its first, middle and last
SAMPLE_BYTES), each compared with the same window of the base. A window that is all zero where the base's
is not is unwritten data (a fine-tune does not zero a whole window of a weight the base holds), and the
checkpoint waits: it is taken once its files change and the samples hold data. A sequential writer that
stalls leaves the last window of every later tensor zero, so it is always caught; reads are at most
3 x SAMPLE_BYTES per tensor, of the checkpoint and of the base.

LoRA adapters are not sampled (a B matrix may legitimately be all zero, and there is no base window to
compare with).
"""

from __future__ import annotations

from pathlib import Path

from mergepipe.storage.registry import open_checkpoint

SAMPLE_BYTES = 4096


def _windows(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the first, middle and last windows of a tensor's data (fewer when it is small)."""
    n = min(SAMPLE_BYTES, nbytes)
    starts = sorted({0, max(0, nbytes // 2 - n // 2), nbytes - n})
    return [(s, n) for s in starts] if n else []


def _zero(view) -> bool:
    return not bytes(view).strip(b"\0")


def unwritten(path: Path, base_uri: str) -> str | None:
    """Where a full checkpoint's data still looks unwritten (a sampled window all zero where the base's is
    not), in words; None when every sample holds data."""
    ck, base = open_checkpoint(str(path)), open_checkpoint(base_uri)
    pairs = [(t, base.tensors[t.name]) for t in ck.tensors.values()
             if t.name in base.tensors and base.tensors[t.name].nbytes == t.nbytes]
    ranges = [(t, b, off, n) for t, b in pairs for off, n in _windows(t.nbytes)]
    with ck.reader() as mine, base.reader() as theirs:
        got = mine.read_ranges([(t.file, t.offset + off, n) for t, _, off, n in ranges])
        ref = theirs.read_ranges([(b.file, b.offset + off, n) for _, b, off, n in ranges])
    for (t, _, off, n), x, y in zip(ranges, got, ref):
        if _zero(x) and not _zero(y):
            return (f"{n} bytes of {t.name} at offset {off} of its data are all zero where the base's are not "
                    f"(still being written?)")
    return None
