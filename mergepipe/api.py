"""The Python API: what the CLI and the dashboard call. Thin over catalog, planner, engine, manifest.

Importing it imports no torch: the catalog-only calls (register, snapshots, lineage, verify, recover)
start fast; planning and merging import the planner and the engine when first called.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.catalog.db import Catalog
from mergepipe.errors import ExecutionError, MergePipeError
from mergepipe.manifest.build import load_manifest, verify
from mergepipe.catalog.models import register, register_many
from mergepipe.engine.txn import check_output_path, recover

if TYPE_CHECKING:
    from mergepipe.engine.engine import Engine
    from mergepipe.config.mergekit import MergekitConfig
    from mergepipe.planner.plan import Plan, Planner

__all__ = ["Catalog", "Planner", "Engine", "Plan", "merge", "plan_merge", "snapshots", "lineage", "verify",
           "recover", "explain", "load_plan", "load_manifest", "save_plan", "merge_config", "plan_config",
           "export_mergekit", "load_config", "parse_config", "register", "register_many"]

# Names this module re-exports from modules that import torch, resolved on first use (PEP 562).
_LAZY = {
    "Engine": "engine", "DEFAULT_SHARD_BYTES": "engine",
    "Plan": "planner", "Planner": "planner", "load_plan": "planner", "save_plan": "planner",
    "MergekitConfig": "mergekit_config", "export_mergekit": "mergekit_config", "load_config": "mergekit_config",
    "parse_config": "mergekit_config", "plan_from_config": "mergekit_config",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
    globals()[name] = value
    return value


def _execute(catalog: Catalog, plan: Plan, out, model_id, out_shard_bytes: int | None, progress):
    from mergepipe.engine.engine import DEFAULT_SHARD_BYTES, Engine
    if out_shard_bytes is None:
        out_shard_bytes = DEFAULT_SHARD_BYTES
    return Engine(catalog).execute(plan, out=out, model_id=model_id, out_shard_bytes=out_shard_bytes,
                                   progress=progress)


def plan_merge(catalog: Catalog, base: str, experts, operator: str = "linear", budget=None, budget_mb=None,
               target_bound=None, save: bool = True, **kw) -> Plan:
    from mergepipe.planner.plan import Planner
    return Planner(catalog).plan(base, experts, operator, budget=budget, budget_mb=budget_mb,
                                 target_bound=target_bound, save=save, **kw)


def merge(catalog: Catalog, base: str, experts, out, operator: str = "linear", model_id: str | None = None,
          out_shard_bytes: int | None = None, progress=None, **plan_kw):
    """Plan and execute; returns (plan, snapshot_id, manifest)."""
    # The engine stores the plan after its own checks (output path, model id): a refused merge
    # changes nothing in the catalog.
    plan = plan_merge(catalog, base, experts, operator, save=False, **plan_kw)
    snapshot_id, manifest = _execute(catalog, plan, out, model_id, out_shard_bytes, progress)
    return plan, snapshot_id, manifest


def _config(config) -> MergekitConfig:
    from mergepipe.config.mergekit import MergekitConfig, load_config
    return config if isinstance(config, MergekitConfig) else load_config(config)


def check_target(catalog: Catalog, out, model_id: str | None = None) -> tuple[Path, str]:
    """The output directory and merged model id a merge would use, refused now if either is taken
    (the engine checks again; checking first spares registering and analyzing for nothing)."""
    out = Path(out).absolute()
    model_id = model_id or out.name
    if catalog.has_model(model_id):
        raise ExecutionError(f"model id {model_id!r} is already registered; choose another --model-id")
    check_output_path(out)
    return out, model_id


def plan_config(catalog: Catalog, config, save: bool = True, **overrides) -> Plan:
    """Plan a mergekit config (a path or a parsed :class:`MergekitConfig`); ``overrides`` as in
    ``MergekitConfig.with_overrides``. Paths in it are registered on the fly (and analyzed by the merge)."""
    from mergepipe.config.mergekit import plan_from_config
    cfg = _config(config).with_overrides(**overrides)
    return plan_from_config(catalog, cfg, save=save)[0]


def merge_config(catalog: Catalog, config, out, model_id: str | None = None,
                 out_shard_bytes: int | None = None, progress=None, **overrides):
    """Plan and execute a mergekit config; returns (plan, snapshot_id, manifest).

    A config that cannot be merged (bad key, missing path, taken output) changes nothing in the catalog."""
    from mergepipe.config.mergekit import plan_from_config
    cfg = _config(config).with_overrides(**overrides)
    out, model_id = check_target(catalog, out, model_id)
    plan, _ = plan_from_config(catalog, cfg, save=False, reserved_ids={model_id})
    snapshot_id, manifest = _execute(catalog, plan, out, model_id, out_shard_bytes, progress)
    return plan, snapshot_id, manifest


def merge_summary(plan: Plan, manifest) -> dict:
    core = manifest.core
    return {
        "snapshot_id": manifest.snapshot_id, "model_id": manifest.run["model_id"], "out": manifest.run["out"],
        "plan_id": plan.id, "manifest_hash": manifest.manifest_hash, "operator": plan["operator"],
        "budget_bytes": plan["budget"]["bytes"], "full_expert_bytes": plan["full_expert_bytes"],
        "estimated": core["estimated"], "realized": core["realized"], "error_bound": plan["error_bound"],
        "seconds": manifest.run["seconds"], "timing": manifest.run["timing"],
    }


def snapshots(catalog: Catalog) -> list[dict]:
    return catalog.query(
        """SELECT s.*, p.operator, p.budget_bytes, p.expert_read_bytes, p.full_expert_bytes
           FROM snapshots s LEFT JOIN plans p ON p.id = s.plan_id ORDER BY s.created_at, s.id""")


def lineage(catalog: Catalog, model_id: str | None = None) -> dict:
    """Nodes and edges of the lineage DAG (all of it, or the ancestors and descendants of one model)."""
    edges = catalog.query("SELECT child_id, parent_id, role, weight FROM lineage ORDER BY child_id, role, parent_id")
    if model_id is not None:
        catalog.model(model_id)
        keep = {model_id}
        for direction in ("up", "down"):
            frontier = {model_id}
            while frontier:
                if direction == "up":
                    nxt = {e["parent_id"] for e in edges if e["child_id"] in frontier}
                else:
                    nxt = {e["child_id"] for e in edges if e["parent_id"] in frontier}
                frontier = nxt - keep
                keep |= nxt
        edges = [e for e in edges if e["child_id"] in keep and e["parent_id"] in keep]
        node_ids = keep
    else:
        node_ids = {m["id"] for m in catalog.models()}
    nodes = [{"id": m["id"], "kind": "snapshot" if m["snapshot_id"] else ("expert" if m["base_id"] else "base"),
              "snapshot_id": m["snapshot_id"], "base_id": m["base_id"]}
             for m in catalog.models() if m["id"] in node_ids]
    return {"nodes": nodes, "edges": edges}


def lineage_dot(graph: dict) -> str:
    """Graphviz DOT source of a lineage graph (rendered by st.graphviz_chart, no binary needed)."""
    shapes = {"base": "box", "expert": "ellipse", "snapshot": "doubleoctagon"}
    lines = ["digraph lineage {", "  rankdir=LR;", '  node [fontname="Helvetica", fontsize=10];']
    for n in graph["nodes"]:
        label = n["id"] + (f"\\n{n['snapshot_id']}" if n["snapshot_id"] else "")
        lines.append(f'  "{_dot(n["id"])}" [label="{_dot(label)}", shape={shapes[n["kind"]]}];')
    for e in graph["edges"]:
        lbl = e["role"] + (f" w={e['weight']:g}" if e["weight"] is not None else "")
        lines.append(f'  "{_dot(e["parent_id"])}" -> "{_dot(e["child_id"])}" [label="{_dot(lbl)}"];')
    lines.append("}")
    return "\n".join(lines)


def _dot(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"') if "\\n" not in s else s.replace('"', '\\"')


def explain(catalog: Catalog, ref: str) -> str:
    """EXPLAIN a plan (by plan id) or a snapshot (by snapshot/model id or directory: its plan + realized)."""
    from mergepipe.planner.plan import load_plan
    rows = catalog.query("SELECT id FROM plans WHERE id = ? OR id = ?", [ref, "plan-" + ref])
    if rows:
        return load_plan(catalog, rows[0]["id"]).explain()
    try:
        manifest = load_manifest(catalog, ref)
    except MergePipeError:
        raise MergePipeError(f"unknown plan or snapshot {ref!r}") from None
    core = manifest.core
    text = load_plan(catalog, core["plan_id"]).explain() if catalog.query(
        "SELECT 1 FROM plans WHERE id=?", [core["plan_id"]]) else f"PLAN {core['plan_id']}"
    r, e = core["realized"], core["estimated"]
    return (f"SNAPSHOT {manifest.snapshot_id}  model {manifest.run['model_id']}  at {manifest.run['out']}\n"
            f"  manifest   {manifest.manifest_hash}\n"
            f"  realized   base read {r['base_read']} B (est. {e['base_read']}), expert read {r['expert_read']} B "
            f"(est. {e['expert_read']}), write {r['output_write']} B (est. {e['output_write']})\n" + text)
