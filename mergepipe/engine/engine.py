"""The streaming merge engine: executes a plan block by block and publishes a snapshot atomically.

For each tensor of the base (in file order) and each group of adjacent grid blocks: read the base
range and only the expert blocks the plan selected (exact positioned reads, adjacent ranges coalesced,
a small read-ahead queue on a background thread), merge each block with the operator, and write it
at its final offset of a pre-sized output shard. Blocks no expert touches are copied from the base
without decoding. Blocks of full/delta checkpoints with linear, task arithmetic, TIES or DARE are merged
by the fused kernels of mergepipe.kernels (no per-expert float32 temporaries); the rest by the torch path
of mergepipe.ops. Memory is bounded by a byte budget on the input in flight (groups read ahead plus
blocks waiting to be merged and written, ``inflight_bytes``), so it does not grow with K; groups are cut
so that each reads at most ``group_read_bytes`` (at least one block).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from mergepipe.version import __version__
from mergepipe.catalog.db import Catalog, now
from mergepipe.catalog.plans import has_plan
from mergepipe.catalog.runs import mark_run_published
from mergepipe.catalog.snapshots import record_snapshot
from mergepipe.errors import ExecutionError
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES, BlockSpan, tensor_grid
from mergepipe.engine.inflight import InflightAnalysis
from mergepipe.manifest.build import Manifest, file_sha256
from mergepipe.ops.core import block_seed, combine, get_op, sparsify
from mergepipe.planner.plan import Plan, compact_ranges, expand_ranges, load_plan
from mergepipe.catalog.models import check_unchanged, register
from mergepipe.planner.settings import tensor_density, tensor_weight
from mergepipe.storage.sources import open_source
from mergepipe.storage.safetensors import (
    DTYPES, FLOAT_DTYPES, INDEX_NAME, Checkpoint, RangeReader, TensorInfo, bytes_to_tensor,
    open_checkpoint, rows_shape,
)
from mergepipe.engine.txn import Transaction, check_output_path

DEFAULT_SHARD_BYTES = 2 << 30
GROUP_BYTES = 4 << 20
READAHEAD = 3
# Bytes of input (base + expert buffers) read or being read and not yet merged and written: read-ahead
# and pending blocks stop there, so memory does not grow with K (a group's cost is its base bytes plus
# the expert bytes the plan selects in it; a group is also cut at GROUP_READ_BYTES of such cost).
INFLIGHT_BYTES = 64 << 20
GROUP_READ_BYTES = 16 << 20
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.jinja")


@dataclass
class OutShard:
    fname: str
    header: bytes
    offsets: dict[str, int]  # tensor -> absolute offset of its data in the file
    size: int


def plan_shards(tensors: list[TensorInfo], shard_bytes: int) -> list[OutShard]:
    """Split tensors (in order) into shards of at most ``shard_bytes`` of data; build each header."""
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    shards = []
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        rel = {}
        for t in group:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            rel[t.name] = pos
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        start = 8 + len(raw)
        shards.append(OutShard(fname, len(raw).to_bytes(8, "little") + raw,
                               {n: start + r for n, r in rel.items()}, start + pos))
    return shards


class ShardWriter:
    """Pre-sized output file written with positioned writes, hashed in write order."""

    def __init__(self, directory: Path, shard: OutShard):
        import hashlib
        self.shard = shard
        self.path = directory / shard.fname
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(self.fd, shard.size)
        self.hash = hashlib.sha256()
        self.pos = 0
        self.write(0, shard.header)

    def write(self, offset: int, data) -> None:
        if offset != self.pos:
            raise ExecutionError(f"{self.path.name}: out-of-order write at {offset} (expected {self.pos})")
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)
        self.hash.update(view)
        self.pos += len(view)

    def close(self) -> dict:
        if self.pos != self.shard.size:
            raise ExecutionError(f"{self.path.name}: wrote {self.pos} of {self.shard.size} bytes")
        os.fsync(self.fd)
        os.close(self.fd)
        return {"sha256": "sha256:" + self.hash.hexdigest(), "bytes": self.pos}


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


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class Engine:
    """``Engine(catalog).execute(plan, out=DIR)`` -> ``(snapshot_id, manifest)``."""

    def __init__(self, catalog: Catalog, storage=None, transaction_manager=None,
                 readahead: int = READAHEAD, group_bytes: int = GROUP_BYTES, threads: int = 1,
                 workers: int | None = None, fused: bool = True, inflight_bytes: int = INFLIGHT_BYTES,
                 group_read_bytes: int = GROUP_READ_BYTES):
        self.catalog = catalog
        # Memory bound: input bytes in flight (read ahead or waiting to be merged and written), and the
        # most a group of blocks reads; ``readahead`` caps the number of groups being read ahead.
        self.inflight_bytes = inflight_bytes
        self.group_read_bytes = group_read_bytes
        # Merge blocks with the fused numba kernels where they apply (bit-identical to the torch path).
        self.fused = fused
        # Blocks are merged on a pool of single-threaded workers (one per core by default).
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        # Block-sized kernels gain nothing from intra-op threads, and OpenMP spin-waits collapse when
        # the cores are shared (measured: 14x slower with 2 threads on a loaded 2-core machine).
        self.threads = threads
        self.readahead = readahead
        self.group_bytes = group_bytes

    # --- validation ------------------------------------------------------------------------------
    def _check_inputs(self, plan: Plan) -> None:
        for inp in [plan["base"], *plan["experts"]]:
            row = self.catalog.model(inp["id"])
            if row["fingerprint"] != inp["fingerprint"]:
                raise ExecutionError(f"{inp['id']} was re-registered since plan {plan.id} was made; plan again")
            check_unchanged(row)
        if (self.catalog.grid_block_bytes(plan["base"]["id"]) or DEFAULT_BLOCK_BYTES) != plan["grid"]["block_bytes"]:
            raise ExecutionError(f"the block grid of {plan['base']['id']} changed since plan {plan.id}; plan again")

    def execute(self, plan: Plan | str, out: str | Path | None = None, model_id: str | None = None,
                out_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None, run_id: int | None = None):
        if isinstance(plan, str):
            plan = load_plan(self.catalog, plan)
        if out is None:
            raise ExecutionError("an output directory is required (--out)")
        out = Path(out).absolute()
        model_id = model_id or out.name
        if self.catalog.has_model(model_id):
            raise ExecutionError(f"model id {model_id!r} is already registered; choose another --model-id")
        if out_shard_bytes <= 0:
            raise ExecutionError("--out-shard-size must be positive")
        check_output_path(out)
        self._check_inputs(plan)
        from mergepipe.planner.plan import save_plan
        if not has_plan(self.catalog, plan.id):
            save_plan(self.catalog, plan)
        txn = Transaction(self.catalog, out)
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _raise_interrupt)
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            staging = txn.begin()
            t0 = time.perf_counter()
            result = self._run(plan, staging, out_shard_bytes, progress)
            manifest = self._manifest(plan, result, model_id, out, time.perf_counter() - t0)
            manifest.write(staging)
            txn.publish()
            txn.commit(lambda: self._register(plan, manifest, model_id, out, run_id, result["inflight"]))
        except BaseException:
            txn.abort()
            raise
        finally:
            torch.set_num_threads(saved_threads)
            if previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return manifest.snapshot_id, manifest

    # --- the streaming loop ------------------------------------------------------------------------
    def _run(self, plan: Plan, staging: Path, out_shard_bytes: int, progress) -> dict:
        op = get_op(plan["operator"])
        params = plan["params"]
        experts = plan["experts"]
        base_ck = open_checkpoint(plan["base"]["uri"])
        sources = [open_source(e["kind"], e["uri"]) for e in experts]
        order = sorted(base_ck.tensors.values(), key=lambda t: (t.file, t.offset))
        shards = plan_shards(order, out_shard_bytes)
        shard_of = {n: s for s in shards for n in s.offsets}
        selected = {e["id"]: {t: set(expand_ranges(rs)) for t, rs in plan["access"][e["id"]].items()} for e in experts}
        inflight = InflightAnalysis(plan, base_ck, order) if any(e.get("analyze") for e in experts) else None
        thresholds = {**plan["thresholds"], **(inflight.thresholds if inflight else {})}

        def takes_part(ei: int, name: str, block: int) -> bool:
            eid = experts[ei]["id"]
            return not (inflight and eid in inflight.jobs) or inflight.keeps(eid, name, block)
        weight_sums = {t.name: sum(tensor_weight(e, t.name) or 0.0 for e in experts) for t in order}

        def passthrough_ok(name: str) -> bool:
            # linear without normalize scales the base by sum(w): then no block is a plain copy
            return not (op.whole_models and not params["normalize"] and weight_sums[name] != 1.0)

        def span_cost(info, span) -> int:  # bytes one block makes the engine hold: base + selected experts
            cost = span.nbytes
            for ei, e in enumerate(experts):
                if span.index in selected[e["id"]].get(info.name, ()):
                    cost += sum(n for _, _, n in sources[ei].block_ranges(info.name, span))
            return cost
        work = block_groups(order, plan["grid"]["block_bytes"], self.group_bytes, span_cost, self.group_read_bytes)
        total_blocks = sum(len(g) for _, g in work)
        readers = [RangeReader(src.checkpoint) for src in sources]
        fixed_cache: list[tuple[str, list] | None] = [None] * len(experts)  # LoRA A of the current tensor
        base_reader = RangeReader(base_ck, sequential=True)
        writers = {s.fname: ShardWriter(staging, s) for s in shards}
        by_tensor: dict[str, int] = {}
        touched: dict[str, dict[str, list[int]]] = {e["id"]: {} for e in experts}
        timing = {"read_wait_s": 0.0, "compute_s": 0.0, "write_s": 0.0}

        def fetch(item):
            info, group = item
            start, end = group[0], group[-1]
            base_buf = base_reader.read(info.file, info.offset + start.rel_offset,
                                        end.rel_offset + end.nbytes - start.rel_offset)
            exp_bufs, nread = [], 0
            for ei, e in enumerate(experts):
                sel = selected[e["id"]].get(info.name, ())
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

        done_blocks = 0
        read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mergepipe-read")
        compute_pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="mergepipe-compute",
                                          initializer=torch.set_num_threads, initargs=(self.threads,))
        if self.fused:  # import numba and load the cached kernels while the first groups are read
            compute_pool.submit(_warm_kernels)
        reads: deque = deque()  # (item, cost, future)
        pending: deque = deque()  # (writer, offset, future-or-bytes, span count, bytes released) in output order
        queued = deque((item, sum(span_cost(item[0], s) for s in item[1])) for item in work)
        held_bytes = 0  # cost of the groups submitted for reading whose blocks are not all written yet

        def submit_reads() -> None:
            nonlocal held_bytes
            while queued and len(reads) < self.readahead:
                item, cost = queued[0]
                if held_bytes and held_bytes + cost > self.inflight_bytes:
                    break
                queued.popleft()
                held_bytes += cost
                reads.append((item, cost, read_pool.submit(fetch, item)))

        def merge_one(info, span, raw, contributors):
            t_c = time.perf_counter()
            data = self._merge_block(op, params, plan["seed"], experts, sources, weight_sums[info.name], info, span,
                                     raw, contributors, thresholds)
            timing["compute_s"] += time.perf_counter() - t_c
            return data

        def drain(limit: int) -> None:
            nonlocal done_blocks, held_bytes
            while len(pending) > limit:
                writer, offset, data, n, release = pending.popleft()
                if not isinstance(data, memoryview):
                    data = data.result()
                t_w = time.perf_counter()
                writer.write(offset, data)
                timing["write_s"] += time.perf_counter() - t_w
                held_bytes -= release
                if n:
                    done_blocks += n
                    if progress:
                        progress(done_blocks, total_blocks, sum(r.bytes_read for r in readers))

        try:
            submit_reads()
            while reads:
                item, cost, fut = reads.popleft()
                t_wait = time.perf_counter()
                base_buf, exp_bufs, nread = fut.result()
                timing["read_wait_s"] += time.perf_counter() - t_wait
                submit_reads()
                info, group = item
                if inflight and group[0].index == 0:
                    inflight.ready(info)
                writer = writers[shard_of[info.name].fname]
                base_off = shard_of[info.name].offsets[info.name]
                g0 = group[0].rel_offset
                for k, span in enumerate(group):
                    raw = memoryview(base_buf)[span.rel_offset - g0: span.rel_offset - g0 + span.nbytes]
                    contributors = [(ei, bufs[span.index]) for ei, bufs in enumerate(exp_bufs)
                                    if span.index in bufs and takes_part(ei, info.name, span.index)]
                    if info.dtype not in FLOAT_DTYPES or (not contributors and passthrough_ok(info.name)):
                        data = raw
                    else:
                        data = compute_pool.submit(merge_one, info, span, raw, contributors)
                    last = k == len(group) - 1
                    pending.append((writer, base_off + span.rel_offset, data, len(group) if last else 0,
                                    cost if last else 0))
                    for ei, _ in contributors:
                        touched[experts[ei]["id"]].setdefault(info.name, []).append(span.index)
                if nread:
                    by_tensor[info.name] = by_tensor.get(info.name, 0) + nread
                del base_buf, exp_bufs  # the pending blocks hold what they need
                drain(4 * self.workers)
                submit_reads()
                while not reads and queued and pending:  # the byte budget is full: write out, then read on
                    drain(len(pending) - 1)
                    submit_reads()
            drain(0)
        finally:
            read_pool.shutdown(wait=True, cancel_futures=True)
            compute_pool.shutdown(wait=True, cancel_futures=True)
            for r in readers:
                r.close()
            base_reader.close()
            if inflight:
                inflight.close()
        outputs = {name: w.close() for name, w in writers.items()}
        self._finish_files(base_ck, staging, shards)
        for extra in sorted(staging.iterdir()):
            if extra.name not in outputs:
                outputs[extra.name] = {"sha256": file_sha256(extra), "bytes": extra.stat().st_size}
        realized_by_expert = {e["id"]: r.bytes_read for e, r in zip(experts, readers)}
        for e in experts:
            planned = plan["expert_read_by_expert"][e["id"]]
            if realized_by_expert[e["id"]] != planned:
                raise ExecutionError(f"realized expert read of {e['id']} ({realized_by_expert[e['id']]} B) "
                                     f"differs from the plan ({planned} B); nothing was published")
        if sum(realized_by_expert.values()) > plan["budget"]["bytes"] and plan["full_expert_bytes"]:
            raise ExecutionError("realized expert read exceeds the budget; nothing was published")
        return {
            "outputs": outputs, "realized_by_expert": realized_by_expert, "realized_by_tensor": by_tensor,
            "touched": {e: {t: compact_ranges(b) for t, b in sorted(ts.items())} for e, ts in touched.items()},
            "base_read": base_reader.bytes_read, "timing": timing, "inflight": inflight,
            "analysis_read": inflight.bytes_read() if inflight else {},
            "output_write": sum(o["bytes"] for o in outputs.values()),
        }

    def _merge_block(self, op, params, seed, experts, sources, weight_sum, info, span, raw, contributors, thresholds):
        shape = rows_shape(info, span.row_end - span.row_start)
        if self.fused:
            data = self._fused_block(op, params, seed, experts, sources, weight_sum, info, span, shape, raw,
                                     contributors, thresholds)
            if data is not None:
                return data
        base = bytes_to_tensor(raw, info.dtype, shape).float()
        deltas = []
        for ei, (bufs, fixed) in contributors:
            e = experts[ei]
            delta = sources[ei].delta(info.name, span, bufs, fixed, base).reshape(shape)
            thr = thresholds.get(e["id"], {}).get(info.name, [])
            d = sparsify(op, delta, tensor_density(e, info.name) or 1.0, params, thr,
                         block_seed(seed, e["id"], info.name, span.index))
            deltas.append((tensor_weight(e, info.name), d))
        merged = combine(op, base, deltas, weight_sum, params)
        return tensor_bytes(merged.to(DTYPES[info.dtype][0]))

    @staticmethod
    def _fused_block(op, params, seed, experts, sources, weight_sum, info, span, shape, raw, contributors, thresholds):
        """The fused kernel (kernels.fused_merge) for full or delta checkpoints with linear, task
        arithmetic, TIES or DARE; None where it does not apply (LoRA, other operators, fp16/fp64)."""
        from mergepipe.ops import kernels
        if op.sparsify not in kernels.FUSED_SPARSIFY or info.dtype not in kernels.CODES:
            return None
        contributions = []
        for ei, (bufs, _fixed) in contributors:
            src = sources[ei]
            if getattr(src, "kind", None) not in ("full", "delta") or len(bufs) != 1:
                return None
            e = experts[ei]
            density = tensor_density(e, info.name) or 1.0
            bseed = block_seed(seed, e["id"], info.name, span.index) if op.random and density < 1.0 else 0
            contributions.append((bufs[0], src.checkpoint.tensors[info.name].dtype, src.kind == "delta",
                                  tensor_weight(e, info.name), density, thresholds.get(e["id"], {}).get(info.name, []),
                                  bseed))
        out = kernels.fused_merge(op, params, raw, info.dtype, math.prod(shape), contributions, weight_sum)
        return None if out is None else memoryview(out)

    def _finish_files(self, base_ck: Checkpoint, staging: Path, shards: list[OutShard]) -> None:
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(s.size - len(s.header) for s in shards)},
                     "weight_map": {n: s.fname for s in shards for n in s.offsets}}
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        if base_ck.root.is_dir():
            for name in COPIED_FILES:
                src = base_ck.root / name
                if src.is_file():
                    shutil.copyfile(src, staging / name)

    # --- manifest and catalog ----------------------------------------------------------------------
    def _manifest(self, plan: Plan, result: dict, model_id: str, out: Path, seconds: float) -> Manifest:
        outputs = dict(result["outputs"])
        core = {
            "format": "mergepipe.manifest/1",
            "plan_id": plan.id, "plan_digest": plan.digest,
            "operator": plan["operator"], "params": plan["params"], "seed": plan["seed"],
            "strategy": plan["strategy"], "grid": plan["grid"],
            "inputs": {"base": plan["base"], "experts": plan["experts"]},
            "budget": plan["budget"], "full_expert_bytes": plan["full_expert_bytes"],
            "estimated": plan["estimate"],
            "estimated_by_expert": plan["expert_read_by_expert"],
            "realized": {"base_read": result["base_read"], "expert_read": sum(result["realized_by_expert"].values()),
                         "output_write": result["output_write"]},
            "realized_by_expert": result["realized_by_expert"],
            "realized_by_tensor": dict(sorted(result["realized_by_tensor"].items())),
            "touched": result["touched"],
            "error_bound": plan["error_bound"],
            "outputs": outputs,
            "software": {"mergepipe": __version__, "torch": torch.__version__},
            "parents": [{"id": plan["base"]["id"], "role": "base", "weight": None}]
            + [{"id": e["id"], "role": "expert", "weight": e["weight"]} for e in plan["experts"]],
        }
        if result["analysis_read"]:
            core["analyzed_on_the_way"] = {e: {"bytes_read": n} for e, n in sorted(result["analysis_read"].items())}
        snapshot_id = "snap-" + os.urandom(6).hex()
        run = {"snapshot_id": snapshot_id, "model_id": model_id, "out": str(out), "created_at": now(),
               "seconds": round(seconds, 4), "timing": {k: round(v, 4) for k, v in result["timing"].items()},
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        return Manifest(core, run)

    def _register(self, plan: Plan, manifest: Manifest, model_id: str, out: Path, run_id, inflight=None) -> None:
        if inflight:
            inflight.store(self.catalog)
        register(self.catalog, model_id, str(out), base_id=plan["base"]["id"], snapshot_id=manifest.snapshot_id)
        record_snapshot(self.catalog, manifest.snapshot_id, model_id, plan.id, str(out), manifest.manifest_hash,
                        manifest.run["created_at"], manifest.to_json(), manifest.core["parents"])
        if run_id is not None:
            mark_run_published(self.catalog, run_id, manifest.snapshot_id)


def _warm_kernels() -> None:
    from mergepipe.ops import kernels
    kernels.warm_up()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
