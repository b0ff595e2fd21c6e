"""The Storage seam: where checkpoint bytes come from.

Everything above storage/ needs five things of a checkpoint store, and nothing else:

* ``open(uri)``: the checkpoint's layout -- every tensor's name, dtype, shape, file and absolute byte
  offset, parsed and validated from the safetensors headers (and the shard index) without reading a
  tensor byte;
* ``size(checkpoint, fname)``: the size of one of its files in bytes;
* ``reader(checkpoint, sequential)``: exact positioned reads of byte ranges -- ``read(fname, offset,
  nbytes)``, ``read_ranges([(fname, offset, nbytes), ...])`` (adjacent ranges may be coalesced, never
  widened), ``read_into``, ``prefetch`` (a hint), a ``bytes_read`` counter the engine checks against
  the plan, ``close()`` (the :class:`Reader` protocol);
* ``fingerprint(checkpoint)``: a string that changes whenever the checkpoint's content may have changed
  (layout, sizes, modification times), computed without reading tensor bytes;
* ``stamp(uri)``: a cheaper token of the same kind taken without parsing headers, for quick re-checks;
* ``side_files(checkpoint)``: for a base whose folder is not local, its config.json and tokenizer files
  as bytes, for a merged model to carry (None: copy them from the local folder).

Which backend serves a URI is decided by :mod:`mergepipe.storage.registry` (plain paths: local); a
checkpoint remembers the storage that opened it, and ``checkpoint.reader()`` / ``.fingerprint()`` go
through it.

:class:`~mergepipe.storage.local.LocalStorage` implements it for local POSIX files (``os.preadv`` on
descriptors advised ``POSIX_FADV_RANDOM``). The remote backends (:mod:`mergepipe.storage.remote`:
``s3://``, ``http(s)://``, ``hf://``) honour the same contract: byte-exact ranges, a faithful
``bytes_read``, and a fingerprint that changes with the content (ETags).

The layout types both sides share -- :class:`TensorInfo` and :class:`Checkpoint` -- live here too (the
safetensors parser, :mod:`mergepipe.storage.safetensors`, builds and re-exports them).

The write side is a seam too: a merge whose output is a URI ``scheme://...`` is published through the
:class:`Publisher` registered for that scheme (:mod:`mergepipe.storage.publish`; ``s3://`` is built in).
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mergepipe.errors import StorageError
from mergepipe.storage.dtypes import ITEMSIZE, torch_dtype_of

if TYPE_CHECKING:
    import torch


class Reader(Protocol):
    """Exact range reads of one checkpoint's files (what ``Storage.reader`` returns)."""

    bytes_read: int  # every byte read so far; the engine checks it against the plan

    def read(self, fname: str, offset: int, nbytes: int) -> bytearray: ...

    def read_into(self, fname: str, offset: int, buf) -> None: ...

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[memoryview]: ...

    def prefetch(self, fname: str, offset: int, nbytes: int) -> None:
        """A hint that a range will be read soon (may do nothing); counts no bytes."""

    def close(self) -> None: ...

    def __enter__(self): ...

    def __exit__(self, *exc): ...


class Storage(ABC):
    """Where checkpoints live: open a layout, size a file, read exact ranges, fingerprint."""

    @abstractmethod
    def open(self, uri: str | os.PathLike) -> Checkpoint:
        """Parse and validate the checkpoint at ``uri`` (a file or a sharded directory); no tensor bytes."""

    @abstractmethod
    def size(self, checkpoint: Checkpoint, fname: str) -> int:
        """Size in bytes of the checkpoint's file ``fname``."""

    @abstractmethod
    def reader(self, checkpoint: Checkpoint, sequential: bool = False) -> Reader:
        """A reader of exact byte ranges of the checkpoint's files (``sequential``: a streaming hint)."""

    @abstractmethod
    def fingerprint(self, checkpoint: Checkpoint) -> str:
        """A digest that changes whenever the checkpoint's content may have changed."""

    @abstractmethod
    def stamp(self, uri: str | os.PathLike) -> str | None:
        """A cheap token (no header parsed) that stays equal while the files at ``uri`` are unchanged
        (sizes and modification times, ETags); None when it cannot be taken. Equal stamps let a
        registered model be used without parsing its headers again."""

    def side_files(self, checkpoint: Checkpoint) -> dict[str, bytes] | None:
        """config.json and tokenizer files of a checkpoint that is not a local folder; None: local."""
        return None


