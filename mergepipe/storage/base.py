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
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mergepipe.storage.safetensors import Checkpoint


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
