"""Running ANALYZE: which experts need it (stored statistics stale or missing), the (expert, tensor)
tasks on a thread pool in tensor-major order, and storing the results in one catalog transaction."""

from __future__ import annotations

import gc
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from mergepipe.analyze.stats import (
    DEFAULT_DENSITIES, ExpertAnalysis, analysis_workers, analyze_tensor,
)
from mergepipe.analyze.compact_store import CompactWriter
from mergepipe.analyze.warm import prefetch_start
from mergepipe.catalog import compacts
from mergepipe.catalog.analyses import replace_analyses
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.gram import replace_gram
from mergepipe.catalog.models import check_unchanged
from mergepipe.catalog.sketch import DEFAULT_SKETCH_SIZE
from mergepipe.errors import CatalogError
from mergepipe.storage.compact import DEFAULT_GROUP, Codec, check_group, codec as codec_named
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES
from mergepipe.storage.registry import open_checkpoint


Progress = Callable[[str, int, int], None]


@dataclass
class AnalyzeResult:
    model_id: str
    skipped: bool
    bytes_read: int = 0
    seconds: float = 0.0
    n_blocks: int = 0
    # the compact deltas stored: {"codec", "group", "bytes", "expert_bytes"} (None: none written)
    compact: dict | None = None


def store_analyses(catalog: Catalog, jobs: list[ExpertAnalysis], seconds: dict | None = None) -> None:
    """Replace the statistics of these experts (and their base's grid), and their compact deltas, in one
    transaction; then remove the compact files nothing references any more."""
    with catalog.transaction():
        grids = {job.base["id"]: catalog.grid_block_bytes(job.base["id"]) for job in jobs}
        replace_analyses(catalog, jobs, seconds)
        replace_gram(catalog, jobs)
        for job in jobs:
            if job.compact is not None:
                job.compact.commit(catalog, sum(r["nbytes"] for rows, _ in job.results.values() for r in rows))
                compacts.set_default_codec(catalog, job.compact.codec.value, job.compact.group)
            elif grids[job.base["id"]] != job.block_bytes:  # a new grid: the old compact no longer fits
                compacts.delete_rows(catalog, job.expert_id)
    compacts.prune_files(catalog)


def _prepare(catalog: Catalog, expert_id: str, block_bytes, sketch_size, densities, force,
             gram: bool = False, arcee: bool = False, sce_topk=(), compact: Codec | None = None,
             compact_group: int = DEFAULT_GROUP) -> ExpertAnalysis | None:
    """The analysis job for one expert, or None when its stored statistics are current."""
    expert = catalog.model(expert_id)
    if not expert["base_id"]:
        raise CatalogError(f"{expert_id} has no base; register it with --base to analyze it")
    base = catalog.model(expert["base_id"])
    grid_bytes = catalog.grid_block_bytes(base["id"])
    if block_bytes is None:
        block_bytes = grid_bytes or DEFAULT_BLOCK_BYTES
    densities = tuple(sorted(set(float(d) for d in densities)))
    # Headers only: a model whose files changed since registration must never be skipped as unchanged.
    check_unchanged(base)
    check_unchanged(expert)
    prev = catalog.analysis(expert_id)
    if (
        not force and prev and grid_bytes == block_bytes and catalog.is_analyzed(expert_id)
        and prev["sketch_size"] == sketch_size and set(json.loads(prev["densities"])) >= set(densities)
        and _compact_current(catalog, expert, block_bytes, compact, compact_group)
    ):
        return None
    writer = CompactWriter(catalog, expert, base["id"], block_bytes, compact, compact_group) if compact else None
    return ExpertAnalysis(expert, base, open_checkpoint(base["uri"]), block_bytes, sketch_size, densities,
                          grid_seen=grid_bytes, with_gram=gram, with_arcee=arcee,
                          sce_topk=sce_topk, compact=writer)


def _compact_current(catalog: Catalog, expert: dict, block_bytes: int, compact: Codec | None, group: int) -> bool:
    """No compact asked for, or the stored one is this codec and group size, for this fingerprint and grid."""
    if compact is None:
        return True
    row = compacts.current_compact(catalog, expert["id"], expert["fingerprint"], block_bytes)
    return row is not None and row["codec"] == compact.value and row["group_size"] == group


def check_compact(compact, group) -> tuple[Codec | None, int]:
    """ANALYZE's compact settings, checked before anything is read (None or a codec name; the group size)."""
    return (None if compact in (None, False, "", "none", "off") else codec_named(compact)), check_group(group)


def check_settings(block_bytes, sketch_size, densities) -> tuple:
    """ANALYZE's settings, checked before anything is read: ``block_bytes`` (None: the base's grid) and
    ``sketch_size`` positive integers, every density a number in (0, 1] (NaN refused)."""
    for name, value in (("--block-bytes", block_bytes), ("--sketch-size", sketch_size)):
        if value is None and name == "--block-bytes":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise CatalogError(f"{name} must be a positive integer, not {value!r}")
            value = int(value)
        if not (value >= 1):
            raise CatalogError(f"{name} must be positive: {value} is outside the range [1, inf) of {name[2:]}")
    for d in densities:
        try:
            v = float(d)
        except (TypeError, ValueError):
            raise CatalogError(f"--densities: {d!r} is not a number") from None
        if isinstance(d, bool) or not (0 < v <= 1):
            raise CatalogError(f"--densities: {d!r} is outside the range (0, 1] of densities")
    return (None if block_bytes is None else int(block_bytes)), int(sketch_size), tuple(float(d) for d in densities)


