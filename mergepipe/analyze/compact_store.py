"""Writing an expert's compact deltas during its analysis: records appended to a temporary file as tensors
finish (any order: offsets are stored per block), then renamed into place inside the catalog transaction
that stores the rows (catalog/compacts.py), so a crash leaves no half compact."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from mergepipe.analyze.compact import encode_block
from mergepipe.catalog import compacts
from mergepipe.catalog.db import Catalog
from mergepipe.storage.compact import MAGIC, Codec


class CompactWriter:
    """The compact file of one expert's analysis (codec, group size) and its block rows."""

    def __init__(self, catalog: Catalog, expert: dict, base_id: str, block_bytes: int, codec: Codec, group: int):
        self.expert, self.base_id, self.block_bytes = expert, base_id, block_bytes
        self.codec, self.group, self.level = codec, group, codec.stored_level
        self.path: Path = compacts.tmp_path(catalog, expert["id"])
        self.file = open(self.path, "wb")
        self.file.write(MAGIC)
        self.size = len(MAGIC)
        self.sha = hashlib.sha256(MAGIC)
        self.blocks: list[dict] = []
        self.expert_bytes = 0
        self.lock = threading.Lock()

    def encode(self, e, b) -> tuple[bytes, list[float]]:
        """(record, error norms) of one block (raw expert and base arrays, as the analysis kernels see them)."""
        return encode_block(e, b, self.group, self.level)

    def append(self, tensor: str, items: list[tuple]) -> None:
        """Append one tensor's records: ``items`` of (block, entries, record, error norms)."""
        data = b"".join(rec for _, _, rec, _ in items)
        with self.lock:
            offset = self.size
            self.file.write(data)
            self.sha.update(data)
            self.size += len(data)
        for block, n, rec, errs in items:
            errs = list(errs) + [None] * (3 - len(errs))
            self.blocks.append({"model_id": self.expert["id"], "tensor": tensor, "block": block, "offset": offset,
                                "n": n, "err1": errs[0], "err2": errs[1], "err4": errs[2]})
            offset += len(rec)

    def commit(self, catalog: Catalog, expert_bytes: int) -> None:
        """Inside the caller's transaction: make the file durable, rename it into place, store the rows."""
        if not self.file.closed:
            self.file.flush()
            self.file.close()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        name = compacts.final_name(self.expert["id"])
        compacts.replace_compact(catalog, {
            "model_id": self.expert["id"], "base_id": self.base_id, "fingerprint": self.expert["fingerprint"],
            "block_bytes": self.block_bytes, "codec": self.codec.value, "group_size": self.group, "file": name,
            "nbytes": self.size, "sha256": self.sha.hexdigest(), "expert_bytes": expert_bytes,
            "n_blocks": len(self.blocks)}, self.blocks)
        self.expert_bytes = expert_bytes
        os.replace(self.path, self.path.with_name(name))
        self.path = self.path.with_name(name)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.committed = True

    def close(self) -> None:
        """Close the file (it stays until committed or discarded: a first merge stores after its reads)."""
        if not self.file.closed:
            self.file.close()

    def discard(self) -> None:
        """Remove the temporary file unless it was committed."""
        self.close()
        if not getattr(self, "committed", False):
            self.path.unlink(missing_ok=True)
