"""The Python API: what the CLI and the dashboard call. Thin over catalog, planner, engine, manifest.

Importing it imports no torch: the catalog-only calls (register, snapshots, lineage, verify, recover)
start fast; planning and merging import the planner and the engine when first called.

The calls live in one module per area, all re-exported here (``from mergepipe import api; api.plan(...)``):
``planning`` (operators, requests, plans, EXPLAIN), ``merging`` (execute, run, merge, extend, analyze),
``configs`` (mergekit YAML), ``recipes`` (and watch), ``sweeps``, ``health`` (doctor) and
``catalog_reads`` (what the dashboard reads).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mergepipe.catalog.db import Catalog, integrity_findings  # noqa: F401
from mergepipe.catalog.models import check_unchanged, has_tensor, named_by_path, register, register_many, schema_version  # noqa: F401
from mergepipe.catalog.analyses import outlier_warnings  # noqa: F401  (an expert far from its siblings)
from mergepipe.catalog.evaluations import evaluation, evaluations, record_evaluation  # noqa: F401
from mergepipe.catalog.plans import find_plan_id, has_plan, plan_bounds, plan_rows  # noqa: F401
from mergepipe.catalog.snapshots import (  # noqa: F401
    set_snapshot_labels, snapshot_count, snapshot_labels, snapshot_rows,
)
from mergepipe.engine.delete import delete_snapshot  # noqa: F401
from mergepipe.engine.runs import (  # noqa: F401
    RunProgress, cancel_run, get_run, launch_analyze, launch_evaluate, launch_run, log_tail,
)
from mergepipe.engine.runs import recorded_run  # noqa: F401  (running, then cancelled/failed/succeeded)
from mergepipe.engine.txn import check_output_path, recover, recovery_findings  # noqa: F401
from mergepipe.errors import CatalogError, ExecutionError, MergePipeError  # noqa: F401
from mergepipe.manifest.build import Manifest  # noqa: F401
from mergepipe.manifest.diff import diff_snapshots, diff_text  # noqa: F401
from mergepipe.manifest.lineage import lineage, lineage_dot  # noqa: F401  (lineage_dot: for the CLI)
from mergepipe.manifest.verify import load_manifest, verify  # noqa: F401
from mergepipe.storage.paths import ROOTS_ENV, allowed_roots as env_allowed_roots, check_output  # noqa: F401
from mergepipe.storage.procs import pid_alive  # noqa: F401

from mergepipe.api.planning import (  # noqa: F401
    merge_request, plan, plan_merge, plan_session, operators, parameters, operator_spec, compact_codecs,
    compact_modes, compact_growth_text, codec, block_count, as_plan, explain,
)
from mergepipe.api.merging import (  # noqa: F401
    EXECUTORS, make_engine, execute, run, merge, check_target, extend_request, plan_extend, extend, analyze,
    merge_summary, extend_summary,
)
from mergepipe.api.configs import (  # noqa: F401
    plan_config, merge_config, read_config_file, resolve_config, plan_as_yaml, read_task_suite,
)
from mergepipe.api.recipes import recipe_save, recipe_show, recipe_list, recipe_explain, recipe_run, watch  # noqa: F401
from mergepipe.api.sweeps import load_sweep, run_sweep  # noqa: F401
from mergepipe.api.searches import (  # noqa: F401
    launch_search, launch_search_publish, load_search, load_into_model, merge_in_memory, parse_search, search,
    search_parameter_importance, search_publish, search_resume, search_show, searches,
)
from mergepipe.api.health import doctor  # noqa: F401
from mergepipe.api.hub import (  # noqa: F401
    hub_location, hub_origin, names_a_model, preflight, preflight_dict, preflight_gate, preflight_summary,
    preflight_table,
    publish_to_hub, hub_card_text, reproduce,
)
from mergepipe.api.catalog_reads import (  # noqa: F401
    snapshots, runs, run_alive, output_number, compact_rows, tensor_stats_rows, block_stats_rows, sketch_rows,
    stats_version_row, decode_sketch, parents_of, children_of, snapshot_row, snapshot_dependents,
    snapshot_ids_in_order, sweep_rows, sweep_points,
)

if TYPE_CHECKING:
    from mergepipe.engine.engine import Engine  # noqa: F401
    from mergepipe.config.model import MergekitConfig  # noqa: F401
    from mergepipe.planner.plan import Plan  # noqa: F401
    from mergepipe.planner.context import Planner  # noqa: F401
    from mergepipe.planner.request import MergeRequest  # noqa: F401

__all__ = [
    # the library's classes and tables
    "Catalog", "Planner", "Engine", "Plan", "MergeRequest", "Budget", "STRATEGIES",
    # planning
    "merge_request", "plan", "plan_merge", "plan_session", "explain", "load_plan", "save_plan", "as_plan",
    "operators", "parameters", "operator_spec", "compact_codecs", "compact_modes", "compact_growth_text", "codec",
    "block_count",
    # merging
    "run", "merge", "execute", "make_engine", "EXECUTORS", "check_target", "analyze", "extend_request", "plan_extend",
    "extend", "merge_summary", "extend_summary",
    # mergekit YAML configs
    "merge_config", "plan_config", "export_mergekit", "load_config", "parse_config", "read_config_file",
    "resolve_config", "plan_as_yaml", "read_task_suite",
    # recipes and sweeps
    "recipe_save", "recipe_show", "recipe_list", "recipe_explain", "recipe_run", "watch", "load_sweep", "run_sweep",
    # models, snapshots, lineage, health
    "register", "register_many", "snapshots", "lineage", "verify", "load_manifest", "recover", "doctor",
    # runs
    "launch_run", "launch_analyze", "get_run", "cancel_run", "log_tail", "runs", "run_alive", "output_number",
    # what the dashboard reads
    "compact_rows", "tensor_stats_rows", "block_stats_rows", "sketch_rows", "stats_version_row", "decode_sketch",
    "parents_of", "children_of", "snapshot_row", "snapshot_dependents", "snapshot_ids_in_order", "sweep_rows",
    "sweep_points",
]

# Names this module re-exports from modules that import torch (or that the dashboard reads rarely), resolved on
# first use (PEP 562).
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
    "PlanContext": "mergepipe.planner.context", "EXACT": "mergepipe.planner.tiers",
    "CODECS": "mergepipe.storage.codecs", "CARD_NAME": "mergepipe.manifest.card",
    "load_yaml": "mergepipe.config.parse", "MAX_CONFIG_BYTES": "mergepipe.config.model",
}


def serve_files(root, **kw):
    """``mergepipe serve DIR``: mergepipe.storage.serve.serve (its HTTP modules imported only here)."""
    from mergepipe.storage.serve import serve
    return serve(root, **kw)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
