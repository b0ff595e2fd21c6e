"""The Models page: models, their roles, details and registration; what is analyzed and what is stale."""

from __future__ import annotations

import hashlib
import json

import pandas as pd

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.dashboard.formatting import fmt_bytes, short_fp
from mergepipe.errors import MergePipeError


# --- models ----------------------------------------------------------------------------------------
def role_of(model: dict) -> str:
    if model.get("snapshot_id"):
        return "snapshot"
    return "expert" if model.get("base_id") else "base"


def models_df(cat: Catalog) -> pd.DataFrame:
    """Registered models: id, role, kind, base, fingerprint, size, analyzed state."""
    rows = []
    for m in cat.models():
        role = role_of(m)
        analyzed = cat.is_analyzed(m["id"]) if m["base_id"] else None
        rows.append({
            "id": m["id"], "role": role, "kind": m["kind"], "base": m["base_id"] or "",
            "architecture": m["architecture"] or "", "dtype": m["dtype"], "params": m["params"],
            "bytes": m["bytes"], "size": fmt_bytes(m["bytes"]), "tensors": m["n_tensors"],
            "fingerprint": short_fp(m["fingerprint"]),
            "analyzed": "-" if analyzed is None else ("yes" if analyzed else ("stale" if m["analyzed_at"] else "no")),
            "registered": m["registered_at"], "uri": m["uri"],
        })
    cols = ["id", "role", "kind", "base", "architecture", "dtype", "params", "bytes", "size", "tensors",
            "fingerprint", "analyzed", "registered", "uri"]
    return pd.DataFrame(rows, columns=cols)


def model_details(cat: Catalog, model_id: str) -> dict:
    """One model: its row (without config), config, analysis and lineage parents/children."""
    m = dict(cat.model(model_id))
    config = json.loads(m.pop("config") or "{}")
    a = cat.analysis(model_id)
    parents = api.parents_of(cat, model_id)
    children = api.children_of(cat, model_id)
    return {
        "model": m, "role": role_of(m), "config": config, "analysis": a,
        "analyzed": cat.is_analyzed(model_id) if m["base_id"] else None,
        "parents": parents, "children": children,
        "summary": pd.DataFrame([
            ("id", m["id"]), ("role", role_of(m)), ("kind", m["kind"]), ("base", m["base_id"] or "-"),
            ("uri", m["uri"]), ("architecture", m["architecture"] or "-"), ("dtype", m["dtype"]),
            ("params", f"{m['params']:,}"), ("size", fmt_bytes(m["bytes"])), ("tensors", str(m["n_tensors"])),
            ("fingerprint", m["fingerprint"]), ("registered", m["registered_at"]),
            ("snapshot", m["snapshot_id"] or "-"),
            ("analyzed", "-" if not m["base_id"] else
             (f"yes ({a['n_blocks']} blocks of {fmt_bytes(a['block_bytes'])}, {a['analyzed_at']})"
              if cat.is_analyzed(model_id) else ("stale" if a else "no"))),
        ], columns=["field", "value"]),
    }


REGISTER_KINDS = ("full", "delta", "lora")
KIND_HELP = {"full": "a whole checkpoint (a base, or an expert fine-tuned from the base)",
             "delta": "a checkpoint holding expert - base directly (needs its base)",
             "lora": "a PEFT LoRA adapter directory: adapter_config.json + adapter_model.safetensors (needs its base)"}


def registration_base(kind: str, base: str | None) -> str | None:
    """The base a registration form's choice amounts to; delta checkpoints and LoRA adapters need one."""
    if kind not in REGISTER_KINDS:
        raise MergePipeError(f"unknown kind {kind!r} (choose from {', '.join(REGISTER_KINDS)})")
    if kind == "delta" and not base:
        raise MergePipeError("a delta checkpoint needs a base: choose the model its deltas are taken against")
    if kind == "lora" and not base:
        raise MergePipeError("a LoRA adapter needs a base: choose the model it was trained on")
    return base or None


def bases(cat: Catalog) -> list[str]:
    """Models that are bases (registered without a base)."""
    return [m["id"] for m in cat.models() if not m["base_id"]]


def experts_of(cat: Catalog, base_id: str) -> list[str]:
    return cat.experts_of(base_id)


def analyzed_experts(cat: Catalog, base_id: str) -> list[str]:
    return [e for e in cat.experts_of(base_id) if cat.is_analyzed(e)]


def unanalyzed_experts(cat: Catalog) -> list[str]:
    """Experts (not published snapshots) whose statistics are missing or stale."""
    return [m["id"] for m in cat.models() if m["base_id"] and not m["snapshot_id"] and not cat.is_analyzed(m["id"])]


def stats_version(cat: Catalog) -> str:
    """Changes when models, analyses or grids change (not on run progress): a cache key for statistics."""
    row = api.stats_version_row(cat)
    return hashlib.sha256(repr(tuple(row)).encode()).hexdigest()[:16]


def expert_warnings(cat: Catalog) -> list[str]:
    """Warnings about registered experts from their stored statistics: an expert whose delta is far
    larger than its siblings' (fine-tuned from a different base?)."""
    return [w for b in bases(cat) for w in api.outlier_warnings(cat, b)]
