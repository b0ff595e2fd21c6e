"""Finishing a merge's staging directory: the snapshot's files around its written shards (config, index,
tokenizer, vocabulary and layout files, each hashed) and the check of the bytes read against the plan,
before anything is published."""

from __future__ import annotations

from pathlib import Path

from mergepipe.engine.vocab import vocab_setting, write_vocab_files
from mergepipe.errors import ExecutionError
from mergepipe.manifest.build import file_sha256
from mergepipe.planner.plan import Plan, compact_ranges
from mergepipe.storage.writers import finish_files, write_dtype_config, write_layout_config


def finish_snapshot(plan: Plan, base_ck, staging: Path, shards, outputs: dict, realized_by_expert: dict,
                    counters: dict) -> dict:
    """Complete the snapshot's files around its written ``shards`` (``outputs``: name -> sha256 and
    bytes), check the realized expert reads against the plan, and return what the manifest needs
    (``counters``: realized_by_tensor, touched, base_read, timing, inflight, analysis_read)."""
    finish_files(base_ck, staging, shards, plan.tokenizer)
    if vocab_setting(plan):
        write_vocab_files(plan, staging)
    if plan.layout is not None:
        write_layout_config(staging, plan.layout)
    if plan.out_dtype:  # its float tensors converted: config.json says so, as mergekit's does
        write_dtype_config(staging, plan.out_dtype)
    for extra in sorted(p for p in staging.rglob("*") if p.is_file()):  # config, index, tokenizer files
        name = extra.relative_to(staging).as_posix()
        if name not in outputs:
            outputs[name] = {"sha256": file_sha256(extra), "bytes": extra.stat().st_size}
    check_realized(plan, realized_by_expert, counters.get("compact_read_by_expert"))
    touched = counters["touched"]
    return {**counters, "outputs": outputs, "realized_by_expert": realized_by_expert,
            "touched": {e: {t: compact_ranges(b) for t, b in sorted(ts.items())} for e, ts in touched.items()},
            "output_write": sum(o["bytes"] for o in outputs.values())}


def check_realized(plan: Plan, realized_by_expert: dict, compact_by_expert: dict | None = None) -> None:
    """Refuse to publish when the bytes read from an expert (exactly, or from the compact tier) differ from the
    plan, or exceed the budget."""
    compact_by_expert = compact_by_expert or {}
    planned_compact = plan.compact_read_by_expert
    for e in plan.experts:
        planned = plan.estimated_by_expert[e["id"]]
        if realized_by_expert[e["id"]] != planned:
            raise ExecutionError(f"realized expert read of {e['id']} ({realized_by_expert[e['id']]} B) "
                                 f"differs from the plan ({planned} B); nothing was published")
        got, want = compact_by_expert.get(e["id"], 0), planned_compact.get(e["id"], 0)
        if got != want:
            raise ExecutionError(f"realized compact read of {e['id']} ({got} B) differs from the plan ({want} B); "
                                 f"nothing was published")
    total = sum(realized_by_expert.values()) + sum(compact_by_expert.values())
    if total > plan.budget_bytes and plan.full_expert_bytes:
        raise ExecutionError("realized expert read exceeds the budget; nothing was published")
