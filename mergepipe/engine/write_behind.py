"""Write-behind: a merge's blocks written (and hashed) in output order on their own thread.

The loop that reads and schedules merges hands each block over as bytes or as the future of its merge
task; this thread waits on each in order and writes it at its offset (``ShardWriter.write``: pwrite and
sha256, both of which release the GIL). Reading, merging and writing then overlap instead of taking
turns on one thread. A bounded queue keeps memory bounded: :meth:`put` blocks while ``max_items`` blocks
wait. The first failure stops the writing; the rest of the queue is drained unwritten, and the failure
is raised by the next :meth:`put` or by :meth:`close`.
"""

from __future__ import annotations

import queue
import threading
import time

_DONE = object()


class WriteBehind:
    def __init__(self, max_items: int, timing: dict | None = None, on_written=None):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_items))
        self._timing = timing if timing is not None else {}
        self._timing.setdefault("write_s", 0.0)
        self._on_written = on_written  # called (on this thread) with each item's ``tag`` once it is written
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mergepipe-write", daemon=True)
        self._thread.start()

    def put(self, writer, offset: int, data, tag=None) -> None:
        """Queue one block (bytes, or a future of bytes) for ``writer`` at ``offset``."""
        self._raise_failure()
        self._queue.put((writer, offset, data, tag))

    def close(self) -> None:
        """Wait until every queued block is written; raise the first failure."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise_failure()

    def abort(self) -> None:
        """Stop after the block being written; what is queued is dropped."""
        if self._error is None:
            self._error = _Aborted()
        self._queue.put(_DONE)
        self._thread.join()

    def _raise_failure(self) -> None:
        if self._error is not None and not isinstance(self._error, _Aborted):
            raise self._error

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if self._error is not None:
                continue  # drain without writing, so that a blocked put() returns
            writer, offset, data, tag = item
            try:
                if not isinstance(data, memoryview):
                    data = data.result()
                t_w = time.perf_counter()
                writer.write(offset, data)
                self._timing["write_s"] += time.perf_counter() - t_w
                if self._on_written is not None:
                    self._on_written(tag)
            except BaseException as exc:  # re-raised on the merge's thread
                self._error = exc


class _Aborted(Exception):
    pass
