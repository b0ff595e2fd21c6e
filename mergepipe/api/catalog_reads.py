"""The catalog reads the dashboard and the CLI go through: snapshots, runs, sweeps, compacts, statistics and
sketches, each delegating unchanged to mergepipe/catalog."""

from __future__ import annotations

from mergepipe.catalog import analyses as _analyses, compacts as _compacts, runs as _runs
from mergepipe.catalog import snapshots as _snapshots, sweeps as _sweeps
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.snapshots import snapshot_count, snapshot_rows
from mergepipe.storage.procs import pid_alive


def snapshots(catalog: Catalog) -> list[dict]:
    return snapshot_rows(catalog)


def compact_rows(catalog: Catalog) -> list[dict]:
    """The experts' stored compact deltas (one row per expert)."""
    return _compacts.compact_rows(catalog)


def run_alive(run: dict) -> bool:
    """Whether a run row's process (its ``pid``) is still alive."""
    return bool(run.get("pid")) and pid_alive(run["pid"])


def runs(catalog: Catalog, kind: str | None = None, limit: int = 50) -> list[dict]:
    """The newest runs first, optionally of one kind ('merge' or 'analyze')."""
    return _runs.list_runs(catalog, kind, limit)


def output_number(catalog: Catalog) -> int:
    """A number for the next default output name: runs + snapshots so far, plus one."""
    return len(_runs.list_runs(catalog, None, 1 << 62)) + snapshot_count(catalog) + 1


def tensor_stats_rows(catalog: Catalog, experts: list[str]) -> list[dict]:
    return _analyses.tensor_stats_rows(catalog, experts)


def block_stats_rows(catalog: Catalog, experts: list[str], tensors: list[str] | None = None) -> list[dict]:
    return _analyses.block_stats_rows(catalog, experts, tensors)


def sketch_rows(catalog: Catalog, experts: list[str], tensors: list[str]) -> list[dict]:
    return _analyses.sketch_rows(catalog, experts, tensors)


def stats_version_row(catalog: Catalog) -> tuple:
    """What changes when any expert's statistics change (a cache key)."""
    return _analyses.stats_version_row(catalog)


def decode_sketch(blob: bytes | None):
    """A stored block sketch as a numpy array (numpy is imported here, on first use: importing the api,
    which `mergepipe --help` does, stays fast)."""
    from mergepipe.catalog.sketch import decode
    return decode(blob)


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
