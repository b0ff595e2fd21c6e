"""Sweeps: a sweep config's points planned up front, recorded, and run on the config's executor."""

from __future__ import annotations

from mergepipe.api.merging import check_target
from mergepipe.catalog.db import Catalog
from mergepipe.errors import ExecutionError, MergePipeError


def load_sweep(path):
    """A sweep config (YAML, see mergepipe.config.sweep), checked but not planned."""
    from mergepipe.config.sweep import load_sweep as load
    return load(path)


def run_sweep(catalog: Catalog, config, evaluate=None, on_point=None) -> dict:
    """Plan every point of a sweep config (refusing the sweep before any merge when one cannot be
    planned, or its output or model id is taken), record the sweep, run the points on the config's
    executor and record each one's outcome (``evaluate(out_dir) -> (metric, value)`` scores each
    output). Returns {sweep_id, name, points: [rows]}."""
    from mergepipe.catalog.sweeps import start_sweep
    from mergepipe.engine.sweep import run_sweep as run
    created = not config.out.exists()
    try:
        config.out.mkdir(exist_ok=True)
    except OSError as exc:
        raise ExecutionError(f"{config.out}: cannot create the sweep's output directory ({exc.strerror})") from None
    try:
        if all(not isinstance(n, str) or catalog.has_model(n) for n in (config.base, *config.experts)):
            points = _plan_points(catalog, config)
        else:  # models named by Hub repo id, path or URI: registered only if every point plans
            with catalog.transaction():
                config = _registered(catalog, config)
                points = _plan_points(catalog, config)
    except BaseException:
        if created:
            config.out.rmdir()
        raise
    sweep_id = start_sweep(catalog, config.name, config.source, config.executor, config.points)
    rows = run(catalog, sweep_id, points, config.executor, config.address, config.concurrency, evaluate, on_point)
    return {"sweep_id": sweep_id, "name": config.name, "points": rows}


def _registered(catalog: Catalog, config):
    """The config with its base and experts as catalog ids (Hub repo ids, paths and URIs registered: api/hub.py)."""
    import dataclasses
    from mergepipe.api.hub import register_references
    base, experts = register_references(catalog, config.base, config.experts)
    return dataclasses.replace(config, base=base, experts=experts)


def _plan_points(catalog: Catalog, config) -> list:
    from mergepipe.engine.sweep import SweepPoint
    from mergepipe.planner.context import Planner
    from mergepipe.planner.request import MergeRequest
    points, taken = [], set()
    for i, settings in enumerate(config.points):
        kw = dict(settings)
        try:
            request = MergeRequest.build(config.base, config.experts, kw.pop("operator", "linear"), **kw)
            plan = Planner(catalog).plan(request, save=False)
            out, model_id = check_target(catalog, config.out / config.point_name(i), config.point_name(i))
        except MergePipeError as exc:
            raise type(exc)(f"sweep point {i} {settings}: {exc}") from None
        if model_id in taken:
            raise ExecutionError(f"sweep point {i}: model id {model_id!r} is used twice")
        taken.add(model_id)
        points.append(SweepPoint(i, settings, plan, out, model_id))
    return points
