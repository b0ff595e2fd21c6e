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
from dataclasses import replace
from pathlib import Path

from mergepipe.engine.blocks import converted_block, merge_block, warm_kernels
from mergepipe.engine.compact_inputs import CompactInputs
# check_realized is re-exported (its importers know it from here)
from mergepipe.engine.finish import check_realized, finish_snapshot  # noqa: F401
from mergepipe.engine.vocab import VocabRows, vocab_setting
from mergepipe.errors import ExecutionError
from mergepipe.ops.core import get_op
from mergepipe.planner.plan import Plan, expand_ranges
from mergepipe.planner.settings import tensor_weight
from mergepipe.storage.grid import BlockSpan, tensor_grid
from mergepipe.storage.moe_layout import fused_order
from mergepipe.storage.registry import open_checkpoint
from mergepipe.storage.safetensors import FLOAT_DTYPES, TensorInfo
from mergepipe.storage.sources import open_source
from mergepipe.storage.dtypes import ITEMSIZE
from mergepipe.storage.writers import ShardWriter, plan_shards, written_info

REMOTE_READAHEAD = 8  # groups fetched at once from remote inputs (still within the in-flight byte budget)


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
    into ``staging``; :meth:`run` returns what the manifest needs. ``on_shard_closed(path)`` is called
    as each output shard is complete (written, flushed and hashed)."""

    def __init__(self, engine, plan: Plan, staging: Path, out_shard_bytes: int, progress, on_shard_closed=None):
        self.engine, self.plan, self.staging, self.progress = engine, plan, staging, progress
        self.on_shard_closed = on_shard_closed
        self.op = op = get_op(plan.operator)
        self.params = params = plan.params
        self.experts = experts = plan.experts
        self.base_ck = base_ck = open_checkpoint(plan.base["uri"])
        self.sources = [open_source(e["kind"], e["uri"]) for e in experts]
        # output tensors in file order; each is made of one input tensor (its own name, in the base, unless
        # the plan has a layout: a `slices:` config's renumbered, repeated or copied layers)
        self.layout = plan.layout
        self.inputs = {plan.base_id: base_ck}
        self.inputs.update({e["id"]: src.checkpoint for e, src in zip(experts, self.sources)
                            if self.layout and getattr(src, "kind", None) == "full"})
        vocab = vocab_setting(plan)  # different vocabularies: re-ordered embedding rows (engine/vocab.py)
        self.vocab_rows = VocabRows(self, vocab) if vocab else None
        self.order = order = self._output_tensors()
        self.out_dtype = plan.out_dtype  # float tensors written in it, each block rounded once (None: as they are)
        moe, heads = plan.moe_layout, {}  # per-expert matrices written as fused tensors (storage/moe_layout.py)
        if moe and moe["layout"] == "fused":
            order, heads = fused_order(moe["architecture"], order)
            self.order = order
        self.shards = plan_shards([written_info(t, self.out_dtype) for t in order], out_shard_bytes, heads)
        self.shard_of = {n: s for s in self.shards for n in s.offsets}
        self.selected = {e["id"]: {t: set(expand_ranges(rs)) for t, rs in plan.access_for(e["id"]).items()}
                         for e in experts}
        if plan.analyzed_on_the_way:  # ANALYZE's modules (engine/inflight.py): imported by a first merge only
            import mergepipe.ops.numba_setup  # noqa: F401  (numba's start-up without scipy.linalg)
            from mergepipe.engine.inflight import InflightAnalysis
        self.inflight = inflight = (InflightAnalysis(plan, base_ck, order, catalog=engine.catalog)
                                    if plan.analyzed_on_the_way else None)
        # per expert, the plan's thresholds (copied: engine/vocab.py adds a re-ordered tensor's to them) and, for an
        # expert analyzed on the way, the analysis' own dict, which it fills tensor by tensor (the same object)
        self.thresholds = {eid: dict(per) for eid, per in plan.thresholds.items()}
        self.thresholds.update(inflight.thresholds if inflight else {})
        # a model soup (linear averaging the base in): every float block goes through mergekit's operation order
        self.base_member = member = plan.base_member if op.whole_models else None  # (karcher: its own)
        self.weight_sums = {n: sum(tensor_weight(e, n) or 0.0 for e in experts)
                            + ((tensor_weight(member, n) or 0.0) if member else 0.0)
                            for n in set(self.input_name.values())}
        # interpolation methods: per-tensor scalars, and the budget-omitted blocks (which keep the base)
        # (a copy: a re-ordered vocabulary's embedding tensors get theirs when composed, engine/vocab.py)
        self.coefficients = dict(plan.coefficients)
        self.omitted = {t: set(expand_ranges(rs)) for t, rs in plan.omitted.items()}
        self.compact = CompactInputs(plan)  # blocks the plan reads from the compact tier (storage/compact.py)
        self.work = self.select_work(block_groups(order, plan.block_bytes, engine.group_bytes,
                                                  self.span_cost, engine.group_read_bytes))
        self.total_blocks = sum(len(g) for _, g in self.work)
        self.open_readers()
        self.writers = self.open_writers()
        self.by_tensor: dict[str, int] = {}
        self.touched: dict[str, dict[str, list[int]]] = {e["id"]: {} for e in experts}
        self.timing = {"read_wait_s": 0.0, "compute_s": 0.0, "write_s": 0.0}
        self.done_blocks = 0
        self.reads: deque = deque()  # (item, cost, future)
        self.pending: deque = deque()  # (writer, offset, future-or-bytes, span count, bytes released) in output order
        self.queued = deque((item, sum(self.span_cost(item[0], s) for s in item[1])) for item in self.work)
        self.held_bytes = 0  # cost of the groups submitted for reading whose blocks are not all written yet

    def open_readers(self) -> None:
        """The readers of the experts, the base and the layout's other inputs, and how far ahead to read."""
        engine, base_ck = self.engine, self.base_ck
        self.readers = [src.checkpoint.reader() for src in self.sources]
        self.fixed_cache: list[tuple[str, list] | None] = [None] * len(self.experts)  # LoRA A of the current tensor
        self.base_reader = base_ck.reader(sequential=True)
        self.input_readers = {m: (self.base_reader if ck is base_ck else ck.reader(sequential=True))
                              for m, ck in self.inputs.items()}
        # remote inputs: several groups are fetched at once, so that request latency overlaps (LoRA
        # sources read their A once per tensor through fixed_cache, which needs groups read in order)
        self.parallel_reads = (any(getattr(r, "concurrent", False)
                                   for r in [self.base_reader, *self.input_readers.values(), *self.readers])
                               and all(src.kind != "lora" for src in self.sources))
        self.readahead = max(engine.readahead, REMOTE_READAHEAD) if self.parallel_reads else engine.readahead

    def _output_tensors(self) -> list[TensorInfo]:
        """The output tensors in output order (each an input tensor's info under its output name), with
        ``input_name``, ``input_model`` and ``scale`` of each."""
        base_id = self.plan.base_id
        if self.layout is None:
            order = sorted(self.base_ck.tensors.values(), key=lambda t: (t.file, t.offset))
            if self.vocab_rows:
                order = [self.vocab_rows.output_info(t) if self.vocab_rows.covers(t.name) else t for t in order]
            self.input_name = {t.name: t.name for t in order}
            self.input_model = {t.name: base_id for t in order}
            self.scale = {}
            return order
        order = []
        self.input_name, self.input_model, self.scale = {}, {}, {}
        for out, model, name, scale in self.layout["tensors"]:
            if model not in self.inputs:
                raise ExecutionError(f"the layout copies {name} from {model}, which is not an input of plan "
                                     f"{self.plan.id}")
            info = replace(self.inputs[model].tensors[name], name=out)
            order.append(self.vocab_rows.output_info(info) if self.vocab_rows and self.vocab_rows.covers(out) else info)
            self.input_name[out], self.input_model[out], self.scale[out] = name, model, scale
        return order
    def select_work(self, work: list) -> list:
        """The work items this pipeline runs (all of them; a range task runs a slice)."""
        return work

    def open_writers(self) -> dict:
        """Shard file name -> writer of the blocks (pre-sized shards written in order and hashed)."""
        return {s.fname: ShardWriter(self.staging, s, self.on_shard_closed) for s in self.shards}

    # --- what a block needs ----------------------------------------------------------------------------
    def takes_part(self, ei: int, name: str, block: int, composed: bool = False) -> bool:
        """Whether an expert's block is merged: a block the plan read, less, for an expert analyzed on the way,
        those its analysis finds useless; a re-ordered embedding tensor's blocks (``composed``) always (its composed rows are
        not the ones the analysis saw: engine/vocab.py takes its statistics, as for an analyzed expert)."""
        eid = self.experts[ei]["id"]
        if composed or not (self.inflight and eid in self.inflight.jobs):
            return True
        return self.inflight.keeps(eid, name, block)

    def passthrough_ok(self, name: str) -> bool:
        # linear without normalize scales the base by sum(w): then no block is a plain copy
        scales_base = self.op.whole_models and not self.params_for(name)["normalize"]
        return not self.base_member and not (scales_base and self.weight_sums[name] != 1.0)

    def params_for(self, name: str) -> dict:
        """lambda/normalize/rescale per tensor where the plan gives them so, over the merge-wide ones."""
        return self.plan.params_for(name)

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
        if self.vocab_rows and self.vocab_rows.covers(info.name):
            return self.vocab_rows.span_cost(span)
        cost = span.nbytes
        name = self.input_name[info.name]
        for ei, e in enumerate(self.experts):
            if span.index in self.selected[e["id"]].get(name, ()):
                cost += sum(n for _, _, n in self.sources[ei].block_ranges(name, span))
            else:
                cost += self.compact.nbytes(e["id"], name, span.index)
        return cost

    # --- reads ----------------------------------------------------------------------------------------
    def fetch(self, item):
        """Read one group: the base range and each expert's selected blocks (on the read thread)."""
        info, group = item
        if self.vocab_rows and self.vocab_rows.covers(info.name):
            return self.vocab_rows.fetch(info, group)
        experts, sources, readers, fixed_cache = self.experts, self.sources, self.readers, self.fixed_cache
        start, end = group[0], group[-1]
        base_buf = self.input_readers[self.input_model[info.name]].read(
            info.file, info.offset + start.rel_offset, end.rel_offset + end.nbytes - start.rel_offset)
        name = self.input_name[info.name]
        exp_bufs, nread = [], 0
        for ei, e in enumerate(experts):
            sel = self.selected[e["id"]].get(name, ())
            spans = [s for s in group if s.index in sel]
            if not spans:
                exp_bufs.append({s.index: (block, None) for s in group
                                 if (block := self.compact.read(e["id"], name, s.index)) is not None})
                continue
            src = sources[ei]
            if fixed_cache[ei] is None or fixed_cache[ei][0] != name:
                ranges = src.fixed_ranges(name)
                fixed_cache[ei] = (name, readers[ei].read_ranges(ranges))
                nread += sum(n for _, _, n in ranges)
            fixed = fixed_cache[ei][1]
            per_span = [src.block_ranges(name, s) for s in spans]
            views = readers[ei].read_ranges([r for rs in per_span for r in rs])
            nread += sum(n for rs in per_span for _, _, n in rs)
            out, pos = {}, 0
            for s, rs in zip(spans, per_span):
                out[s.index] = (views[pos:pos + len(rs)], fixed)
                pos += len(rs)
            for s in group:
                if s.index not in out and (block := self.compact.read(e["id"], name, s.index)) is not None:
                    out[s.index] = (block, None)
            exp_bufs.append(out)
        return base_buf, exp_bufs, nread

    def schedule_reads(self) -> None:
        """Submit reads ahead while fewer than ``readahead`` are out and the in-flight budget allows."""
        engine = self.engine
        while self.queued and len(self.reads) < self.readahead:
            item, cost = self.queued[0]
            if self.held_bytes and self.held_bytes + cost > engine.inflight_bytes:
                break
            self.queued.popleft()
            self.held_bytes += cost
            self.reads.append((item, cost, self.read_pool.submit(self.fetch, item)))

    # --- merges ---------------------------------------------------------------------------------------
    def merge_one(self, info, span, raw, contributors):
        """A block task (run by the executor): the merged bytes of one block (``info``: the input tensor's)."""
        t_c = time.perf_counter()
        data = merge_block(self.engine.fused, self.op, self.params_for(info.name), self.plan.seed, self.experts, self.sources,
                           self.weight_sums[info.name], info, span, raw, contributors, self.thresholds,
                           self.coefficients.get(info.name), self.soup_weights(info.name),
                           written_info(info, self.out_dtype).dtype)
        self.timing["compute_s"] += time.perf_counter() - t_c
        return data

    def merge_group(self, info, group, cost, base_buf, exp_bufs) -> None:
        """Queue each block of a group for writing: its base bytes as they are, or a merge task."""
        shard = self.shard_of[info.name]
        writer = self.writers[shard.fname]
        base_off = shard.offsets[info.name]
        g0 = group[0].rel_offset
        name = self.input_name[info.name]
        scale = self.scale.get(info.name)
        in_info = replace(info, name=name)
        composed = bool(self.vocab_rows and self.vocab_rows.covers(info.name))
        out_item, in_item = ITEMSIZE[written_info(info, self.out_dtype).dtype], ITEMSIZE[info.dtype]
        for k, span in enumerate(group):
            raw = memoryview(base_buf)[span.rel_offset - g0: span.rel_offset - g0 + span.nbytes]
            contributors = [(ei, bufs[span.index]) for ei, bufs in enumerate(exp_bufs)
                            if span.index in bufs and self.takes_part(ei, name, span.index, composed)]
            if self.op.copies:  # passthrough: the input tensor as it is, or times its scale
                data = self.as_written(in_info, span, raw) if scale is None or info.dtype not in FLOAT_DTYPES \
                    else self.executor.submit(self.scale_one, in_info, span, raw, scale)
            elif info.dtype not in FLOAT_DTYPES or (not contributors and self.passthrough_ok(name)
                                                    and not self.method_merges(name, span.index)):
                data = self.as_written(in_info, span, raw)
            else:
                data = self.executor.submit(self.merge_one, in_info, span, raw, contributors)
            last = k == len(group) - 1
            self.pending.append((writer, base_off + span.rel_offset // in_item * out_item, data,
                                 len(group) if last else 0, cost if last else 0))
            for ei, _ in contributors:
                self.touched[self.experts[ei]["id"]].setdefault(name, []).append(span.index)

    def scale_one(self, info, span, raw, scale):
        """A passthrough block with a scale (the operator's block kernel, the scale as its scalar)."""
        return merge_block(False, self.op, self.params, self.plan.seed, [], [], 0.0, info, span, raw, [], {},
                           [scale], out_dtype=written_info(info, self.out_dtype).dtype)

    def as_written(self, info, span, raw):
        """A block copied from its input: the bytes as they are, or (a float tensor the plan converts) a task
        converting them to the output dtype."""
        out = written_info(info, self.out_dtype).dtype
        return raw if out == info.dtype else self.executor.submit(converted_block, info, span, raw, out)

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
            name = self.input_name[info.name]
            self.by_tensor[name] = self.by_tensor.get(name, 0) + nread
        del base_buf, exp_bufs  # the pending blocks hold what they need
        self.write_in_order(4 * self.engine.workers)
        self.schedule_reads()
        while not self.reads and self.queued and self.pending:  # the byte budget is full: write out, then read on
            self.write_in_order(len(self.pending) - 1)
            self.schedule_reads()

    def run(self) -> dict:
        engine = self.engine
        self.read_pool = ThreadPoolExecutor(max_workers=self.readahead if self.parallel_reads else 1,
                                            thread_name_prefix="mergepipe-read")
        self.executor = engine.make_executor()
        if engine.fused:  # import numba and load the cached kernels while the first groups are read
            self.executor.submit(warm_kernels)
        try:
            self.schedule_reads()
            while self.reads:
                self.step(*self.reads.popleft())
            self.write_in_order(0)
        except BaseException:
            if self.inflight:
                self.inflight.discard()
            raise
        finally:
            self.read_pool.shutdown(wait=True, cancel_futures=True)
            self.executor.shutdown()
            for r in self.readers:
                r.close()
            for r in self.input_readers.values():
                r.close()
            self.compact.close()
            if self.inflight:
                self.inflight.close()
        return self.finish()

    def finish(self) -> dict:
        """Close the shards, complete the snapshot's files, check the realized reads against the plan."""
        outputs = {name: w.close() for name, w in self.writers.items()}
        realized_by_expert = {e["id"]: r.bytes_read for e, r in zip(self.experts, self.readers)}
        inflight = self.inflight
        return finish_snapshot(self.plan, self.base_ck, self.staging, self.shards, outputs, realized_by_expert, {
            "realized_by_tensor": self.by_tensor, "touched": self.touched, "base_read": self.input_bytes_read(),
            "timing": self.timing, "inflight": inflight,
            "analysis_read": inflight.bytes_read() if inflight else {},
            "compact_read_by_expert": self.compact.bytes_read()})

    def input_bytes_read(self) -> int:
        """Bytes read from the base (and, for a `slices:` layout, the other models it copies from)."""
        return sum(r.bytes_read for r in self.input_readers.values())
