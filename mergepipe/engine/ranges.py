"""A merge as range tasks: the driver lays out the output, workers merge contiguous runs of it in place.

The driver (:class:`RangeMerge`) builds the same work list as the local pipeline (groups of grid blocks
in output order), pre-creates every output shard at its final size with its header, and cuts the work
into tasks of consecutive work items (whole tensors, or block groups of one tensor; at tensor boundaries
only when a LoRA source reads a per-tensor factor once per tensor). A task (:func:`run_range`, run by a
:class:`~mergepipe.engine.executor.RangeExecutor` wherever it likes) runs a :class:`RangeWorker`: the
local pipeline restricted to its slice, reading its own base and expert byte ranges through the storage
registry and writing its blocks with positioned writes into the pre-created shards. A task returns only
counters (bytes read per expert, base bytes read, bytes written, blocks touched): no tensor byte passes
through the driver. The driver then checks that every output byte was written exactly once, hashes the
shards, completes the snapshot's files and checks the summed reads against the plan; the engine
publishes and commits as for a local merge.

Writes are positioned and a task always writes the same bytes at the same offsets, so a task whose
worker died may be run again; only a task that finished returns counters, so retries are not counted
twice.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from mergepipe.engine.executor import LocalExecutor, RangeExecutor
from mergepipe.engine.pipeline import MergePipeline, finish_snapshot
from mergepipe.errors import ExecutionError
from mergepipe.manifest.build import file_sha256
from mergepipe.planner.plan import Plan
from mergepipe.storage.writers import write_failure

# Test-only fault injection: a path; the first range task to create it kills its own worker process
# (SIGKILL) right after its first write, so a test can check what a real worker death does.
KILL_ENV = "MERGEPIPE_FAULT_KILL_RANGE_TASK"
TASKS_PER_WORKER = 4


@dataclass
class RangeSettings:
    """The engine settings a range task runs with (one compute thread per task: a task is a process)."""
    group_bytes: int
    group_read_bytes: int
    readahead: int
    inflight_bytes: int
    fused: bool
    workers: int = 1
    threads: int = 1

    def make_executor(self) -> LocalExecutor:
        return LocalExecutor(self.workers, self.threads)


class RangeWriter:
    """Positioned writes into one pre-created output shard, counting the bytes written."""

    def __init__(self, path: Path, kill_marker: str | None = None):
        self.path, self.kill_marker = path, kill_marker
        self.fd = -1
        self.written = 0

    def write(self, offset: int, data) -> None:
        view = memoryview(data).cast("B")
        try:
            if self.fd < 0:
                self.fd = os.open(self.path, os.O_WRONLY)
            done = 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            self.close()
            raise write_failure(exc, "writing", self.path) from exc
        self.written += len(view)
        if self.kill_marker:
            _kill_once(self.kill_marker)

    def close(self) -> int:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        return self.written


def _kill_once(marker: str) -> None:
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


class RangeWorker(MergePipeline):
    """The local pipeline over work items ``first:stop``, writing into the driver's pre-created shards."""

    def __init__(self, settings: RangeSettings, plan: Plan, staging: Path, out_shard_bytes: int,
                 first: int, stop: int, kill_marker: str | None = None):
        self.first, self.stop, self.kill_marker = first, stop, kill_marker
        super().__init__(settings, plan, staging, out_shard_bytes, None)

    def select_work(self, work: list) -> list:
        return work[self.first:self.stop]

    def open_writers(self) -> dict:
        return {s.fname: RangeWriter(self.staging / s.fname, self.kill_marker) for s in self.shards}

    def finish(self) -> dict:
        return {"expert_read": [r.bytes_read for r in self.readers], "base_read": self.input_bytes_read(),
                "written": sum(w.close() for w in self.writers.values()), "by_tensor": self.by_tensor,
                "touched": self.touched, "timing": self.timing, "blocks": self.total_blocks}


def run_range(shared: tuple, task: tuple[int, int]) -> dict:
    """One range task: ``shared`` = (settings, plan data, staging, out_shard_bytes, kill marker),
    ``task`` = (first, stop) work items. Returns the task's counters."""
    from mergepipe.engine import threads as torch_threads

    settings, plan_data, staging, out_shard_bytes, kill_marker = shared
    torch_threads.want(settings.threads)  # applied if and when this task uses torch
    worker = RangeWorker(settings, Plan(plan_data), Path(staging), out_shard_bytes, task[0], task[1], kill_marker)
    return worker.run()


