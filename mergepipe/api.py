"""The Python API: what the CLI and the dashboard call. Thin over catalog, planner, engine, manifest.

Importing it imports no torch: the catalog-only calls (register, snapshots, lineage, verify, recover)
start fast; planning and merging import the planner and the engine when first called.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.catalog.db import Catalog, integrity_findings
from mergepipe.catalog.models import check_unchanged, has_tensor, named_by_path, register, register_many, schema_version  # noqa: F401
from mergepipe.catalog.analyses import outlier_warnings  # noqa: F401  (an expert far from its siblings)
from mergepipe.catalog.evaluations import evaluation, evaluations, record_evaluation  # noqa: F401
from mergepipe.catalog.plans import find_plan_id, has_plan
from mergepipe.catalog.snapshots import (  # noqa: F401
    set_snapshot_labels, snapshot_count, snapshot_labels, snapshot_rows,
)
from mergepipe.engine.delete import delete_snapshot  # noqa: F401
from mergepipe.engine.runs import (  # noqa: F401
    RunProgress, cancel_run, get_run, launch_analyze, launch_evaluate, launch_run, log_tail,
)
from mergepipe.engine.txn import check_output_path, recover, recovery_findings
from mergepipe.errors import CatalogError, ExecutionError, MergePipeError
from mergepipe.manifest.diff import diff_snapshots, diff_text  # noqa: F401
from mergepipe.manifest.lineage import lineage, lineage_dot  # noqa: F401  (lineage_dot: for the CLI)
from mergepipe.manifest.verify import load_manifest, verify
from mergepipe.storage.paths import check_output
from mergepipe.storage.serve import serve as serve_files  # noqa: F401  (`mergepipe serve DIR`)

if TYPE_CHECKING:
    from mergepipe.engine.engine import Engine
    from mergepipe.config.model import MergekitConfig
    from mergepipe.planner.plan import Plan
    from mergepipe.planner.context import Planner
    from mergepipe.planner.request import MergeRequest

__all__ = ["Catalog", "Planner", "Engine", "Plan", "MergeRequest", "Budget", "merge_request", "plan", "run", "merge", "plan_merge", "snapshots", "lineage", "verify",
           "recover", "doctor", "explain", "load_plan", "load_manifest", "save_plan", "merge_config", "plan_config",
           "export_mergekit", "load_config", "parse_config", "register", "register_many",
           "launch_run", "launch_analyze", "get_run", "cancel_run", "log_tail", "STRATEGIES"]

# Names this module re-exports from modules that import torch, resolved on first use (PEP 562).
_LAZY = {
    "Engine": "mergepipe.engine.engine", "DEFAULT_SHARD_BYTES": "mergepipe.engine.engine",
    "Plan": "mergepipe.planner.plan", "load_plan": "mergepipe.planner.plan", "save_plan": "mergepipe.planner.plan",
    "Planner": "mergepipe.planner.context", "STRATEGIES": "mergepipe.planner.strategies",
    "MergekitConfig": "mergepipe.config.model", "export_mergekit": "mergepipe.config.export",
    "export_plan_data": "mergepipe.config.export",
    "load_config": "mergepipe.config.parse", "parse_config": "mergepipe.config.parse",
    "plan_from_config": "mergepipe.config.resolve",
    "DEFAULT_DENSITIES": "mergepipe.analyze.stats", "DEFAULT_SKETCH_SIZE": "mergepipe.catalog.sketch",
    "MergeRequest": "mergepipe.planner.request", "Budget": "mergepipe.planner.budget",
    "human_bytes": "mergepipe.planner.budget", "OPERATORS": "mergepipe.ops.core",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


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


def _execute(catalog: Catalog, plan: Plan, out, model_id, out_shard_bytes: int | None, progress, run_id=None,
             executor: str = "local", address: str | None = None):
    if executor == "local" and not isinstance(plan, str):  # the disk works while torch loads
        from mergepipe.engine.prefetch import start_warm_up
        start_warm_up(plan)
    from mergepipe.engine.engine import DEFAULT_SHARD_BYTES
    if out_shard_bytes is None:
        out_shard_bytes = DEFAULT_SHARD_BYTES
    engine = make_engine(catalog, executor, address)
    return engine.execute(plan, out=out, model_id=model_id, out_shard_bytes=out_shard_bytes,
                          progress=progress, **({"run_id": run_id} if run_id is not None else {}))


def execute(catalog: Catalog, plan: Plan | str, out, model_id: str | None = None, out_shard_bytes: int | None = None,
            progress=None, run_id: int | None = None, executor: str = "local", address: str | None = None):
    """Execute a plan (or a stored plan's id) on ``executor`` (``local`` or ``ray``, see make_engine);
    returns (snapshot_id, manifest)."""
    return _execute(catalog, plan, out, model_id, out_shard_bytes, progress, run_id, executor, address)


def analyze(catalog: Catalog, model_ids=None, progress=None, **kw):
    """ANALYZE experts (default: every registered model with a base); see analyze.runner.analyze."""
    from mergepipe.analyze.runner import analyze as run_analyze
    return run_analyze(catalog, model_ids, progress=progress, **kw)


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


def operators() -> list:
    """The operators' declarations (OpSpec: name, aliases, reference, parameters), in listing order."""
    from mergepipe.ops.core import OPERATORS
    return list(OPERATORS.values())


def parameters() -> tuple:
    """Every operator parameter declared (ops/spec.py Param: name, default, range, help, per tensor)."""
    from mergepipe.ops.core import all_parameters
    return all_parameters()


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
    snapshot_id, manifest = _execute(catalog, p, out, model_id or request.model_id, out_shard_bytes, progress)
    return p, snapshot_id, manifest


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
    snapshot_id, manifest = _execute(catalog, p, request.out, request.model_id, out_shard_bytes, progress)
    return p, snapshot_id, manifest


# --- recipes (config/recipe.py) ---------------------------------------------------------------------
def recipe_save(catalog: Catalog, name: str, base: str, experts, operator: str = "linear", weights=None,
                params=None, budget=None, out: str | None = None) -> int:
    """Store a recipe (a new version when it differs from the latest); returns its version."""
    from mergepipe.config.recipe import Recipe, save_recipe
    return save_recipe(catalog, Recipe.build(name, base, experts, operator, weights, params, budget, out))


def recipe_show(catalog: Catalog, name: str, version: int | None = None) -> dict:
    from mergepipe.config.recipe import load_recipe
    recipe, v = load_recipe(catalog, name, version)
    return {**recipe.body(), "weights": recipe.weights, "version": v}


def recipe_list(catalog: Catalog) -> list[dict]:
    from mergepipe.catalog.recipes import recipe_rows
    return recipe_rows(catalog)


def recipe_explain(catalog: Catalog, name: str) -> str:
    """Both ways to run the recipe now (from scratch, incremental) with their estimated reads."""
    from mergepipe.config.recipe import explain_options, recipe_options
    return explain_options(recipe_options(catalog, name))


def recipe_run(catalog: Catalog, name: str, out_shard_bytes: int | None = None, progress=None) -> dict:
    """Re-plan the recipe against the catalog, run the cheaper of from-scratch and incremental (nothing
    when its last snapshot is up to date); returns ``{"choice", "snapshot_id", "explain", ...}``."""
    from mergepipe.catalog.recipes import record_recipe_snapshot
    from mergepipe.config.recipe import explain_options, recipe_options
    options = recipe_options(catalog, name)
    result = {"recipe": name, "version": options["version"], "choice": options["choice"], "snapshot_id": None,
              "explain": explain_options(options)}
    if options["choice"] == "none":
        return result
    chosen = options[options["choice"]]
    Path(options["out"]).expanduser().parent.mkdir(parents=True, exist_ok=True)  # a pattern may name subfolders
    check_target(catalog, options["out"])
    snapshot_id, manifest = _execute(catalog, chosen["plan"], options["out"], None, out_shard_bytes, progress)
    record_recipe_snapshot(catalog, name, options["version"], snapshot_id, options["choice"])
    result.update(snapshot_id=snapshot_id, model_id=manifest.run["model_id"], out=manifest.run["out"],
                  read=sum(v for k, v in manifest.core["realized"].items() if k.endswith("_read")))
    return result


def watch(catalog: Catalog, dirs, recipe: str, interval: float = 5.0, once: bool = False, log=print) -> dict:
    """Watch ``dirs`` for new or changed checkpoints: register and analyze them on the recipe's base and run
    the recipe (incremental or from scratch, whichever is cheaper); until SIGTERM/SIGINT (a merge under way
    is finished first), or one pass with ``once``. One watcher per catalog (a lock file beside it); its
    state is in the catalog, and a watcher killed mid-merge is recovered on the next start."""
    import signal
    import time
    from mergepipe.config.recipe import load_recipe
    from mergepipe.config.watch import WatchLock, checkpoint_dirs, scan
    base = load_recipe(catalog, recipe)[0].base
    checkpoint_dirs(dirs)  # refuse a missing folder now
    lock = WatchLock(catalog.path)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    runs = []
    try:
        leftovers = recover(catalog)
        if leftovers.get("rolled_back"):
            log(f"recovered {len(leftovers['rolled_back'])} unfinished merge(s) of an earlier run")
        first = True
        while stop["signal"] is None:
            taken = scan(catalog, dirs, base, log)
            if first or taken:
                first = False
                try:
                    result = recipe_run(catalog, recipe)
                except MergePipeError as exc:  # e.g. no expert matches yet: wait for the next change
                    log(f"recipe {recipe}: {exc}")
                    continue
                if result["snapshot_id"]:
                    log(f"published {result['snapshot_id']} ({result['choice']}) at {result['out']}")
                    runs.append(result)
            if once and not any(r["status"] == "pending" for r in _watch_state(catalog)):
                break
            deadline = time.monotonic() + interval
            while stop["signal"] is None and time.monotonic() < deadline:
                time.sleep(min(0.1, interval))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        lock.release()
    if stop["signal"] is not None:
        log(f"stopped on signal {stop['signal']}")
    return {"runs": runs, "stopped_by": stop["signal"]}


def _watch_state(catalog: Catalog) -> list[dict]:
    from mergepipe.catalog.recipes import watch_seen
    return list(watch_seen(catalog).values())


def plan_merge(catalog: Catalog, base: str, experts, operator: str = "linear", save: bool = True, **settings) -> Plan:
    """``plan(catalog, request(base, experts, operator, **settings))``."""
    return plan(catalog, merge_request(base, experts, operator, **settings), save=save)


def merge(catalog: Catalog, base: str, experts, out, operator: str = "linear", model_id: str | None = None,
          out_shard_bytes: int | None = None, progress=None, **settings):
    """Plan and execute; returns (plan, snapshot_id, manifest). ``run`` with a request built from the settings."""
    return run(catalog, merge_request(base, experts, operator, **settings), out, model_id, out_shard_bytes, progress)


def _config(config) -> MergekitConfig:
    from mergepipe.config.model import MergekitConfig
    from mergepipe.config.parse import load_config
    return config if isinstance(config, MergekitConfig) else load_config(config)


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


def plan_config(catalog: Catalog, config, save: bool = True, **overrides) -> Plan:
    """Plan a mergekit config (a path or a parsed :class:`MergekitConfig`); ``overrides`` as in
    ``MergekitConfig.with_overrides``. Paths in it are registered on the fly (and analyzed by the merge)."""
    from mergepipe.config.resolve import plan_from_config
    cfg = _config(config).with_overrides(**overrides)
    return plan_from_config(catalog, cfg, save=save)[0]


def merge_config(catalog: Catalog, config, out, model_id: str | None = None,
                 out_shard_bytes: int | None = None, progress=None, **overrides):
    """Plan and execute a mergekit config; returns (plan, snapshot_id, manifest).

    A config that cannot be merged (bad key, missing path, taken output) changes nothing in the catalog."""
    from mergepipe.config.resolve import plan_from_config
    cfg = _config(config).with_overrides(**overrides)
    out, model_id = check_target(catalog, out, model_id)
    plan, _ = plan_from_config(catalog, cfg, save=False, reserved_ids={model_id})
    snapshot_id, manifest = _execute(catalog, plan, out, model_id, out_shard_bytes, progress)
    return plan, snapshot_id, manifest


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


def snapshots(catalog: Catalog) -> list[dict]:
    return snapshot_rows(catalog)


def doctor(db_path) -> dict:
    """Check a catalog without changing anything: the file (``PRAGMA integrity_check``,
    ``foreign_key_check``, schema version), what `recover` would do (uncommitted transactions, runs whose
    process died, stale staging directories), and that every registered model's files still exist and
    are unchanged. Returns ``{"catalog", "findings": [line, ...], "checked": {...}, "healthy"}``; a
    missing catalog is a CatalogError. The model and transaction checks need a readable catalog: they
    are skipped (``checked`` says so) when the file itself has findings."""
    path = Path(db_path)
    if not path.is_file():
        raise CatalogError(f"{path}: no catalog here (run `mergepipe init-db --db {path}`)")
    findings = integrity_findings(path)
    checked = {"file": True, "transactions": False, "models": 0}
    if not findings:
        catalog = Catalog(path, create=False, check=False, read_only=True)
        try:
            findings += recovery_findings(catalog)
            checked["transactions"] = True
            for row in catalog.models():
                try:
                    check_unchanged(row)
                except (MergePipeError, OSError) as exc:
                    findings.append(f"model {row['id']}: {_model_finding(row, exc, path)}")
                checked["models"] += 1
            from mergepipe.catalog.compacts import compact_findings
            compact_notes, checked["compacts"] = compact_findings(catalog)
            findings += compact_notes
        finally:
            catalog.close()
    return {"catalog": str(path), "findings": findings, "checked": checked, "healthy": not findings}


def _model_finding(row: dict, exc: BaseException, db: Path) -> str:
    """Doctor's line for a model whose files changed or went missing. A published snapshot is never
    re-registered (that would accept corrupted output as the snapshot): the advice is to verify it against
    its manifest, then delete it and merge again, or restore its files."""
    text = str(exc)
    if not row.get("snapshot_id"):
        return text
    import re
    text = re.sub(r";?\s*re-register it with --replace", "", text).rstrip("; ")
    return (f"{text}; it is snapshot {row['snapshot_id']}: run `mergepipe verify --db {db} {row['id']}` to see "
            f"which files differ, then `mergepipe delete --db {db} {row['id']}` and merge again (or restore its "
            "files)")


def explain(catalog: Catalog, ref: str) -> str:
    """EXPLAIN a plan (by plan id) or a snapshot (by snapshot/model id or directory: its plan + realized)."""
    from mergepipe.planner.plan import load_plan
    plan_id = find_plan_id(catalog, ref)
    if plan_id is not None:
        return load_plan(catalog, plan_id).explain()
    try:
        manifest = load_manifest(catalog, ref)
    except MergePipeError:
        raise MergePipeError(f"unknown plan or snapshot {ref!r}") from None
    core = manifest.core
    text = load_plan(catalog, core["plan_id"]).explain() if has_plan(
        catalog, core["plan_id"]) else f"PLAN {core['plan_id']}"
    from mergepipe.planner.explain import realized_line
    return (f"SNAPSHOT {manifest.snapshot_id}  model {manifest.run['model_id']}  at {manifest.run['out']}\n"
            f"  manifest   {manifest.manifest_hash}\n"
            + realized_line(core["realized"], core["estimated"]) + "\n" + text)


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
        points = _plan_points(catalog, config)
    except BaseException:
        if created:
            config.out.rmdir()
        raise
    sweep_id = start_sweep(catalog, config.name, config.source, config.executor, config.points)
    rows = run(catalog, sweep_id, points, config.executor, config.address, config.concurrency, evaluate, on_point)
    return {"sweep_id": sweep_id, "name": config.name, "points": rows}


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


# --- the dashboard's door ------------------------------------------------------------------------------
# What mergepipe.dashboard reads and plans through (it imports api, units and errors only): thin calls over
# the catalog, planner, config, storage and process helpers, each delegating unchanged (plans, ids and
# digests are those of the library calls they wrap).
from mergepipe.catalog import analyses as _analyses, compacts as _compacts, runs as _runs  # noqa: E402
from mergepipe.catalog import snapshots as _snapshots, sweeps as _sweeps  # noqa: E402
from mergepipe.catalog.plans import plan_bounds, plan_rows  # noqa: E402,F401
from mergepipe.manifest.build import Manifest  # noqa: E402,F401
from mergepipe.storage.paths import ROOTS_ENV, allowed_roots as env_allowed_roots  # noqa: E402,F401
from mergepipe.storage.procs import pid_alive  # noqa: E402,F401

_LAZY.update({
    "PlanContext": "mergepipe.planner.context", "EXACT": "mergepipe.planner.tiers",
    "CODECS": "mergepipe.storage.codecs", "CARD_NAME": "mergepipe.manifest.card",
    "load_yaml": "mergepipe.config.parse", "MAX_CONFIG_BYTES": "mergepipe.config.model",
})


def operator_spec(name: str):
    """One operator's declaration (ops/spec.py OpSpec) by name or alias; a PlanError names the choices."""
    from mergepipe.ops.core import get_op
    return get_op(name)


def plan_session(catalog: Catalog, request: MergeRequest):
    """A PlanContext of ``request`` ready for fast re-planning: ``session.plan(Budget...)`` plans again at
    another budget without re-reading the catalog (for an additive operator the sketch-based norm estimate
    is computed now). The plans are those of :func:`plan` for the same request and budget."""
    from mergepipe.planner.context import PlanContext
    ctx = PlanContext(catalog, request)
    if ctx.op.additive:
        ctx.full_norm_estimate()
    return ctx


def codec(name: str):
    """A compact codec by name (storage/codecs.py: its levels, stored level, help)."""
    from mergepipe.storage.codecs import codec as _codec
    return _codec(name)


def compact_rows(catalog: Catalog) -> list[dict]:
    """The experts' stored compact deltas (one row per expert)."""
    return _compacts.compact_rows(catalog)


def read_config_file(path: Path) -> bytes:
    """The bytes of a mergekit YAML file (a regular file no larger than a merge config may be)."""
    from mergepipe.config.model import MAX_CONFIG_BYTES
    from mergepipe.storage.paths import read_regular
    p = Path(path)
    if not p.is_file():
        raise MergePipeError(f"{p} is not a file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise MergePipeError(f"{p}: {p.stat().st_size} bytes is too large for a merge config")
    return read_regular(p, MAX_CONFIG_BYTES)


def resolve_config(catalog: Catalog, config, register_paths: bool = False, check_path=None):
    """A parsed mergekit config resolved against the catalog (config/resolve.py prepare: base, experts,
    layout); with ``register_paths=False`` every model must be registered already."""
    from mergepipe.config.resolve import prepare
    return prepare(catalog, config, register_paths=register_paths, check_path=check_path)


def plan_as_yaml(catalog: Catalog, plan) -> str:
    """The mergekit YAML (with the ``mergepipe:`` key) of a plan or its data, saved or not."""
    from mergepipe.config.export import export_plan_data
    return export_plan_data(catalog, plan.data if hasattr(plan, "data") else plan)


def read_task_suite(path):
    """A task suite file read and checked (config/task_suite.py); a MergePipeError says what is wrong."""
    from mergepipe.config.task_suite import read_task_suite as _read
    return _read(path)


def run_alive(run: dict) -> bool:
    """Whether a run row's process (its ``pid``) is still alive."""
    return bool(run.get("pid")) and pid_alive(run["pid"])


def runs(catalog: Catalog, kind: str | None = None, limit: int = 50) -> list[dict]:
    """The newest runs first, optionally of one kind ('merge' or 'analyze')."""
    return _runs.list_runs(catalog, kind, limit)


def output_number(catalog: Catalog) -> int:
    """A number for the next default output name: runs + snapshots so far, plus one."""
    return len(_runs.list_runs(catalog, None, 1 << 62)) + snapshot_count(catalog) + 1


def block_count(tensor: dict, block_bytes: int) -> int:
    """How many blocks a catalog tensor row (name, dtype, shape, file, offset, nbytes) has on a grid."""
    from mergepipe.storage.grid import tensor_grid
    from mergepipe.storage.safetensors import TensorInfo
    t = tensor
    return len(tensor_grid(TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), t["file"], t["offset"], t["nbytes"]),
                           block_bytes))