# --- the write side ---------------------------------------------------------------------------------------
MANIFEST_NAME = "mergepipe_manifest.json"  # its presence at the output is what makes a snapshot visible
STAGING_PREFIX = ".mergepipe-staging-"  # a publish stages its objects under <output>/<STAGING_PREFIX><txn id>


class Publisher(Protocol):
    """One snapshot's remote output, published for transaction ``txn_id``: made by the factory registered
    for the output's scheme, ``factory(uri, txn_id)`` (:func:`mergepipe.storage.publish.register_publisher`).

    The engine writes the snapshot into a local folder, then: ``check`` before anything is recorded;
    ``upload_soon`` for each file as soon as it is complete; ``stage`` once all are written; ``publish``;
    then the catalog commit. On any failure it calls ``abort``. After a crash, ``mergepipe recover`` makes
    a fresh publisher for the same URI and transaction and removes its ``leftovers``. Object names are
    relative to ``uri``; the contract every publisher keeps:

    * a published snapshot is never overwritten (``check`` refuses an output that holds anything);
    * nothing is visible before the manifest: ``publish`` writes ``MANIFEST_NAME`` LAST, after every other
      file is in place, and removes the staged objects afterwards;
    * ``abort`` and ``remove`` delete the manifest first, so a half-removed snapshot is never visible.
    """

    uri: str  # the canonical output URI
    staging: str  # where staged objects go, relative to ``uri`` (recorded in the transaction's row)

    def check(self) -> None:
        """Refuse (StorageError) an output that cannot be written or already holds objects."""

    def upload_soon(self, local: Path, path: Path) -> None:
        """``path``, a finished file of the snapshot folder ``local``, may be staged now (the manifest is
        never staged); may do nothing until :meth:`stage`."""

    def stage(self, local: Path) -> None:
        """Stage every file of ``local`` except the manifest under ``staging`` (waiting for those
        :meth:`upload_soon` started)."""

    def publish(self, local: Path) -> None:
        """Move the staged files to their final names, then write the manifest (from ``local``) last."""

    def abort(self) -> None:
        """Remove every object this publish wrote (the manifest first); never raises."""

    def leftovers(self, committed: bool) -> list[str]:
        """What a crashed publish of this transaction left: its staged objects, and every object at the
        output when the catalog holds no snapshot there (``committed`` False)."""

    def remove(self, names: list[str]) -> None:
        """Delete these objects (the manifest first); a missing one is no error."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live. ``offset`` is absolute within ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype_of(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Checkpoint:
    """A parsed checkpoint: a single safetensors file or a (sharded) Hugging Face directory."""

    root: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    file_sizes: dict[str, int]
    config: dict = field(default_factory=dict)
    # the Storage it was opened with (mergepipe.storage.registry); it reads and fingerprints the files
    storage: Storage | None = field(default=None, repr=False, compare=False)

    def reader(self, sequential: bool = False) -> Reader:
        """Exact range reads of this checkpoint's files, through the storage it was opened with."""
        return self._storage().reader(self, sequential)

    def fingerprint(self) -> str:
        return self._storage().fingerprint(self)

    def _storage(self) -> Storage:
        if self.storage is None:
            raise StorageError(f"{self.root}: opened without a storage backend (use mergepipe.storage.registry)")
        return self.storage

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def path_of(self, info: TensorInfo) -> Path:
        return self.root / info.file if self.root.is_dir() else self.root

    def headers_digest_source(self) -> bytes:
        """Canonical bytes describing the layout: names, dtypes, shapes, offsets and file sizes."""
        rows = [
            [t.name, t.dtype, list(t.shape), t.file, t.offset, t.nbytes]
            for t in sorted(self.tensors.values(), key=lambda t: t.name)
        ]
        return json.dumps({"tensors": rows, "files": self.file_sizes}, sort_keys=True).encode()
