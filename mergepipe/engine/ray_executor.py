"""Range tasks on a Ray cluster (the optional ``ray`` extra: ``pip install 'mergepipe[ray]'``).

Each range task (:func:`mergepipe.engine.ranges.run_range`) is a Ray task of one CPU that reads its
inputs from shared storage (local paths on a filesystem every node mounts, or a remote backend) and
writes its range of the output shards in the driver's staging directory (which must be on that shared
filesystem); only the plan goes out (once, through the object store) and only counters come back.
A task whose worker process dies is run again by Ray (``retries`` times); a task that raises is not
(a MergePipeError is a verdict, not a fault) and its error fails the merge, which publishes nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mergepipe.engine.executor import RangeExecutor
from mergepipe.errors import ExecutionError, MergePipeError

INSTALL_HINT = "--executor ray needs Ray, which is not installed: pip install 'mergepipe[ray]'"
CANCEL_WAIT_S = 60


def import_ray():
    try:
        import ray
    except ImportError:
        raise MergePipeError(INSTALL_HINT) from None
    return ray


def runtime_env() -> dict:
    """Workers import this mergepipe: the directory holding the package goes first on their PYTHONPATH
    (a source checkout, an editable install, or site-packages; on other nodes the same path must hold
    it, e.g. a shared filesystem or the same install)."""
    root = str(Path(__file__).resolve().parents[2])
    path = [root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(path)}}


def connect(address: str | None = None):
    """Ray, connected: the running session if any, else ``address`` (``auto``, ``ray://host:port``,
    ``host:port``), else a new local cluster on this machine's cores."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, runtime_env=runtime_env(),
                     logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ExecutionError(f"cannot connect to the Ray cluster at {address}: {exc}") from None
    return ray


class RayExecutor(RangeExecutor):
    """Range tasks as Ray tasks (``num_cpus`` each, retried ``retries`` times if their worker dies);
    ``tasks``: how many to cut the plan into (default: 4 per CPU of the cluster)."""

    def __init__(self, address: str | None = None, retries: int = 3, tasks: int | None = None,
                 num_cpus: float = 1):
        self.ray = connect(address)
        self.retries, self.task_count, self.num_cpus = retries, tasks, num_cpus

    def warm_up(self) -> float:
        """Start one worker per task slot and load the merge code and kernels in it (a worker's first task
        otherwise pays for importing torch and numba); returns the seconds it took."""
        import time
        t0 = time.perf_counter()
        warm = self.ray.remote(num_cpus=self.num_cpus)(_warm_worker)
        self.ray.get([warm.remote() for _ in range(self.workers())])
        return time.perf_counter() - t0

    def workers(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("CPU", 1) // self.num_cpus))

    def run_tasks(self, fn, shared, tasks: list, on_done=None) -> list:
        ray = self.ray
        remote = ray.remote(num_cpus=self.num_cpus, max_retries=self.retries)(fn)
        shared_ref = ray.put(shared)
        refs = [remote.remote(shared_ref, t) for t in tasks]
        index = {r: i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    i = index[ref]
                    results[i] = self._get(ref, tasks[i])
                    if on_done:
                        on_done(i, results[i])
        except BaseException:
            self._cancel(pending)
            raise
        return results

    def _get(self, ref, task):
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, MergePipeError):
                raise exc.cause from None
            raise ExecutionError(f"merge task {task} failed on Ray: {type(exc.cause).__name__}: {exc.cause}; "
                                 "nothing was published") from None
        except ray.exceptions.RayError as exc:  # a worker or node died more often than it was retried
            raise ExecutionError(f"merge task {task} did not finish on Ray ({type(exc).__name__}, "
                                 f"{self.retries} retries); nothing was published") from None

    def _cancel(self, refs) -> None:
        """Stop the other tasks before the staging directory goes away."""
        ray = self.ray
        for ref in refs:
            ray.cancel(ref, force=True)
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)


def _warm_worker() -> None:
    import time

    from mergepipe.engine.blocks import warm_kernels
    from mergepipe.engine.ranges import run_range  # noqa: F401
    warm_kernels()
    time.sleep(0.5)  # hold this worker so the next warm-up task starts another
