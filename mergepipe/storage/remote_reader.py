"""Exact range reads of a remote checkpoint (:class:`RemoteReader`, what ``RemoteStorage.reader`` returns)
and one remote file as a byte source for the ``.bin`` parser (:class:`RemoteBytes`); requests go through
the backend's pool, block cache and retries (:mod:`mergepipe.storage.remote`).
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from mergepipe.storage.base import Checkpoint
from mergepipe.storage.transports import env_float


class RangeFetcher(Protocol):
    """What a reader uses of the :class:`mergepipe.storage.remote.RemoteStorage` that made it."""

    pool: ThreadPoolExecutor

    def transport(self, folder: str): ...

    def fetch(self, transport, name: str, start: int, end: int, etag: str | None, size: int) -> bytes: ...


def env_int(name: str, default: int) -> int:
    return int(env_float(name, default))


class RemoteReader:
    """Exact range reads of one remote checkpoint (thread-safe; coalesced, parallel, retried)."""

    MAX_AHEAD = 64
    concurrent = True  # the engine may fetch several groups at once through it (latency overlaps)

    def __init__(self, storage: RangeFetcher, checkpoint: Checkpoint):
        self.storage = storage
        self.checkpoint = checkpoint
        self.transport = storage.transport(checkpoint.remote["folder"])
        self.etags = checkpoint.remote["etags"]
        self.part_bytes = max(1 << 16, env_int("MERGEPIPE_REMOTE_PART_BYTES", 8 << 20))
        self._lock = threading.Lock()
        self._ahead: dict[tuple[str, int, int], Future] = {}
        self.bytes_read = 0
        self.calls = 0

    def _one(self, fname: str, start: int, end: int) -> bytes:
        return self.storage.fetch(self.transport, fname, start, end, self.etags.get(fname),
                                  self.checkpoint.file_sizes[fname])

    def _fetch_runs(self, runs: list[tuple[str, int, int]]) -> list[bytearray]:
        """Each (file, start, end) run's bytes, its parts fetched in parallel (prefetched ones reused)."""
        outs = [bytearray(end - start) for _, start, end in runs]
        jobs = []
        for k, (fname, start, end) in enumerate(runs):
            with self._lock:
                ahead = self._ahead.pop((fname, start, end - start), None)
            if ahead is not None:
                jobs.append((k, 0, ahead))
                continue
            for s in range(start, end, self.part_bytes):
                e = min(end, s + self.part_bytes)
                jobs.append((k, s - start, self.storage.pool.submit(self._one, fname, s, e)))
        for k, pos, fut in jobs:
            data = fut.result()
            outs[k][pos:pos + len(data)] = data
        with self._lock:
            self.bytes_read += sum(len(o) for o in outs)
            self.calls += len(runs)
        return outs

    def read_into(self, fname: str, offset: int, buf) -> None:
        view = memoryview(buf).cast("B")
        if len(view):
            view[:] = self._fetch_runs([(fname, offset, offset + len(view))])[0]

    def read(self, fname: str, offset: int, nbytes: int) -> bytearray:
        return self._fetch_runs([(fname, offset, offset + nbytes)])[0] if nbytes else bytearray()

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[memoryview]:
        """Several (file, offset, nbytes) ranges; ranges that touch go out as one request."""
        order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
        runs: list[list] = []  # [fname, start, end, [indexes]]
        for i in order:
            fname, off, n = ranges[i]
            if runs and runs[-1][0] == fname and runs[-1][2] == off:
                runs[-1][2] = off + n
                runs[-1][3].append(i)
            else:
                runs.append([fname, off, off + n, [i]])
        bufs = self._fetch_runs([(f, s, e) for f, s, e, _ in runs])
        out: list[memoryview | None] = [None] * len(ranges)
        for (fname, start, _, idx), buf in zip(runs, bufs):
            view = memoryview(buf)
            for i in idx:
                out[i] = view[ranges[i][1] - start: ranges[i][1] - start + ranges[i][2]]
        return out  # type: ignore[return-value]

    def prefetch(self, fname: str, offset: int, nbytes: int) -> None:
        """Start fetching a range that will be read soon (one request, up to 64 outstanding)."""
        if nbytes <= 0:
            return
        with self._lock:
            key = (fname, offset, nbytes)
            if key in self._ahead or len(self._ahead) >= self.MAX_AHEAD:
                return
            self._ahead[key] = self.storage.pool.submit(self._one, fname, offset, offset + nbytes)

    def close(self) -> None:
        with self._lock:
            for fut in self._ahead.values():
                fut.cancel()
            self._ahead.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RemoteBytes:
    """One remote file as a byte source for storage/torchbin.py: exact range reads (``pread``) and a
    seekable file object over them (``file()``, buffered in 8 KiB reads, for the zip's directory)."""

    def __init__(self, storage: RangeFetcher, transport, name: str, size: int, etag: str | None):
        self.storage, self.transport, self.name, self.size, self.etag = storage, transport, name, size, etag

    def pread(self, n: int, offset: int) -> bytes:
        end = min(offset + n, self.size)
        if end <= offset:
            return b""
        return self.storage.fetch(self.transport, self.name, offset, end, self.etag, self.size)

    def file(self):
        return io.BufferedReader(_RangeRaw(self), buffer_size=8 << 10)


class _RangeRaw(io.RawIOBase):
    def __init__(self, src: RemoteBytes):
        self.src, self.pos = src, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, offset if whence == 0 else self.pos + offset if whence == 1 else self.src.size + offset)
        return self.pos

    def readinto(self, buf) -> int:
        data = self.src.pread(len(buf), self.pos)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)
