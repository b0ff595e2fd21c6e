"""Range tasks on a Ray cluster (the optional ``ray`` extra: ``pip install 'mergepipe[ray]'``).

Each range task (:func:`mergepipe.engine.ranges.run_range`) is a Ray task of one CPU that reads its
inputs from shared storage (local paths on a filesystem every node mounts, or a remote backend) and
writes its range of the output shards in the driver's staging directory (which must be on that shared
filesystem); only the plan goes out (once, through the object store) and only counters come back.
A task whose worker process dies is run again by Ray (``retries`` times); a task that raises is not
(a MergePipeError is a verdict, not a fault) and its error fails the merge, which publishes nothing.

A local cluster (no ``address``) listens on 127.0.0.1 only -- GCS, raylet (node and object manager),
runtime-env agent, workers; no dashboard -- and, where the installed Ray has it (>= 2.52), with Ray's token
authentication on: a fresh random token in this process's environment, which the Ray processes it
starts inherit (none is written to ~/.ray). ``address`` joins a cluster the user started: its exposure
(interfaces, authentication, dashboard) is that cluster's configuration, and this process serves its
own worker endpoint to that cluster's nodes.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from contextlib import contextmanager
from pathlib import Path

from mergepipe.engine.executor import RangeExecutor
from mergepipe.errors import ExecutionError, MergePipeError

INSTALL_HINT = "--executor ray needs Ray, which is not installed: pip install 'mergepipe[ray]'"
CANCEL_WAIT_S = 60
LOOPBACK = "127.0.0.1"


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
    ``host:port``), else a new local cluster on this machine's cores, on loopback only."""
    local = _starts_local(address)
    if local and not _ray_initialized():
        _token_auth()
    ray = import_ray()
    if not ray.is_initialized():
        try:
            with _loopback_node(ray, local):
                ray.init(address=address, include_dashboard=False, dashboard_host=LOOPBACK,
                         runtime_env=runtime_env(), logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ExecutionError(f"cannot connect to the Ray cluster at {address}: {exc}") from None
        if local:
            _check_loopback(ray)
    return ray


def _starts_local(address: str | None) -> bool:
    return address == "local" or (address is None and not os.environ.get("RAY_ADDRESS"))


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray and ray.is_initialized())


def _token_auth() -> None:
    """Token authentication for the local cluster about to start. Ray reads RAY_AUTH_MODE when it is
    imported, so an already imported Ray re-reads its configuration (as ray.init itself does when it
    turns the mode on)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    if "ray" in sys.modules:
        try:
            from ray._raylet import AuthenticationTokenLoader, Config
        except ImportError:  # a Ray without token authentication
            return
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def _loopback_node(ray, local: bool):
    """A new local node takes 127.0.0.1 as its address, and Ray binds its servers to the node's address.
    Ray turns an explicit ``_node_ip_address="127.0.0.1"`` into the machine's routable address; it
    keeps loopback only where clusters are off (its Windows/macOS default), which this switch selects."""
    consts = ray._private.ray_constants
    saved = consts.ENABLE_RAY_CLUSTER
    consts.ENABLE_RAY_CLUSTER = saved and not local
    try:
        yield
    finally:
        consts.ENABLE_RAY_CLUSTER = saved


def _check_loopback(ray) -> None:
    """Refuse to run on a local cluster that did not come up on loopback (a Ray that changed how it
    chooses the node's address)."""
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise ExecutionError(f"the local Ray cluster came up on {node_ip}, not {LOOPBACK}; start one yourself "
                             "and pass --address")


class RayExecutor(RangeExecutor):
    """Range tasks as Ray tasks (``num_cpus`` each, retried ``retries`` times if their worker dies);
    ``tasks``: how many to cut the plan into (default: 4 per CPU of the cluster)."""

    def __init__(self, address: str | None = None, retries: int = 3, tasks: int | None = None,
                 num_cpus: float = 1):
        self.ray = connect(address)
        self.retries, self.task_count, self.num_cpus = retries, tasks, num_cpus

    def warm_up(self) -> float:
        """Start one worker per task slot and load the merge code and kernels in it (a worker's first task
        otherwise pays for importing the engine and numba); returns the seconds it took."""
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
