"""Analysis on the way: a first merge analyzes the experts it has no statistics for while it reads them.

The plan marks such experts (never analyzed, changed since, or lacking a threshold this merge needs)
and reads every expert in full. Here the same ANALYZE as ``mergepipe analyze`` runs on a thread pool a
bounded distance ahead of the merge, tensor by tensor; the merge of a tensor waits for its statistics,
takes the magnitude thresholds from them, and merges only the blocks a full-budget plan over analyzed
experts would have selected (non-zero delta, largest entry above the threshold), so the output equals
that merge bit for bit. The analysis reads the experts from disk; the merge's own reads of the same
blocks then come from the page cache.

The statistics are committed in the catalog transaction that registers the snapshot: a merge that fails
or is cancelled stores none of them (the catalog is exactly as before), and a published snapshot always
comes with the statistics of its experts.

An expert whose delta holds NaN/Inf (its own values or the base's) is refused here as the planner
refuses an analyzed one: the merge fails with the same message when the analysis of the first such
tensor arrives, before that tensor is merged, so nothing is published and no statistics are stored.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mergepipe.analyze.compact_store import CompactWriter
from mergepipe.analyze.runner import store_analyses
from mergepipe.storage.codecs import codec
from mergepipe.analyze.stats import DEFAULT_DENSITIES, ExpertAnalysis, analysis_workers, analyze_tensor
from mergepipe.catalog.analyses import nonfinite_message
from mergepipe.catalog.db import Catalog
from mergepipe.errors import ExecutionError
from mergepipe.ops.core import get_op, tensor_statistics, threshold_fractions, useful_blocks
from mergepipe.planner.plan import as_plan
from mergepipe.planner.settings import expert_params, tensor_density
from mergepipe.storage.safetensors import FLOAT_DTYPES, Checkpoint, TensorInfo

LOOKAHEAD_BYTES = 256 << 20  # base-tensor bytes the analysis may run ahead of the merge


class InflightAnalysis:
    """ANALYZE of a plan's marked experts, tensor by tensor (one task for all of them, so each base
    block is read once), just ahead of the merge."""

    def __init__(self, plan, base_ck: Checkpoint, order: list[TensorInfo], lookahead: int = LOOKAHEAD_BYTES,
                 catalog: Catalog | None = None):
        self.plan = plan = as_plan(plan)
        self.op = get_op(plan.operator)
        self.params = plan.params
        # a re-ordered vocabulary's embedding tensors: analyzed (for the catalog) but their thresholds for the merge
        # come from the composed rows (engine/vocab.py), not from the expert's own rows seen here
        self.composed = plan.composed_tensors
        self.base_id = plan.base_id
        self.experts = plan.analyzed_on_the_way
        self.order = order
        self.index = {t.name: i for i, t in enumerate(order)}
        self.starts = np.cumsum([0] + [t.nbytes for t in order])  # where each tensor starts in the pass
        self.lookahead = lookahead
        block_bytes = plan.block_bytes
        store = plan.compact_store  # the compacts a first merge's analysis writes too (planner/tiers.py)
        self.jobs = {e["id"]: ExpertAnalysis(e, plan.base, base_ck, block_bytes, densities=self._densities(e),
                                             compact=(CompactWriter(catalog, e, plan.base_id, block_bytes,
                                                                    codec(store["codec"]), store["group"])
                                                      if store and catalog is not None else None))
                     for e in self.experts}
        self.pool = ThreadPoolExecutor(max_workers=analysis_workers(), thread_name_prefix="mergepipe-inflight")
        self.futures: dict[str, list] = {}
        self.submitted = 0
        self.thresholds: dict[str, dict[str, list[float]]] = {e["id"]: {} for e in self.experts}
        self.useful: dict[str, dict[str, set[int]]] = {e["id"]: {} for e in self.experts}

    def _densities(self, expert: dict) -> tuple[float, ...]:
        """The stored densities plus every top-k fraction this merge needs from the expert."""
        needed = {f for t in self.order if t.dtype in FLOAT_DTYPES
                  for f in threshold_fractions(self.op, tensor_density(expert, t.name) or 1.0,
                                               expert_params(self.plan.params_for(t.name), expert,
                                                             t.name))
                  if f < 1.0}
        return tuple(sorted(set(DEFAULT_DENSITIES) | needed))

    def _submit_until(self, position: int) -> None:
        """Submit the analysis of every tensor that starts within ``lookahead`` bytes of ``position``."""
        limit = self.starts[position] + self.lookahead
        while self.submitted < len(self.order) and (self.submitted <= position or self.starts[self.submitted] <= limit):
            t = self.order[self.submitted]
            self.futures[t.name] = self.pool.submit(analyze_tensor, list(self.jobs.values()), t)
            self.submitted += 1

    def ready(self, info: TensorInfo) -> None:
        """Wait for this tensor's statistics; record its thresholds and useful blocks."""
        self._submit_until(self.index[info.name])
        self.futures.pop(info.name).result()
        for e in self.experts:
            self._use(e, info.name, *self.jobs[e["id"]].results[info.name])

    def _use(self, expert: dict, name: str, rows: list[dict], stats: dict) -> None:
        eid = expert["id"]
        bad = [(name, r["block"], r["nonfinite"], r["base_nonfinite"]) for r in rows if r.get("nonfinite")]
        if bad:
            raise ExecutionError(nonfinite_message(eid, self.base_id, bad))
        if name in self.composed:
            return
        thr = None
        if stats["delta_nnz"] and self.op.thresholded:
            thr = tensor_statistics(self.op, tensor_density(expert, name) or 1.0,
                                    expert_params(self.plan.params_for(name), expert, name),
                                    stats["thresholds"],
                                    stats.get("topk"), stats["delta_l1"], stats["delta_max_abs"],
                                    stats["numel"])
            if thr is None:  # the analysis stored every fraction the merge needs: not expected
                raise ExecutionError(f"the analysis of {eid} on the way gives no exact top-k statistics for "
                                     f"{name}; nothing was published")
            self.thresholds[eid][name] = thr
        nonzero = [r for r in rows if r["delta_nnz"] > 0]
        keep = useful_blocks(self.op, thr, np.array([r["delta_max_abs"] for r in nonzero], dtype=np.float64))
        self.useful[eid][name] = {r["block"] for r, k in zip(nonzero, keep) if k}

    def keeps(self, expert_id: str, name: str, block: int) -> bool:
        """Whether a block of an expert analyzed on the way takes part in the merge."""
        return block in self.useful[expert_id].get(name, ())

    def bytes_read(self) -> dict[str, int]:
        return {eid: job.bytes_read for eid, job in self.jobs.items()}

    def store(self, catalog: Catalog) -> None:
        """Write the statistics (call inside the transaction that registers the snapshot)."""
        store_analyses(catalog, list(self.jobs.values()))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for job in self.jobs.values():
            job.close()

    def discard(self) -> None:
        """Remove the compact files of an analysis that was not stored (a failed or cancelled merge)."""
        for job in self.jobs.values():
            if job.compact is not None:
                job.compact.discard()