def check_sce_topk(values) -> tuple[float, ...]:
    """sce's select_topk values to select for: numbers in (0, 1) (1 selects everything: nothing to store)."""
    out = []
    for v in values or ():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < 1):
            raise CatalogError(f"--sce-topk: {v!r} is outside the range (0, 1) of select_topk")
        out.append(float(v))
    return tuple(sorted(set(out)))


def run_analyses(jobs: list[ExpertAnalysis], progress: Progress | None = None) -> None:
    """Analyze every tensor of every job on a thread pool, tensor-major across the jobs. Only LoRA experts
    need torch (their deltas are torch matmuls, kept single-threaded beside the pool): full and delta
    checkpoints are analyzed without importing it."""
    gc_was_on = gc.isenabled()
    gc.disable()  # the pass allocates many small objects and frees them: collections cost ~4 % (measured)
    try:
        if not any(job.source.kind == "lora" for job in jobs):
            _run_tasks(jobs, progress)
            return
        import torch

        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _run_tasks(jobs, progress)
        finally:
            torch.set_num_threads(saved)
    finally:
        if gc_was_on:
            gc.enable()


def _run_tasks(jobs: list[ExpertAnalysis], progress: Progress | None) -> None:
    """One task per (base, tensor) covering every expert of that base, in the order of the files."""
    by_base: dict[str, list[ExpertAnalysis]] = {}
    for job in jobs:
        by_base.setdefault(job.base["id"], []).append(job)
    tasks = [(group, binfo) for group in by_base.values() for binfo in group[0].tensor_order()]
    done = {job.expert_id: 0 for job in jobs}
    totals = {job.expert_id: sum(t.nbytes for t in job.base_ck.tensors.values()) for job in jobs}
    with ThreadPoolExecutor(max_workers=analysis_workers(), thread_name_prefix="mergepipe-analyze") as pool:
        for (group, binfo), _ in zip(tasks, pool.map(lambda t: analyze_tensor(*t), tasks)):
            for job in group:
                done[job.expert_id] += binfo.nbytes
                if progress:
                    progress(job.expert_id, done[job.expert_id], totals[job.expert_id])


def analyze(catalog: Catalog, model_ids=None, progress: Progress | None = None, block_bytes: int | None = None,
            sketch_size: int = DEFAULT_SKETCH_SIZE, densities=DEFAULT_DENSITIES,
            force: bool = False, gram: bool = False, arcee: bool = False, sce_topk=(), compact=None,
            compact_group: int = DEFAULT_GROUP) -> list[AnalyzeResult]:
    """Analyze the given experts (default: every registered model that has a base) in one pass;
    experts whose statistics are current are skipped. All statistics are stored in one transaction.
    ``gram``: also the pairwise Gram statistics of these experts, analyzed together (the interpolation
    methods need them; implies ``force``, since the pairs depend on the set). ``arcee``: also arcee_fusion's
    per-tensor importance thresholds (implies ``gram``). ``sce_topk``: also sce's variance top-k for these
    select_topk values < 1 (analyze/sce.py; implies ``gram``). ``compact``: a codec name (storage/compact.py)
    to store each block's compact delta with, in groups of ``compact_group`` entries (the same read)."""
    sce_topk = check_sce_topk(sce_topk)
    compact, compact_group = check_compact(compact, compact_group)
    gram = gram or arcee or bool(sce_topk)
    force = force or gram
    block_bytes, sketch_size, densities = check_settings(block_bytes, sketch_size, densities)
    if not model_ids:
        model_ids = [m["id"] for m in catalog.models() if m["base_id"]]
    for mid in model_ids:
        catalog.model(mid)  # fail before any work on an unknown id
    jobs = {}
    try:
        for mid in model_ids:
            jobs[mid] = _prepare(catalog, mid, block_bytes, sketch_size, densities, force, gram, arcee, sce_topk,
                                 compact, compact_group)
    except BaseException:
        for job in jobs.values():
            if job is not None:
                job.close()
        raise
    todo = [j for j in jobs.values() if j is not None]
    grids = {}
    t0 = time.perf_counter()
    try:
        for job in todo:  # one grid per base
            if grids.setdefault(job.base["id"], job.block_bytes) != job.block_bytes:
                raise CatalogError(f"experts of {job.base['id']} analyzed with different block sizes in one run")
        prefetch_start(todo)  # the disk reads while numba and the pool start (analyze/warm.py)
        run_analyses(todo, progress)
        wall = time.perf_counter() - t0
        if todo:
            store_analyses(catalog, todo, {j.expert_id: wall / len(todo) for j in todo})
    finally:
        for job in todo:
            job.close()
            if job.compact is not None:
                job.compact.discard()
    return [AnalyzeResult(mid, True) if job is None else
            AnalyzeResult(mid, False, job.bytes_read, wall / max(1, len(todo)), job.n_blocks, _compact_result(job))
            for mid, job in jobs.items()]


def _compact_result(job: ExpertAnalysis) -> dict | None:
    w = job.compact
    if w is None:
        return None
    return {"codec": w.codec.value, "group": w.group, "bytes": w.size, "expert_bytes": w.expert_bytes}


def analyze_expert(catalog: Catalog, expert_id: str, block_bytes: int | None = None,
                   sketch_size: int = DEFAULT_SKETCH_SIZE, densities=DEFAULT_DENSITIES, force: bool = False,
                   progress: Progress | None = None) -> AnalyzeResult:
    """Analyze one expert against its base; skipped when nothing it depends on changed."""
    return analyze(catalog, [expert_id], progress, block_bytes, sketch_size, densities, force)[0]
