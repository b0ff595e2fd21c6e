"""Executing an incremental plan (planner/extend.py): the parent snapshot streamed tensor by tensor, the
changed expert's planned blocks and the base blocks the plan needs, nothing of the other experts.

Per block: M' = a*M + g*base + b*delta where the expert's delta is in the merge (for a full checkpoint
the plan's ``g_read`` already folds -b*base in: M' = a*M + g_read*base + b*x), a*M + g*base elsewhere,
and a plain copy of the snapshot's bytes where a = 1 and g = 0. Arithmetic in float32 for 16-bit
tensors, float64 for wider ones (so that fp32 results round once, like the from-scratch merge).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mergepipe.catalog.snapshots import snapshot_manifest_hash
from mergepipe.engine.blocks import as_bytes, check_finite
from mergepipe.engine.delete import lock_snapshot
from mergepipe.engine.pipeline import block_groups
from mergepipe.engine.write_behind import WriteBehind
from mergepipe.errors import ExecutionError
from mergepipe.manifest.build import MANIFEST_NAME, file_sha256
from mergepipe.manifest.verify import load_manifest
from mergepipe.planner.plan import Plan, expand_ranges
from mergepipe.storage.registry import open_checkpoint
from mergepipe.storage.safetensors import FLOAT_DTYPES, ITEMSIZE, bytes_to_tensor, rows_shape
from mergepipe.storage.sources import open_source
from mergepipe.storage.writers import ShardWriter, finish_files, plan_shards

READAHEAD = 4
GROUP_BYTES = 16 << 20  # the snapshot is read in full, in order: larger groups, fewer requests
PENDING_BYTES = 64 << 20  # snapshot bytes a file's hash may hold back when they arrive out of order
GAP_CHUNK = 16 << 20


class _FileHash:
    """The sha256 of one file, fed the ranges the extend reads (in any order); the bytes it is not fed
    (the header, any gap) are read through ``read(offset, nbytes)``. Ranges ahead of the hashed prefix
    are held back up to PENDING_BYTES; past that the file is hashed from storage at the end."""

    def __init__(self, size: int, start: int, read):
        self.size, self.read = size, read
        self.h, self.pos, self.pending, self.held = hashlib.sha256(), 0, {}, 0
        self.whole = False  # True: hash the whole file from storage at the end
        self._read_to(start)

    def feed(self, offset: int, data) -> None:
        if self.whole or offset + len(data) <= self.pos:
            return
        if offset < self.pos:
            data, offset = memoryview(data)[self.pos - offset:], self.pos
        if offset > self.pos:
            self._hold(offset, data)
            return
        self.h.update(data)
        self.pos += len(data)
        self._drain()

    def _hold(self, offset: int, data) -> None:
        if self.held + len(data) > PENDING_BYTES:
            self.whole, self.pending, self.held = True, {}, 0
            return
        self.pending[offset] = bytes(data)
        self.held += len(data)

    def _drain(self) -> None:
        while self.pending and (offset := min(self.pending)) <= self.pos:
            data = self.pending.pop(offset)
            self.held -= len(data)
            if offset + len(data) > self.pos:
                self.h.update(memoryview(data)[self.pos - offset:])
                self.pos = offset + len(data)

    def _read_to(self, end: int) -> None:
        while self.pos < end:
            n = min(GAP_CHUNK, end - self.pos)
            self.h.update(self.read(self.pos, n))
            self.pos += n

    def complete(self) -> bool:
        return not self.whole and self.pos >= self.size

    def hexdigest(self) -> str:
        """The digest, reading from storage what was not fed."""
        if self.whole:
            self.h, self.pos, self.whole = hashlib.sha256(), 0, False
        while self.pending:
            self._read_to(min(self.pending))
            self._drain()
        self._read_to(self.size)
        return self.h.hexdigest()


class ParentHashes:
    """The parent snapshot's safetensors files hashed on the way: the extend reads them in full anyway, so
    their sha256 is checked against the parent's manifest (the catalog's copy) before anything is published.
    Size and mtime say nothing of a value changed in place."""

    def __init__(self, catalog, parent: dict, ck):
        manifest = load_manifest(catalog, parent["snapshot_id"])
        if manifest.manifest_hash != parent["manifest_hash"]:
            raise ExecutionError(f"snapshot {parent['snapshot_id']}'s manifest changed since the plan was made; "
                                 f"plan again")
        self.sid, self.outputs = parent["snapshot_id"], manifest.core["outputs"]
        self.gaps = ck.reader()  # its reads are not the snapshot's planned reads
        starts: dict[str, int] = {}
        for t in ck.tensors.values():
            starts[t.file] = min(starts.get(t.file, t.offset), t.offset)
        self.files = {f: _FileHash(ck.file_sizes[f], starts[f], lambda o, n, f=f: self.gaps.read(f, o, n))
                      for f in sorted(starts)}
        self.checked: set[str] = set()

    def feed(self, fname: str, offset: int, data) -> None:
        fh = self.files[fname]
        fh.feed(offset, data)
        if fh.complete() and fname not in self.checked:
            self._check(fname)

    def check_all(self) -> None:
        for fname in self.files:
            if fname not in self.checked:
                self._check(fname)

    def _check(self, fname: str) -> None:
        digest = self.files[fname].hexdigest()
        expected = (self.outputs.get(fname) or {}).get("sha256", "")
        self.checked.add(fname)
        if expected.removeprefix("sha256:") != digest:
            raise ExecutionError(f"snapshot {self.sid}: {fname} does not match the sha256 in its manifest (changed "
                                 f"since it was published); nothing was published (`mergepipe verify {self.sid}`)")

    def close(self) -> None:
        self.gaps.close()


def check_parent_present(catalog, parent: dict) -> None:
    """The parent snapshot is still in the catalog, as planned (call inside the transaction that registers the
    child: a `delete` that committed first wins, and the child is not published)."""
    if snapshot_manifest_hash(catalog, parent["snapshot_id"]) != parent["manifest_hash"]:
        raise ExecutionError(f"snapshot {parent['snapshot_id']} ({parent['model_id']}) was deleted while this extend "
                             f"ran; nothing was published")


class ParentLock:
    """The extend's shared lock on its (local) parent snapshot while it reads it: `delete` of the parent is
    refused meanwhile. Taken before the parent's files are opened; the parent is then checked to be still
    registered (a delete may have finished just before)."""

    def __init__(self, catalog, parent: dict):
        self.fd = None
        if not Path(parent["uri"]).is_dir():  # a remote parent: the commit's check alone (check_parent_present)
            check_parent_present(catalog, parent)
            return
        try:
            self.fd = lock_snapshot(Path(parent["uri"]), shared=True)
        except BlockingIOError:
            raise ExecutionError(f"snapshot {parent['snapshot_id']} ({parent['model_id']}) is being deleted; "
                                 f"nothing was published") from None
        try:
            check_parent_present(catalog, parent)
        except ExecutionError:
            self.close()
            raise
        if self.fd is None:
            raise ExecutionError(f"snapshot {parent['snapshot_id']}: {parent['uri']} has no {MANIFEST_NAME} any "
                                 f"more; nothing was published")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ExtendPipeline:
    """Runs an incremental plan into ``staging``; :meth:`run` returns what the manifest needs
    (``on_shard_closed``: as for :class:`MergePipeline`)."""

    def __init__(self, engine, plan: Plan, staging: Path, out_shard_bytes: int, progress, on_shard_closed=None):
        self.engine, self.plan, self.staging, self.progress = engine, plan, staging, progress
        self.coefs = plan.coefficients
        self.changed = plan.changed
        self.parent_lock = ParentLock(engine.catalog, plan.parent)  # before the parent's files are opened
        try:
            self._open(plan, out_shard_bytes, on_shard_closed)
        except BaseException:
            self.parent_lock.close()
            raise

    def _open(self, plan: Plan, out_shard_bytes: int, on_shard_closed) -> None:
        staging, engine = self.staging, self.engine
        self.base_ck = open_checkpoint(plan.base["uri"])
        self.snap_ck = open_checkpoint(plan.parent["uri"])
        self.source = open_source(self.changed["kind"], self.changed["uri"])
        self.order = sorted(self.base_ck.tensors.values(), key=lambda t: (t.file, t.offset))
        self.shards = plan_shards(self.order, out_shard_bytes)
        self.shard_of = {n: s for s in self.shards for n in s.offsets}
        reads = plan.reads
        self.expert_blocks = {t: set(expand_ranges(rs)) for t, rs in reads["expert"].items()}
        self.base_blocks = {t: set(expand_ranges(rs)) for t, rs in reads["base"].items()}
        self.work = block_groups(self.order, plan.block_bytes, max(engine.group_bytes, GROUP_BYTES))
        self.total_blocks = sum(len(g) for _, g in self.work)
        self.snap_reader = self.snap_ck.reader(sequential=True)
        self.parent_hashes = ParentHashes(engine.catalog, plan.parent, self.snap_ck)
        self.base_reader = self.base_ck.reader()
        self.expert_reader = self.source.checkpoint.reader()
        self.fixed: tuple[str, list] | None = None
        self.writers = {s.fname: ShardWriter(staging, s, on_shard_closed) for s in self.shards}
        self.timing = {"read_wait_s": 0.0, "compute_s": 0.0, "write_s": 0.0}
        self.by_tensor: dict[str, int] = {}

    # --- reads -------------------------------------------------------------------------------------
    def fetch(self, item):
        """The snapshot's bytes of a group, the base and expert blocks it needs, and the expert bytes read
        (on a read thread; several groups may be read at once)."""
        info, group = item
        sinfo = self.snap_ck.tensors[info.name]
        if (sinfo.dtype, tuple(sinfo.shape)) != (info.dtype, tuple(info.shape)):
            raise ExecutionError(f"snapshot {self.plan.parent['snapshot_id']} holds {info.name} as {sinfo.dtype} "
                                 f"{list(sinfo.shape)}, the base as {info.dtype} {list(info.shape)}")
        start, end = group[0], group[-1]
        snap = self.snap_reader.read(sinfo.file, sinfo.offset + start.rel_offset,
                                     end.rel_offset + end.nbytes - start.rel_offset)
        need_base = [s for s in group if s.index in self.base_blocks.get(info.name, ())]
        views = self.base_reader.read_ranges([(info.file, info.offset + s.rel_offset, s.nbytes) for s in need_base])
        base = dict(zip((s.index for s in need_base), views))
        spans = [s for s in group if s.index in self.expert_blocks.get(info.name, ())]
        experts, nread = {}, 0
        if spans:
            if self.fixed is None or self.fixed[0] != info.name:
                self.fixed = (info.name, self.expert_reader.read_ranges(self.source.fixed_ranges(info.name)))
            per_span = [self.source.block_ranges(info.name, s) for s in spans]
            views = self.expert_reader.read_ranges([r for rs in per_span for r in rs])
            nread = sum(n for rs in per_span for _, _, n in rs)
            pos = 0
            for s, rs in zip(spans, per_span):
                experts[s.index] = (views[pos:pos + len(rs)], self.fixed[1])
                pos += len(rs)
        return snap, base, experts, nread

    # --- one block ---------------------------------------------------------------------------------
    def merge_block(self, info, span, raw, base_raw, expert):
        """M' = a*M + b*x + g*base of one block: the fused kernel for bf16 (full-checkpoint experts),
        else torch."""
        full = expert is None or self.source.kind == "full"
        data = self.fused_block(info, raw, base_raw, expert) if full and info.dtype == "BF16" else None
        if data is None:
            data = self.torch_block(info, span, raw, base_raw, expert)
        check_finite(data, info, span)
        return data

    def fused_block(self, info, raw, base_raw, expert):
        if not self.engine.fused:
            return None
        from mergepipe.ops import kernels
        c = self.coefs
        x_raw, g = (None, c["g"]) if expert is None else (expert[0][0], c["g_read"])
        x_dtype = self.source.checkpoint.tensors[info.name].dtype if expert is not None else "BF16"
        out = kernels.affine_bf16(raw, c["a"], x_raw, x_dtype, c["b"], base_raw if g != 0 else None, g)
        return None if out is None else memoryview(out)

    def torch_block(self, info, span, raw, base_raw, expert):
        from mergepipe.engine.threads import torch_module
        torch = torch_module()  # with this thread's intra-op threads (engine/threads.py)
        c = self.coefs
        shape = rows_shape(info, span.row_end - span.row_start)
        wide = torch.float64 if ITEMSIZE[info.dtype] > 2 else torch.float32
        out = bytes_to_tensor(raw, info.dtype, shape).to(wide, copy=True)  # updated in place
        if c["a"] != 1:
            out.mul_(c["a"])
        g = c["g"]
        if expert is not None:
            bufs, fixed = expert
            if self.source.kind == "full":  # g_read = g - b: x's coefficient is b, the base's g - b
                xinfo = self.source.checkpoint.tensors[info.name]
                out.add_(torch.mul(bytes_to_tensor(bufs[0], xinfo.dtype, shape).to(wide), c["b"]))
                g = c["g_read"]
            else:
                out.add_(torch.mul(self.source.delta(info.name, span, bufs, fixed, None).reshape(shape).to(wide),
                                   c["b"]))
        if g != 0:
            out.add_(torch.mul(bytes_to_tensor(base_raw, info.dtype, shape).to(wide), g))
        return as_bytes(out, info.dtype)

    def changes(self, info, span) -> bool:
        return info.dtype in FLOAT_DTYPES and (not self.coefs["copy_unread"]
                                                or span.index in self.expert_blocks.get(info.name, ()))

    # --- the loop ----------------------------------------------------------------------------------
    def merge_group(self, item, fetched) -> None:
        """Hand each block of a group to the writer, in output order: its snapshot bytes as they are, or
        the future of its merge (run on the engine's executor; torch releases the GIL)."""
        info, group = item
        snap, base, experts, nread = fetched
        sinfo = self.snap_ck.tensors[info.name]
        self.parent_hashes.feed(sinfo.file, sinfo.offset + group[0].rel_offset, snap)
        if nread:
            self.by_tensor[info.name] = self.by_tensor.get(info.name, 0) + nread
        shard = self.shard_of[info.name]
        writer = self.writers[shard.fname]
        g0 = group[0].rel_offset
        for span in group:
            raw = memoryview(snap)[span.rel_offset - g0: span.rel_offset - g0 + span.nbytes]
            data = raw
            if self.changes(info, span):
                data = self.executor.submit(self.timed_merge, info, span, raw, base.get(span.index),
                                            experts.get(span.index))
            self.write_behind.put(writer, shard.offsets[info.name] + span.rel_offset, data)

    def timed_merge(self, *args):
        t_c = time.perf_counter()
        data = self.merge_block(*args)
        self.timing["compute_s"] += time.perf_counter() - t_c
        return data

    def run(self) -> dict:
        """Read ahead on one thread, merge on the executor, write behind on another thread."""
        # groups read ahead are read at once (a deeper disk queue); a LoRA source reads its A once per
        # tensor (self.fixed), which needs the groups read in order
        readers = READAHEAD if self.source.kind == "full" else 1
        pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="mergepipe-extend-read")
        self.executor = self.engine.make_executor()
        self.write_behind = WriteBehind(4 * self.engine.workers, self.timing)
        queued, reads, done = deque(self.work), deque(), 0
        try:
            while queued or reads:
                while queued and len(reads) < READAHEAD:
                    item = queued.popleft()
                    reads.append((item, pool.submit(self.fetch, item)))
                item, fut = reads.popleft()
                t_wait = time.perf_counter()
                fetched = fut.result()
                self.timing["read_wait_s"] += time.perf_counter() - t_wait
                self.merge_group(item, fetched)
                del fetched
                done += len(item[1])
                if self.progress:
                    self.progress(done, self.total_blocks, self.expert_reader.bytes_read)
            self.parent_hashes.check_all()
            self.write_behind.close()
        except BaseException:
            self.write_behind.abort()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.executor.shutdown()
            for r in (self.snap_reader, self.base_reader, self.expert_reader, self.parent_hashes, self.parent_lock):
                r.close()
        return self.finish()

    def finish(self) -> dict:
        plan, staging = self.plan, self.staging
        outputs = {name: w.close() for name, w in self.writers.items()}
        finish_files(self.base_ck, staging, self.shards, plan.tokenizer)
        for extra in sorted(p for p in staging.rglob("*") if p.is_file()):
            name = extra.relative_to(staging).as_posix()
            if name not in outputs:
                outputs[name] = {"sha256": file_sha256(extra), "bytes": extra.stat().st_size}
        eid = self.changed["id"]
        realized = {eid: self.expert_reader.bytes_read}
        est = plan.estimated
        for what, got, planned in (("expert", realized[eid], est["expert_read"]),
                                   ("base", self.base_reader.bytes_read, est["base_read"]),
                                   ("snapshot", self.snap_reader.bytes_read, est["snapshot_read"])):
            if got != planned:
                raise ExecutionError(f"realized {what} read ({got} B) differs from the plan ({planned} B); "
                                     f"nothing was published")
        return {
            "outputs": outputs, "realized_by_expert": realized, "realized_by_tensor": self.by_tensor,
            "touched": plan.access, "base_read": self.base_reader.bytes_read,
            "snapshot_read": self.snap_reader.bytes_read, "timing": self.timing, "inflight": None,
            "analysis_read": {}, "output_write": sum(o["bytes"] for o in outputs.values()),
        }
