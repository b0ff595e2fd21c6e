"""The Executor seam: what runs the block tasks of a merge.

A block task is a plain call ``fn(*args)`` that merges one block and returns its bytes (a buffer).
The pipeline submits tasks in output order, keeps at most a bounded number outstanding, and waits on
each future in that order before writing the bytes at their final offset; it never relies on the
order in which tasks complete. :class:`LocalExecutor` runs them on a pool of single-threaded worker
threads in this process (what MergePipe does today). A distributed executor would ship each task to
a worker and hand back a future of its bytes; see docs/architecture.md for what it must guarantee.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

from mergepipe.engine import threads as torch_threads


class Executor(ABC):
    """Runs block tasks; one executor serves one merge and is shut down at its end."""

    @abstractmethod
    def submit(self, fn, /, *args) -> Future:
        """Start ``fn(*args)``; the future's result is the task's return value (or its exception)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Wait for the tasks that are running; cancel the ones not yet started."""


class LocalExecutor(Executor):
    """A thread pool of ``workers`` threads, each limited to ``threads`` torch intra-op threads where it
    uses torch (engine/threads.py: a merge that never needs torch never imports it).

    Block-sized kernels gain nothing from intra-op threads, and OpenMP spin-waits collapse when the
    cores are shared, so ``threads`` is 1 by default (see Engine)."""

    def __init__(self, workers: int, threads: int = 1):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mergepipe-compute",
                                        initializer=torch_threads.want, initargs=(threads,))

    def submit(self, fn, /, *args) -> Future:
        return self._pool.submit(_limited, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _limited(fn, *args):
    """``fn(*args)`` on a worker, torch's thread limit applied first where torch got loaded since."""
    if "torch" in sys.modules:
        torch_threads.torch_module()
    return fn(*args)


class RangeExecutor(ABC):
    """Runs a merge as range tasks where the data lives, instead of block tasks in this process.

    A range task (:func:`mergepipe.engine.ranges.run_range`) merges a contiguous run of the plan's
    work items (output tensors, or block groups of one): it reads its own base and expert byte ranges
    through the storage registry, merges, writes its byte range of the output shards that the driver
    pre-created, and returns only its counters. No tensor byte passes through the driver. An executor
    must run every task exactly once to completion (retrying a task whose worker died is safe: its
    writes are positioned and idempotent, and only a finished task's counters are returned)."""

    @abstractmethod
    def run_tasks(self, fn, shared, tasks: list, on_done=None) -> list:
        """``[fn(shared, task) for task in tasks]``, in any order and place; ``on_done(i, result)`` as
        each task ends. Raises the first task's exception (a MergePipeError as it is) once the rest
        are cancelled."""

    def workers(self) -> int:
        """How many tasks can run at once (used to cut the plan into enough tasks)."""
        return 1