class ShardLayout(MergePipeline):
    """The driver's view of the pipeline: the work list and the output shards, which it pre-creates
    (final size, header written); it reads and writes no tensor byte."""

    def open_writers(self) -> dict:
        for shard in self.shards:
            path = self.staging / shard.fname
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.ftruncate(fd, shard.size)
                    os.pwrite(fd, shard.header, 0)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise write_failure(exc, "creating", path) from exc
        return {}

    def close_inputs(self) -> None:
        for r in [*self.readers, *{id(r): r for r in [self.base_reader, *self.input_readers.values()]}.values()]:
            r.close()

    def tasks(self, count: int) -> list[tuple[int, int]]:
        """Cut the work into about ``count`` runs of consecutive items of similar read cost."""
        costs = [sum(self.span_cost(info, s) for s in group) for info, group in self.work]
        whole_tensors = any(e["kind"] == "lora" for e in self.experts)
        target = max(1, sum(costs) // max(1, count))
        tasks, first, acc = [], 0, 0
        for i, (cost, (info, _)) in enumerate(zip(costs, self.work)):
            whole = whole_tensors or (self.vocab_rows is not None and self.vocab_rows.covers(info.name))
            boundary = i > first and (not whole or info.name != self.work[i - 1][0].name)
            if boundary and acc >= target:
                tasks.append((first, i))
                first, acc = i, 0
            acc += cost
        if first < len(self.work):
            tasks.append((first, len(self.work)))
        return tasks


class RangeMerge:
    """Runs a plan as range tasks on ``executor`` into ``staging``; :meth:`run` returns what the
    manifest needs, like :meth:`MergePipeline.run`."""

    def __init__(self, engine, plan: Plan, staging: Path, out_shard_bytes: int, progress):
        if plan.analyzed_on_the_way:
            raise ExecutionError("a merge on range tasks needs analyzed experts (it cannot analyze on the way): "
                                 "run `mergepipe analyze` first, or merge with the local executor")
        self.plan, self.staging, self.out_shard_bytes, self.progress = plan, staging, out_shard_bytes, progress
        self.settings = RangeSettings(engine.group_bytes, engine.group_read_bytes, engine.readahead,
                                      engine.inflight_bytes, engine.fused)

    def run(self, executor: RangeExecutor) -> dict:
        layout = ShardLayout(self.settings, self.plan, self.staging, self.out_shard_bytes, None)
        layout.close_inputs()
        tasks = layout.tasks(getattr(executor, "task_count", None) or TASKS_PER_WORKER * executor.workers())
        shared = (self.settings, self.plan.data, str(self.staging), self.out_shard_bytes, os.environ.get(KILL_ENV))
        done = [0]

        def on_done(_, counters):
            done[0] += counters["blocks"]
            if self.progress:
                self.progress(done[0], layout.total_blocks, 0)
        results = executor.run_tasks(run_range, shared, tasks, on_done)
        return self.finish(layout, results)

    def finish(self, layout: ShardLayout, results: list[dict]) -> dict:
        plan, experts = self.plan, self.plan.experts
        data_bytes = sum(s.size - len(s.header) for s in layout.shards)
        written = sum(r["written"] for r in results)
        if written != data_bytes:
            raise ExecutionError(f"range tasks wrote {written} B of {data_bytes} B of tensor data; nothing was "
                                 "published")
        outputs = {s.fname: {"sha256": file_sha256(self.staging / s.fname), "bytes": s.size} for s in layout.shards}
        realized = {e["id"]: sum(r["expert_read"][i] for r in results) for i, e in enumerate(experts)}
        by_tensor: dict[str, int] = {}
        touched: dict[str, dict[str, list[int]]] = {e["id"]: {} for e in experts}
        timing: dict[str, float] = {}
        for r in results:  # in task order, i.e. output order, like the local pipeline's
            for name, n in r["by_tensor"].items():
                by_tensor[name] = by_tensor.get(name, 0) + n
            for eid, tensors in r["touched"].items():
                for name, blocks in tensors.items():
                    touched[eid].setdefault(name, []).extend(blocks)
            for k, v in r["timing"].items():
                timing[k] = timing.get(k, 0.0) + v
        return finish_snapshot(plan, layout.base_ck, self.staging, layout.shards, outputs, realized, {
            "realized_by_tensor": by_tensor, "touched": touched, "base_read": sum(r["base_read"] for r in results),
            "timing": timing, "inflight": None, "analysis_read": {}, "tasks": len(results)})