def tensor_stats_rows(catalog: Catalog, experts: list[str]) -> list[dict]:
    return _analyses.tensor_stats_rows(catalog, experts)


def block_stats_rows(catalog: Catalog, experts: list[str], tensors: list[str] | None = None) -> list[dict]:
    return _analyses.block_stats_rows(catalog, experts, tensors)


def sketch_rows(catalog: Catalog, experts: list[str], tensors: list[str]) -> list[dict]:
    return _analyses.sketch_rows(catalog, experts, tensors)


def stats_version_row(catalog: Catalog) -> tuple:
    """What changes when any expert's statistics change (a cache key)."""
    return _analyses.stats_version_row(catalog)


def parents_of(catalog: Catalog, model_id: str) -> list[dict]:
    return _snapshots.parents_of(catalog, model_id)


def children_of(catalog: Catalog, model_id: str) -> list[str]:
    return _snapshots.children_of(catalog, model_id)


def snapshot_row(catalog: Catalog, ref: str) -> dict | None:
    return _snapshots.snapshot_row(catalog, ref)


def snapshot_dependents(catalog: Catalog, model_id: str) -> list[str]:
    return _snapshots.snapshot_dependents(catalog, model_id)


def snapshot_ids_in_order(catalog: Catalog) -> list[str]:
    return _snapshots.snapshot_ids_in_order(catalog)


def sweep_rows(catalog: Catalog) -> list[dict]:
    return _sweeps.sweeps(catalog)


def sweep_points(catalog: Catalog, sweep_id: str) -> list[dict]:
    return _sweeps.sweep_points(catalog, sweep_id)


# --- run bookkeeping (a command started with --run-id) ------------------------------------------------
from mergepipe.engine.runs import recorded_run  # noqa: E402,F401  (running, then cancelled/failed/succeeded)


def decode_sketch(blob: bytes | None):
    """A stored block sketch as a numpy array (numpy is imported here, on first use: importing the api,
    which `mergepipe --help` does, stays fast)."""
    from mergepipe.catalog.sketch import decode
    return decode(blob)


def as_plan(plan) -> Plan:
    """A Plan from a Plan or its data (planner/plan.py as_plan): the dashboard reads either through its accessors."""
    from mergepipe.planner.plan import as_plan as _as_plan
    return _as_plan(plan)
