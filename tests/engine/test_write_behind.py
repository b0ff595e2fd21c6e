"""engine.write_behind: blocks written in the order they were queued (futures waited on in that order,
whatever order they finish in), failures raised on the merge's thread, abort drops what is queued."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from mergepipe.engine.write_behind import WriteBehind
from mergepipe.errors import ExecutionError


class Recorder:
    def __init__(self, fail_at: int | None = None):
        self.writes: list[tuple[int, bytes]] = []
        self.fail_at = fail_at

    def write(self, offset, data):
        if offset == self.fail_at:
            raise ExecutionError(f"writing at {offset}: no space left on device")
        self.writes.append((offset, bytes(data)))


def test_blocks_are_written_in_queue_order_whatever_order_merges_finish():
    rec, timing, written = Recorder(), {}, []
    wb = WriteBehind(3, timing, on_written=written.append)
    with ThreadPoolExecutor(4) as pool:
        for i in range(12):  # later blocks finish first
            fut = pool.submit(lambda i=i: (time.sleep(0.002 * (12 - i)), memoryview(bytes([i]) * 4))[1])
            wb.put(rec, 4 * i, fut if i % 2 else memoryview(bytes([i]) * 4), tag=i)
        wb.close()
    assert rec.writes == [(4 * i, bytes([i]) * 4) for i in range(12)]
    assert written == list(range(12))
    assert timing["write_s"] >= 0


def test_a_failed_write_is_raised_by_the_next_put_or_by_close():
    rec = Recorder(fail_at=8)
    wb = WriteBehind(2)
    for i in range(3):
        wb.put(rec, 4 * i, memoryview(b"abcd"))
    with pytest.raises(ExecutionError, match="writing at 8: no space left on device"):
        for i in range(3, 50):  # the writer drains the queue after the failure, so put never blocks for good
            wb.put(rec, 4 * i, memoryview(b"abcd"))
        wb.close()
    assert [o for o, _ in rec.writes] == [0, 4]


def test_a_failed_merge_task_is_raised_and_nothing_after_it_is_written():
    rec, wb = Recorder(), WriteBehind(4)
    bad: Future = Future()
    bad.set_exception(ExecutionError("the merge of tensor t (block 1) gives 3 non-finite values"))
    wb.put(rec, 0, memoryview(b"ok"))
    wb.put(rec, 2, bad)
    wb.put(rec, 4, memoryview(b"no"))
    with pytest.raises(ExecutionError, match="non-finite"):
        wb.close()
    assert rec.writes == [(0, b"ok")]


class TakenFuture(Future):
    """A future that says when the writer thread starts waiting for it."""

    def __init__(self):
        super().__init__()
        self.taken = threading.Event()

    def result(self, timeout=None):
        self.taken.set()
        return super().result(timeout)


def test_abort_drops_the_queue_and_returns():
    rec, wb, gate = Recorder(), WriteBehind(8), threading.Event()
    slow = TakenFuture()
    wb.put(rec, 0, slow)
    for i in range(1, 5):
        wb.put(rec, 4 * i, memoryview(b"abcd"))
    assert slow.taken.wait(10)  # block 0 is being written: abort must wait for it
    # the gate opens before the block arrives: abort returning with it shut would not have waited
    threading.Timer(0.05, lambda: (gate.set(), slow.set_result(memoryview(b"abcd")))).start()
    wb.abort()
    assert gate.is_set()
    assert len(rec.writes) <= 1
