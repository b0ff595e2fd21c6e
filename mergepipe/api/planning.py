"""Planning: operators and their parameters, compact codecs, merge requests, plans (reading no expert byte),
fast re-planning sessions and EXPLAIN."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.plans import find_plan_id, has_plan
from mergepipe.errors import MergePipeError
from mergepipe.manifest.verify import load_manifest

if TYPE_CHECKING:
    from mergepipe.planner.plan import Plan
    from mergepipe.planner.request import MergeRequest


def operators() -> list:
    """The operators' declarations (OpSpec: name, aliases, reference, parameters), in listing order."""
    from mergepipe.ops.core import OPERATORS
    return list(OPERATORS.values())


def parameters() -> tuple:
    """Every operator parameter declared (ops/spec.py Param: name, default, range, help, per tensor)."""
    from mergepipe.ops.core import all_parameters
    return all_parameters()


def operator_spec(name: str):
    """One operator's declaration (ops/spec.py OpSpec) by name or alias; a PlanError names the choices."""
    from mergepipe.ops.core import get_op
    return get_op(name)


def compact_codecs() -> list[tuple[str, str]]:
    """(name, what it stores) of every compact codec ANALYZE can store (storage/compact.py)."""
    from mergepipe.storage.codecs import Codec
    return [(c.value, c.help) for c in Codec]


def compact_modes() -> tuple[str, ...]:
    """What a merge request's ``compact`` takes: auto, off or a codec name (planner/request.py)."""
    from mergepipe.storage.codecs import COMPACT_MODES
    return COMPACT_MODES


def compact_growth_text(compact_bytes: int, expert_bytes: int) -> str:
    """"+6.6 % of expert bytes": the catalog growth of compact deltas."""
    from mergepipe.storage.codecs import growth_text
    return growth_text(compact_bytes, expert_bytes)


def codec(name: str):
    """A compact codec by name (storage/codecs.py: its levels, stored level, help)."""
    from mergepipe.storage.codecs import codec as _codec
    return _codec(name)


def merge_request(base: str, experts, operator: str = "linear", **settings) -> MergeRequest:
    """A validated :class:`MergeRequest` from keyword settings (``weights``, ``density``, ``lam``,
    ``normalize``, ``rescale``, ``gamma``, ``epsilon``, ``budget``, ``budget_mb``, ``target_bound``,
    ``strategy``, ``seed``, ``out``, ``model_id``); ``run(catalog, merge_request(...))`` merges it."""
    from mergepipe.planner.request import MergeRequest
    return MergeRequest.build(base, experts, operator, **settings)


def plan(catalog: Catalog, request: MergeRequest, save: bool = True) -> Plan:
    """Plan a merge request (reads no expert byte); stored in the catalog unless ``save=False``."""
    from mergepipe.planner.context import Planner
    return Planner(catalog).plan(request, save=save)


def plan_merge(catalog: Catalog, base: str, experts, operator: str = "linear", save: bool = True, **settings) -> Plan:
    """``plan(catalog, request(base, experts, operator, **settings))``."""
    return plan(catalog, merge_request(base, experts, operator, **settings), save=save)


def plan_session(catalog: Catalog, request: MergeRequest):
    """A PlanContext of ``request`` ready for fast re-planning: ``session.plan(Budget...)`` plans again at
    another budget without re-reading the catalog (for an additive operator the sketch-based norm estimate
    is computed now). The plans are those of :func:`plan` for the same request and budget."""
    from mergepipe.planner.context import PlanContext
    ctx = PlanContext(catalog, request)
    if ctx.op.additive:
        ctx.full_norm_estimate()
    return ctx


def block_count(tensor: dict, block_bytes: int) -> int:
    """How many blocks a catalog tensor row (name, dtype, shape, file, offset, nbytes) has on a grid."""
    from mergepipe.storage.grid import tensor_grid
    from mergepipe.storage.safetensors import TensorInfo
    t = tensor
    return len(tensor_grid(TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), t["file"], t["offset"], t["nbytes"]),
                           block_bytes))


def as_plan(plan) -> Plan:
    """A Plan from a Plan or its data (planner/plan.py as_plan): the dashboard reads either through its accessors."""
    from mergepipe.planner.plan import as_plan as _as_plan
    return _as_plan(plan)


def explain(catalog: Catalog, ref: str, experts_top: int | None = 16, experts: str | None = None) -> str:
    """EXPLAIN a plan (by plan id) or a snapshot (by snapshot/model id or directory: its plan + realized).
    ``experts_top``: experts listed, the top ones by bytes read (None: all); ``experts``: an fnmatch pattern of
    expert ids to list."""
    from mergepipe.planner.plan import load_plan
    plan_id = find_plan_id(catalog, ref)
    if plan_id is not None:
        return load_plan(catalog, plan_id).explain(experts_top, experts)
    try:
        manifest = load_manifest(catalog, ref)
    except MergePipeError:
        raise MergePipeError(f"unknown plan or snapshot {ref!r}") from None
    core = manifest.core
    text = load_plan(catalog, core["plan_id"]).explain(experts_top, experts) if has_plan(
        catalog, core["plan_id"]) else f"PLAN {core['plan_id']}"
    from mergepipe.planner.explain import realized_line
    return (f"SNAPSHOT {manifest.snapshot_id}  model {manifest.run['model_id']}  at {manifest.run['out']}\n"
            f"  manifest   {manifest.manifest_hash}\n"
            + realized_line(core["realized"], core["estimated"]) + "\n" + text)
