"""The local-file storage backend: checkpoints on a POSIX filesystem (see :mod:`mergepipe.storage.base`).

Tensor data is read with ``os.preadv`` of exactly the requested range on file descriptors advised
``POSIX_FADV_RANDOM``: safetensors' own mmap path lets kernel read-ahead pull in many times the bytes
asked for (see shared/notes/io-and-compute.md). ``evict`` and ``proc_io`` serve cold-cache measurements.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.errors import StorageError
from mergepipe.storage.base import Storage
from mergepipe.storage.lora import ADAPTER_CONFIG
from mergepipe.storage.paths import expand_path, open_regular, read_regular
from mergepipe.storage.torchbin import BIN_INDEX, is_torch_bin, open_bin_checkpoint
from mergepipe.storage.safetensors import (
    Checkpoint, TensorInfo, bytes_to_tensor, open_checkpoint, row_nbytes, rows_shape,
)

if TYPE_CHECKING:
    import torch


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
        h.update(read_regular(adapter_config))
    return "sha256:" + h.hexdigest()


# the weight, index and adapter-config files whose (name, size, mtime) make a checkpoint's change stamp
_STAMPED = re.compile("|".join(fnmatch.translate(p) for p in ("*.safetensors", "*.safetensors.index.json",
                                                               ADAPTER_CONFIG, "pytorch_model*.bin", BIN_INDEX)))

class RangeReader:
    """Exact positioned reads from a checkpoint's files, counting every byte read.

    Adjacent ranges passed together to :meth:`read_ranges` are coalesced into one ``preadv``.
    """

    def __init__(self, checkpoint: Checkpoint, sequential: bool = False):
        self.checkpoint = checkpoint
        self.sequential = sequential
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # readers may be shared by worker threads
        self.bytes_read = 0
        self.calls = 0

    def _fd(self, fname: str) -> int:
        with self._lock:
            return self._open(fname)

    def _open(self, fname: str) -> int:
        fd = self._fds.get(fname)
        if fd is None:
            path = self.checkpoint.root / fname if self.checkpoint.root.is_dir() else self.checkpoint.root
            fd = open_regular(path)
            advice = os.POSIX_FADV_SEQUENTIAL if self.sequential else os.POSIX_FADV_RANDOM
            os.posix_fadvise(fd, 0, 0, advice)
            self._fds[fname] = fd
        return fd

    def prefetch(self, fname: str, offset: int, nbytes: int) -> None:
        """Ask the kernel to start reading a range that will be read soon (``POSIX_FADV_WILLNEED``,
        asynchronous); nothing is counted until it is read."""
        if nbytes > 0:
            os.posix_fadvise(self._fd(fname), offset, nbytes, os.POSIX_FADV_WILLNEED)

    def read_into(self, fname: str, offset: int, buf) -> None:
        """Fill ``buf`` (a writable buffer) from ``fname`` at absolute ``offset``."""
        view = memoryview(buf).cast("B")
        fd = self._fd(fname)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise StorageError(f"{fname}: unexpected end of file at byte {offset + done} (truncated?)")
            done += n
        with self._lock:
            self.bytes_read += done
            self.calls += 1

    def read(self, fname: str, offset: int, nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        self.read_into(fname, offset, buf)
        return buf

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[memoryview]:
        """Read several (file, offset, nbytes) ranges, coalescing ones that touch; returns one view each."""
        out: list[memoryview | None] = [None] * len(ranges)
        order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
        run: list[int] = []

        def flush():
            if not run:
                return
            fname, start = ranges[run[0]][0], ranges[run[0]][1]
            end = max(ranges[i][1] + ranges[i][2] for i in run)
            view = memoryview(self.read(fname, start, end - start))
            for i in run:
                out[i] = view[ranges[i][1] - start : ranges[i][1] - start + ranges[i][2]]
            run.clear()

        for i in order:
            fname, off, n = ranges[i]
            if run:
                pf, poff, pn = ranges[run[-1]]
                if pf != fname or off != poff + pn:
                    flush()
            run.append(i)
        flush()
        return out  # type: ignore[return-value]

    def tensor_rows(self, info: TensorInfo, row_start: int, row_end: int) -> torch.Tensor:
        """Read rows [row_start, row_end) of dim 0 (elements, for 1-D tensors) as a tensor."""
        row_bytes = row_nbytes(info)
        buf = self.read(info.file, info.offset + row_start * row_bytes, (row_end - row_start) * row_bytes)
        return bytes_to_tensor(buf, info.dtype, rows_shape(info, row_end - row_start))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalStorage(Storage):
    """Checkpoints as local files: headers parsed by hand, tensor bytes read with ``os.preadv``."""

    def open(self, uri: str | os.PathLike) -> Checkpoint:
        # safetensors, or PyTorch .bin files read in place (mergepipe.storage.torchbin)
        root = expand_path(uri)
        checkpoint = open_bin_checkpoint(root) if is_torch_bin(root) else open_checkpoint(uri)
        checkpoint.storage = self
        return checkpoint

    def size(self, checkpoint: Checkpoint, fname: str) -> int:
        path = checkpoint.root / fname if checkpoint.root.is_dir() else checkpoint.root
        return Path(path).stat().st_size

    def reader(self, checkpoint: Checkpoint, sequential: bool = False) -> RangeReader:
        return RangeReader(checkpoint, sequential=sequential)

    def fingerprint(self, checkpoint: Checkpoint) -> str:
        return fingerprint(checkpoint)

    def stamp(self, uri: str | os.PathLike) -> str | None:
        """(name, size, mtime) of the weight, index and adapter-config files, from stat() alone."""
        root = Path(uri)
        try:
            if root.is_file():
                st = root.stat()
                return json.dumps([[root.name, st.st_size, st.st_mtime_ns]])
            with os.scandir(root) as entries:  # one listing, not one per pattern (planning stamps every expert)
                files = sorted((e.name, e.stat()) for e in entries if _STAMPED.match(e.name))
            return json.dumps([[name, st.st_size, st.st_mtime_ns] for name, st in files])
        except (FileNotFoundError, NotADirectoryError):
            return "[]"  # nothing there: no files to stamp
        except OSError:
            return None


def evict(paths) -> None:
    """Drop files from the page cache (for cold-cache measurements); directories are walked."""
    for p in paths:
        p = Path(p)
        targets = [q for q in p.rglob("*") if q.is_file()] if p.is_dir() else [p]
        for q in targets:
            fd = os.open(q, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def proc_io() -> dict[str, int]:
    """This process's I/O counters from /proc/self/io (read_bytes/write_bytes hit the disk)."""
    out = {}
    with open("/proc/self/io") as fh:
        for line in fh:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out
