"""The local-file storage backend: checkpoints on a POSIX filesystem (see :mod:`mergepipe.storage.base`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mergepipe.storage.base import Storage
from mergepipe.storage.lora import ADAPTER_CONFIG
from mergepipe.storage.safetensors import Checkpoint, RangeReader, open_checkpoint


def fingerprint(ckpt: Checkpoint) -> str:
    """sha256 over the tensor layout (names, dtypes, shapes, offsets), file sizes and mtimes.

    Reads no tensor bytes. Sibling fine-tunes share one layout, so the files' modification times are
    part of it: a rewritten expert gets a new fingerprint and is re-analyzed, never silently reused.
    """
    h = hashlib.sha256(ckpt.headers_digest_source())
    for f in ckpt.files:
        h.update(f"{f.name}:{f.stat().st_mtime_ns}".encode())
    adapter_config = ckpt.root / ADAPTER_CONFIG
    if ckpt.root.is_dir() and adapter_config.is_file():  # a LoRA's alpha and r change its delta
        h.update(adapter_config.read_bytes())
    return "sha256:" + h.hexdigest()


class LocalStorage(Storage):
    """Checkpoints as local files: headers parsed by hand, tensor bytes read with ``os.preadv``."""

    def open(self, uri: str | os.PathLike) -> Checkpoint:
        return open_checkpoint(uri)

    def size(self, checkpoint: Checkpoint, fname: str) -> int:
        path = checkpoint.root / fname if checkpoint.root.is_dir() else checkpoint.root
        return Path(path).stat().st_size

    def reader(self, checkpoint: Checkpoint, sequential: bool = False) -> RangeReader:
        return RangeReader(checkpoint, sequential=sequential)

    def fingerprint(self, checkpoint: Checkpoint) -> str:
        return fingerprint(checkpoint)
