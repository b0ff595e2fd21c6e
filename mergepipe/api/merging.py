"""Merging: an Engine on an executor (local or Ray), executing plans, planning and executing a request in one
call, incremental merges (add, remove or reweight one expert of a snapshot), ANALYZE, and the summaries
the CLI prints."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.api.planning import merge_request, plan
from mergepipe.catalog.db import Catalog
from mergepipe.engine.txn import check_output_path
from mergepipe.errors import ExecutionError, MergePipeError
from mergepipe.storage.paths import check_output

if TYPE_CHECKING:
    from mergepipe.planner.plan import Plan
    from mergepipe.planner.request import MergeRequest


EXECUTORS = ("local", "ray")


def make_engine(catalog: Catalog, executor: str = "local", address: str | None = None):
    """An Engine whose merges run on ``executor``: ``local`` (threads in this process) or ``ray`` (range
    tasks on the Ray cluster at ``address``, or a new local one; needs the ``ray`` extra)."""
    from mergepipe.engine.engine import Engine
    if executor not in EXECUTORS:
        raise MergePipeError(f"unknown executor {executor!r}; choose one of: {', '.join(EXECUTORS)}")
    if executor == "local":
        if address is not None:
            raise MergePipeError("--address goes with --executor ray")
        return Engine(catalog)
    from mergepipe.engine.ray_executor import RayExecutor
    return Engine(catalog, executor=RayExecutor(address))


def execute(catalog: Catalog, plan: Plan | str, out, model_id: str | None = None, out_shard_bytes: int | None = None,
            progress=None, run_id: int | None = None, executor: str = "local", address: str | None = None):
    """Execute a plan (or a stored plan's id) on ``executor`` (``local`` or ``ray``, see make_engine);
    returns (snapshot_id, manifest)."""
    if executor == "local" and not isinstance(plan, str):  # the disk works while the engine and numba load
        from mergepipe.engine.prefetch import start_warm_up
        start_warm_up(plan)
    from mergepipe.engine.engine import DEFAULT_SHARD_BYTES
    if out_shard_bytes is None:
        out_shard_bytes = DEFAULT_SHARD_BYTES
    engine = make_engine(catalog, executor, address)
    return engine.execute(plan, out=out, model_id=model_id, out_shard_bytes=out_shard_bytes,
                          progress=progress, **({"run_id": run_id} if run_id is not None else {}))


def analyze(catalog: Catalog, model_ids=None, progress=None, **kw):
    """ANALYZE experts (default: every registered model with a base); see analyze.runner.analyze."""
    import mergepipe.ops.numba_setup  # noqa: F401  (numba's start-up without scipy.linalg, before ANALYZE's kernels)
    from mergepipe.analyze.runner import analyze as run_analyze
    return run_analyze(catalog, model_ids, progress=progress, **kw)


def run(catalog: Catalog, request: MergeRequest, out=None, model_id: str | None = None,
        out_shard_bytes: int | None = None, progress=None):
    """Plan and execute a merge request (``out``/``model_id``: the request's unless given); returns
    (plan, snapshot_id, manifest)."""
    # The engine stores the plan after its own checks (output path, model id): a refused merge
    # changes nothing in the catalog.
    out = request.out if out is None else out
    if out is None:
        raise ExecutionError("a merge needs an output directory")
    p = plan(catalog, request, save=False)
    snapshot_id, manifest = execute(catalog, p, out, model_id or request.model_id, out_shard_bytes, progress)
    return p, snapshot_id, manifest


def merge(catalog: Catalog, base: str, experts, out, operator: str = "linear", model_id: str | None = None,
          out_shard_bytes: int | None = None, progress=None, **settings):
    """Plan and execute; returns (plan, snapshot_id, manifest). ``run`` with a request built from the settings."""
    return run(catalog, merge_request(base, experts, operator, **settings), out, model_id, out_shard_bytes, progress)


def check_target(catalog: Catalog, out, model_id: str | None = None) -> tuple[Path, str]:
    """The output directory and merged model id a merge would use, refused now if either is taken
    (the engine checks again; checking first spares registering and analyzing for nothing)."""
    from mergepipe.storage.publish import check_remote_output, is_remote
    remote = is_remote(out)
    out = check_remote_output(str(out)) if remote else check_output(out)
    model_id = model_id or (out.rsplit("/", 1)[-1] if remote else out.name)
    if catalog.has_model(model_id):
        raise ExecutionError(f"model id {model_id!r} is already registered; choose another --model-id")
    if not remote:
        check_output_path(out)
    return out, model_id


def extend_request(snapshot: str, action: str, expert: str, weight=None, budget=None, out=None,
                   model_id: str | None = None):
    """A validated incremental request: ``action`` add, remove or reweight one ``expert`` of ``snapshot``."""
    from mergepipe.planner.extend import ExtendRequest
    return ExtendRequest.build(snapshot, action, expert, weight=weight, budget=budget, out=out, model_id=model_id)


def plan_extend(catalog: Catalog, request, save: bool = False) -> Plan:
    """Plan an incremental merge (reads no tensor byte); refused for operators that are not additive."""
    from mergepipe.planner.extend import plan_extend as make
    from mergepipe.planner.plan import save_plan as store
    p = make(catalog, request)
    if save:
        store(catalog, p)
    return p


def extend(catalog: Catalog, request, out_shard_bytes: int | None = None, progress=None):
    """Add, remove or reweight one expert of a published snapshot, reading the snapshot and that expert
    only; returns (plan, snapshot_id, manifest). A refused change leaves the catalog unchanged."""
    if request.out is None:
        raise ExecutionError("an incremental merge needs an output directory (--out)")
    p = plan_extend(catalog, request)
    snapshot_id, manifest = execute(catalog, p, request.out, request.model_id, out_shard_bytes, progress)
    return p, snapshot_id, manifest


def merge_summary(plan: Plan, manifest) -> dict:
    core = manifest.core
    return {
        "snapshot_id": manifest.snapshot_id, "model_id": manifest.run["model_id"], "out": manifest.run["out"],
        "plan_id": plan.id, "manifest_hash": manifest.manifest_hash, "operator": plan.operator,
        "budget_bytes": plan.budget_bytes, "full_expert_bytes": plan.full_expert_bytes,
        "estimated": core["estimated"], "realized": core["realized"], "error_bound": plan.error_bound,
        "seconds": manifest.run["seconds"], "timing": manifest.run["timing"],
        "budget": plan.budget["spec"], "first_merge": bool(plan.budget.get("first_merge")),
        # what the merge actually read, in % of the full expert read (a first merge: everything, whatever was asked)
        "budget_used_pct": round(100.0 * (core["realized"]["expert_read"] + core["realized"].get("compact_read", 0))
                                 / plan.full_expert_bytes, 2) if plan.full_expert_bytes else 100.0,
        "tiers": plan.tiers,
    }


def extend_summary(plan: Plan, manifest) -> dict:
    """What `merge --extend` reports: the merge summary plus the parent, the change and the reads."""
    fs = plan.from_scratch_estimate
    return {**merge_summary(plan, manifest), "extends": plan.parent["snapshot_id"], "change": plan.change,
            "from_scratch_read": fs["base_read"] + fs["expert_read"]}
