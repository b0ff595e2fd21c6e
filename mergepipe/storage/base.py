"""The Storage seam: where checkpoint bytes come from.

Everything above storage/ needs four things of a checkpoint store, and nothing else:

* ``open(uri)``: the checkpoint's layout -- every tensor's name, dtype, shape, file and absolute byte
  offset, parsed and validated from the safetensors headers (and the shard index) without reading a
  tensor byte;
* ``size(checkpoint, fname)``: the size of one of its files in bytes;
* ``reader(checkpoint, sequential)``: exact positioned reads of byte ranges -- ``read(fname, offset,
  nbytes)``, ``read_ranges([(fname, offset, nbytes), ...])`` (adjacent ranges may be coalesced, never
  widened), ``read_into``, a ``bytes_read`` counter the engine checks against the plan, ``close()``;
* ``fingerprint(checkpoint)``: a string that changes whenever the checkpoint's content may have changed
  (layout, sizes, modification times), computed without reading tensor bytes.

:class:`~mergepipe.storage.local.LocalStorage` implements it for local POSIX files (``os.preadv`` on
descriptors advised ``POSIX_FADV_RANDOM``). A remote backend (object store, HTTP range requests) must
honour the same contract: byte-exact ranges, a faithful ``bytes_read``, and a fingerprint that changes
with the content.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mergepipe.storage.local import RangeReader
    from mergepipe.storage.safetensors import Checkpoint


class Storage(ABC):
    """Where checkpoints live: open a layout, size a file, read exact ranges, fingerprint."""

    @abstractmethod
    def open(self, uri: str | os.PathLike) -> Checkpoint:
        """Parse and validate the checkpoint at ``uri`` (a file or a sharded directory); no tensor bytes."""

    @abstractmethod
    def size(self, checkpoint: Checkpoint, fname: str) -> int:
        """Size in bytes of the checkpoint's file ``fname``."""

    @abstractmethod
    def reader(self, checkpoint: Checkpoint, sequential: bool = False) -> RangeReader:
        """A reader of exact byte ranges of the checkpoint's files (``sequential``: a streaming hint)."""

    @abstractmethod
    def fingerprint(self, checkpoint: Checkpoint) -> str:
        """A digest that changes whenever the checkpoint's content may have changed."""
