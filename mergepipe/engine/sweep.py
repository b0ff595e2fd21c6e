"""Merge sweeps: many planned merges run on one executor, each point's outcome recorded in the catalog.

Every point is planned first (in this process; planning reads no tensor byte), so a point that cannot
be planned stops the sweep before anything is merged. Then the points run: on the local executor one
after another; on Ray up to ``concurrency`` merges at once, each one cut into range tasks by the
:class:`~mergepipe.engine.ray_executor.RayExecutor` (so Ray balances the tasks of all the merges in
flight over the cluster). Each point is an ordinary merge: published atomically and committed by this
process, or publishing nothing. A point that fails is recorded as failed with its error and the sweep
goes on; ``evaluate(out_dir) -> (metric, value)``, when given, scores each published output.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mergepipe.catalog import sweeps as table
from mergepipe.catalog.db import Catalog
from mergepipe.engine.engine import _NOT_OURS, Engine, _own_sigterm, _raise_interrupt
from mergepipe.errors import MergePipeError
from mergepipe.planner.plan import Plan


# Evaluations run one at a time (they use every core, and model loading imports lazily, not thread-safely).
_EVALUATING = threading.Lock()


@dataclass
class SweepPoint:
    index: int
    settings: dict
    plan: Plan
    out: Path
    model_id: str


def run_sweep(catalog: Catalog, sweep_id: str, points: list[SweepPoint], executor: str = "local",
              address: str | None = None, concurrency: int = 1, evaluate=None, on_point=None) -> list[dict]:
    """Run the planned ``points`` (recorded by catalog.sweeps.start_sweep); returns the point rows.
    ``on_point(row)`` after each point."""
    range_executor = None
    if executor == "ray":
        from mergepipe.engine.ray_executor import RayExecutor
        range_executor = RayExecutor(address)
    # Engines set a SIGTERM handler only when none is set, and only the main thread may: set it here.
    previous = _own_sigterm()
    if previous is not _NOT_OURS and previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _raise_interrupt)
    status = "cancelled"
    try:
        if range_executor is None:
            for p in points:
                _run_point(catalog, sweep_id, p, None, evaluate, on_point)
        else:
            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="mergepipe-sweep") as pool:
                futures = [pool.submit(_run_point_own_catalog, catalog.path, sweep_id, p, range_executor, evaluate,
                                       on_point) for p in points]
                for f in futures:
                    f.result()
        rows = table.sweep_points(catalog, sweep_id)
        status = "done" if all(r["status"] == "published" for r in rows) else "failed"
        return rows
    finally:
        table.finish_sweep(catalog, sweep_id, status)
        if previous is not _NOT_OURS and previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_point_own_catalog(path, sweep_id, point, range_executor, evaluate, on_point) -> None:
    catalog = Catalog(path)  # a connection per thread
    try:
        _run_point(catalog, sweep_id, point, range_executor, evaluate, on_point)
    finally:
        catalog.close()


def _run_point(catalog: Catalog, sweep_id: str, point: SweepPoint, range_executor, evaluate, on_point) -> None:
    plan = point.plan
    values = {"plan_id": plan.id, "model_id": point.model_id, "budget_bytes": plan.budget_bytes,
              "full_expert_bytes": plan.full_expert_bytes,
              "error_bound": (plan.error_bound or {}).get("relative")}
    t0 = time.perf_counter()
    try:
        engine = Engine(catalog, executor=range_executor) if range_executor else Engine(catalog)
        snapshot_id, manifest = engine.execute(plan, out=point.out, model_id=point.model_id)
        values.update(snapshot_id=snapshot_id, expert_read=manifest.core["realized"]["expert_read"],
                      seconds=round(time.perf_counter() - t0, 4))
        status = "published"
    except MergePipeError as exc:
        values.update(error=str(exc), seconds=round(time.perf_counter() - t0, 4))
        status = "failed"
    if status == "published" and evaluate is not None:
        try:
            with _EVALUATING:
                values["metric"], values["quality"] = evaluate(point.out)
        except Exception as exc:  # noqa: BLE001  (the snapshot stands; the point records why it has no score)
            values["error"] = f"evaluation failed: {type(exc).__name__}: {exc}"
            status = "unevaluated"
    table.record_point(catalog, sweep_id, point.index, status, **values)
    if on_point:
        on_point({"point": point.index, "status": status, **values})
