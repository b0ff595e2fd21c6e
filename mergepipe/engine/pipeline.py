"""The merge pipeline: one execution of a plan into a staging directory, block by block.

For each tensor of the base (in file order) and each group of adjacent grid blocks: read the base range
and only the expert blocks the plan selected (exact positioned reads, adjacent ranges coalesced, a small
read-ahead queue on a background thread) -- :meth:`MergePipeline.schedule_reads` and
:meth:`MergePipeline.fetch`; merge each block on the :class:`~mergepipe.engine.executor.Executor`, or
copy it from the base without decoding when no expert touches it -- :meth:`MergePipeline.merge_group`;
write the blocks in output order at their final offsets -- :meth:`MergePipeline.write_in_order`.
Memory is bounded by a byte budget on the input in flight (groups read ahead plus blocks waiting to be
merged and written), so it does not grow with K.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mergepipe.engine.blocks import merge_block, warm_kernels
from mergepipe.engine.inflight import InflightAnalysis
from mergepipe.errors import ExecutionError
from mergepipe.manifest.build import file_sha256
from mergepipe.ops.core import get_op
from mergepipe.planner.plan import Plan, compact_ranges, expand_ranges
from mergepipe.planner.settings import params_on, tensor_weight
from mergepipe.storage.grid import BlockSpan, tensor_grid
from mergepipe.storage.registry import open_checkpoint
from mergepipe.storage.safetensors import FLOAT_DTYPES, TensorInfo
from mergepipe.storage.sources import open_source
from mergepipe.storage.writers import ShardWriter, finish_files, plan_shards


def block_groups(tensors: list[TensorInfo], block_bytes: int, group_bytes: int, span_cost=None,
                 max_cost: int | None = None):
    """(tensor, [adjacent grid blocks]) work items of about ``group_bytes`` of the tensor, in file order;
    with ``span_cost(info, span)`` and ``max_cost``, a group also ends once its summed cost (the bytes a
    group reads: base plus selected experts) reaches ``max_cost``."""
    work = []
    for info in tensors:
        group: list[BlockSpan] = []
        size = cost = 0
        for span in tensor_grid(info, block_bytes):
            group.append(span)
            size += span.nbytes
            if span_cost is not None:
                cost += span_cost(info, span)
            if size >= group_bytes or (max_cost is not None and cost >= max_cost):
                work.append((info, group))
                group, size, cost = [], 0, 0
        if group:
            work.append((info, group))
    return work



class MergePipeline:
    """Executes ``plan`` for ``engine`` (its read-ahead, group and in-flight byte settings, its executor)
    into ``staging``; :meth:`run` returns what the manifest needs."""

    def __init__(self, engine, plan: Plan, staging: Path, out_shard_bytes: int, progress):
        self.engine, self.plan, self.staging, self.progress = engine, plan, staging, progress
        self.op = op = get_op(plan["operator"])
        self.params = params = plan["params"]
        self.experts = experts = plan["experts"]
        self.base_ck = base_ck = open_checkpoint(plan["base"]["uri"])
        self.sources = [open_source(e["kind"], e["uri"]) for e in experts]
        self.order = order = sorted(base_ck.tensors.values(), key=lambda t: (t.file, t.offset))
        self.shards = plan_shards(order, out_shard_bytes)
        self.shard_of = {n: s for s in self.shards for n in s.offsets}
        self.selected = {e["id"]: {t: set(expand_ranges(rs)) for t, rs in plan["access"][e["id"]].items()}
                         for e in experts}
        self.inflight = inflight = (InflightAnalysis(plan, base_ck, order) if any(e.get("analyze") for e in experts)
                                    else None)
        self.thresholds = {**plan["thresholds"], **(inflight.thresholds if inflight else {})}
        # a model soup (linear averaging the base in): every float block goes through mergekit's operation order
        self.base_member = member = plan.data.get("base_member") if op.whole_models else None  # (karcher: its own)
        self.weight_sums = {t.name: sum(tensor_weight(e, t.name) or 0.0 for e in experts)
                            + ((tensor_weight(member, t.name) or 0.0) if member else 0.0) for t in order}
        # interpolation methods: per-tensor scalars, and the budget-omitted blocks (which keep the base)
        self.coefficients = plan.data.get("coefficients") or {}
        self.omitted = {t: set(expand_ranges(rs)) for t, rs in (plan.data.get("omitted") or {}).items()}
        # linear without normalize scales the base by sum(w): then no block is a plain copy
        self.tensor_params = plan.data.get("tensor_params") or {}  # lambda/normalize/rescale per tensor
        self.work = block_groups(order, plan["grid"]["block_bytes"], engine.group_bytes, self.span_cost,
                                 engine.group_read_bytes)
        self.total_blocks = sum(len(g) for _, g in self.work)
        self.readers = [src.checkpoint.reader() for src in self.sources]
        self.fixed_cache: list[tuple[str, list] | None] = [None] * len(experts)  # LoRA A of the current tensor
        self.base_reader = base_ck.reader(sequential=True)
        self.writers = {s.fname: ShardWriter(staging, s) for s in self.shards}
        self.by_tensor: dict[str, int] = {}
        self.touched: dict[str, dict[str, list[int]]] = {e["id"]: {} for e in experts}
        self.timing = {"read_wait_s": 0.0, "compute_s": 0.0, "write_s": 0.0}
        self.done_blocks = 0
        self.reads: deque = deque()  # (item, cost, future)
        self.pending: deque = deque()  # (writer, offset, future-or-bytes, span count, bytes released) in output order
        self.queued = deque((item, sum(self.span_cost(item[0], s) for s in item[1])) for item in self.work)
        self.held_bytes = 0  # cost of the groups submitted for reading whose blocks are not all written yet

    # --- what a block needs ----------------------------------------------------------------------------
    def takes_part(self, ei: int, name: str, block: int) -> bool:
        eid = self.experts[ei]["id"]
        return not (self.inflight and eid in self.inflight.jobs) or self.inflight.keeps(eid, name, block)

    def passthrough_ok(self, name: str) -> bool:
        scales_base = self.op.whole_models and not self.params_for(name)["normalize"]
        return not self.base_member and not (scales_base and self.weight_sums[name] != 1.0)

    def params_for(self, name: str) -> dict:
        return params_on(self.params, self.tensor_params, name)

    def method_merges(self, name: str, block: int) -> bool:
        """An interpolation method merges every block of a float tensor that the plan did not omit (an
        unchanged block is not x = base for it: slerp's coefficients do not sum to 1)."""
        return self.op.nonlinear and block not in self.omitted.get(name, ())

    def soup_weights(self, name: str) -> tuple[list[float], int] | None:
        """A soup's weights on one tensor in config order (the base's at its position), and that position."""
        member = self.base_member
        if not member:
            return None
        weights = [tensor_weight(e, name) for e in self.experts]
        weights.insert(member["position"], tensor_weight(member, name))
        return weights, member["position"]

    def span_cost(self, info, span) -> int:
        """Bytes one block makes the engine hold: base + selected experts."""
        cost = span.nbytes
        for ei, e in enumerate(self.experts):
            if span.index in self.selected[e["id"]].get(info.name, ()):
                cost += sum(n for _, _, n in self.sources[ei].block_ranges(info.name, span))
        return cost

    # --- reads ----------------------------------------------------------------------------------------
    def fetch(self, item):
        """Read one group: the base range and each expert's selected blocks (on the read thread)."""
        info, group = item
        experts, sources, readers, fixed_cache = self.experts, self.sources, self.readers, self.fixed_cache
        start, end = group[0], group[-1]
        base_buf = self.base_reader.read(info.file, info.offset + start.rel_offset,
                                         end.rel_offset + end.nbytes - start.rel_offset)
        exp_bufs, nread = [], 0
        for ei, e in enumerate(experts):
            sel = self.selected[e["id"]].get(info.name, ())
            spans = [s for s in group if s.index in sel]
            if not spans:
                exp_bufs.append({})
                continue
            src = sources[ei]
            if fixed_cache[ei] is None or fixed_cache[ei][0] != info.name:
                ranges = src.fixed_ranges(info.name)
                fixed_cache[ei] = (info.name, readers[ei].read_ranges(ranges))
                nread += sum(n for _, _, n in ranges)
            fixed = fixed_cache[ei][1]
            per_span = [src.block_ranges(info.name, s) for s in spans]
            views = readers[ei].read_ranges([r for rs in per_span for r in rs])
            nread += sum(n for rs in per_span for _, _, n in rs)
            out, pos = {}, 0
            for s, rs in zip(spans, per_span):
                out[s.index] = (views[pos:pos + len(rs)], fixed)
                pos += len(rs)
            exp_bufs.append(out)
        return base_buf, exp_bufs, nread

    def schedule_reads(self) -> None:
        """Submit reads ahead while fewer than ``readahead`` are out and the in-flight budget allows."""
        engine = self.engine
        while self.queued and len(self.reads) < engine.readahead:
            item, cost = self.queued[0]
            if self.held_bytes and self.held_bytes + cost > engine.inflight_bytes:
                break
            self.queued.popleft()
            self.held_bytes += cost
            self.reads.append((item, cost, self.read_pool.submit(self.fetch, item)))

    # --- merges ---------------------------------------------------------------------------------------
    def merge_one(self, info, span, raw, contributors):
        """A block task (run by the executor): the merged bytes of one block."""
        t_c = time.perf_counter()
        data = merge_block(self.engine.fused, self.op, self.params_for(info.name), self.plan["seed"], self.experts, self.sources,
                           self.weight_sums[info.name], info, span, raw, contributors, self.thresholds,
                           self.coefficients.get(info.name), self.soup_weights(info.name))
        self.timing["compute_s"] += time.perf_counter() - t_c
        return data

    def merge_group(self, info, group, cost, base_buf, exp_bufs) -> None:
        """Queue each block of a group for writing: its base bytes as they are, or a merge task."""
        shard = self.shard_of[info.name]
        writer = self.writers[shard.fname]
        base_off = shard.offsets[info.name]
        g0 = group[0].rel_offset
        for k, span in enumerate(group):
            raw = memoryview(base_buf)[span.rel_offset - g0: span.rel_offset - g0 + span.nbytes]
            contributors = [(ei, bufs[span.index]) for ei, bufs in enumerate(exp_bufs)
                            if span.index in bufs and self.takes_part(ei, info.name, span.index)]
            if info.dtype not in FLOAT_DTYPES or (not contributors and self.passthrough_ok(info.name)
                                                  and not self.method_merges(info.name, span.index)):
                data = raw
            else:
                data = self.executor.submit(self.merge_one, info, span, raw, contributors)
            last = k == len(group) - 1
            self.pending.append((writer, base_off + span.rel_offset, data, len(group) if last else 0,
                                 cost if last else 0))
            for ei, _ in contributors:
                self.touched[self.experts[ei]["id"]].setdefault(info.name, []).append(span.index)

    # --- writes ---------------------------------------------------------------------------------------
    def write_in_order(self, limit: int) -> None:
        """Write pending blocks, oldest first, until at most ``limit`` are left."""
        pending, timing = self.pending, self.timing
        while len(pending) > limit:
            writer, offset, data, n, release = pending.popleft()
            if not isinstance(data, memoryview):
                data = data.result()
            t_w = time.perf_counter()
            writer.write(offset, data)
            timing["write_s"] += time.perf_counter() - t_w
            self.held_bytes -= release
            if n:
                self.done_blocks += n
                if self.progress:
                    self.progress(self.done_blocks, self.total_blocks, sum(r.bytes_read for r in self.readers))

    # --- the loop -------------------------------------------------------------------------------------
    def step(self, item, cost, fut) -> None:
        """Take the oldest read group: queue its blocks, write what is due, read on."""
        t_wait = time.perf_counter()
        base_buf, exp_bufs, nread = fut.result()
        self.timing["read_wait_s"] += time.perf_counter() - t_wait
        self.schedule_reads()
        info, group = item
        if self.inflight and group[0].index == 0:
            self.inflight.ready(info)
        self.merge_group(info, group, cost, base_buf, exp_bufs)
        if nread:
            self.by_tensor[info.name] = self.by_tensor.get(info.name, 0) + nread
        del base_buf, exp_bufs  # the pending blocks hold what they need
        self.write_in_order(4 * self.engine.workers)
        self.schedule_reads()
        while not self.reads and self.queued and self.pending:  # the byte budget is full: write out, then read on
            self.write_in_order(len(self.pending) - 1)
            self.schedule_reads()

    def run(self) -> dict:
        engine = self.engine
        self.read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mergepipe-read")
        self.executor = engine.make_executor()
        if engine.fused:  # import numba and load the cached kernels while the first groups are read
            self.executor.submit(warm_kernels)
        try:
            self.schedule_reads()
            while self.reads:
                self.step(*self.reads.popleft())
            self.write_in_order(0)
        finally:
            self.read_pool.shutdown(wait=True, cancel_futures=True)
            self.executor.shutdown()
            for r in self.readers:
                r.close()
            self.base_reader.close()
            if self.inflight:
                self.inflight.close()
        return self.finish()

    def finish(self) -> dict:
        """Close the shards, complete the snapshot's files, check the realized reads against the plan."""
        plan, experts, staging = self.plan, self.experts, self.staging
        outputs = {name: w.close() for name, w in self.writers.items()}
        finish_files(self.base_ck, staging, self.shards, plan.data.get("tokenizer"))
        for extra in sorted(p for p in staging.rglob("*") if p.is_file()):  # config, index, tokenizer files
            name = extra.relative_to(staging).as_posix()
            if name not in outputs:
                outputs[name] = {"sha256": file_sha256(extra), "bytes": extra.stat().st_size}
        realized_by_expert = {e["id"]: r.bytes_read for e, r in zip(experts, self.readers)}
        for e in experts:
            planned = plan["expert_read_by_expert"][e["id"]]
            if realized_by_expert[e["id"]] != planned:
                raise ExecutionError(f"realized expert read of {e['id']} ({realized_by_expert[e['id']]} B) "
                                     f"differs from the plan ({planned} B); nothing was published")
        if sum(realized_by_expert.values()) > plan["budget"]["bytes"] and plan["full_expert_bytes"]:
            raise ExecutionError("realized expert read exceeds the budget; nothing was published")
        inflight = self.inflight
        return {
            "outputs": outputs, "realized_by_expert": realized_by_expert, "realized_by_tensor": self.by_tensor,
            "touched": {e: {t: compact_ranges(b) for t, b in sorted(ts.items())} for e, ts in self.touched.items()},
            "base_read": self.base_reader.bytes_read, "timing": self.timing, "inflight": inflight,
            "analysis_read": inflight.bytes_read() if inflight else {},
            "output_write": sum(o["bytes"] for o in outputs.values()),
        }
