"""Merges held in memory: a plan executed by the streaming pipeline into buffers instead of files.

A search trial (mergepipe.search) scores a recipe on the merged weights and throws them away, so it needs
none of a snapshot's work: no output files, no fsync, no hashing, no manifest, no catalog row. The
pipeline is the one a merge runs (same reads, same kernels, same bytes read, checked against the plan);
only its writers differ: each output shard is a ``bytearray`` written in order, and the result is a state
dict of tensors viewing those buffers (tensor name -> torch tensor, the output's dtypes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged
from mergepipe.engine.pipeline import MergePipeline, check_realized
from mergepipe.errors import ExecutionError
from mergepipe.planner.plan import Plan
from mergepipe.storage.dtypes import ITEMSIZE
from mergepipe.storage.writers import written_info

UNLIMITED_SHARD = 1 << 62  # in memory the output is one buffer


@dataclass
class MemoryMerge:
    """A merged model in memory and what producing it cost."""

    tensors: dict  # name -> torch tensor (views of the output buffer; clone to keep one past the merge)
    expert_read: int  # expert bytes read (checked against the plan)
    base_read: int
    seconds: float
    plan_id: str


class MemoryShard:
    """An output shard written in order into a buffer (the header first, as a file would hold it)."""

    def __init__(self, shard):
        self.shard = shard
        self.buf = bytearray(shard.size)
        self.pos = 0
        self.write(0, shard.header)

    def write(self, offset: int, data) -> None:
        if offset != self.pos:
            raise ExecutionError(f"{self.shard.fname}: out-of-order write at {offset} (expected {self.pos})")
        view = memoryview(data).cast("B")
        self.buf[offset:offset + len(view)] = view
        self.pos += len(view)

    def close(self) -> dict:
        if self.pos != self.shard.size:
            raise ExecutionError(f"{self.shard.fname}: wrote {self.pos} of {self.shard.size} bytes")
        return {"bytes": self.shard.size}


class MemoryPipeline(MergePipeline):
    """The merge pipeline with in-memory shards; :meth:`finish` returns the tensors."""

    def open_writers(self) -> dict:
        return {s.fname: MemoryShard(s) for s in self.shards}

    def finish(self) -> dict:
        for writer in self.writers.values():
            writer.close()
        realized = {e["id"]: r.bytes_read for e, r in zip(self.experts, self.readers)}
        check_realized(self.plan, realized, self.compact.bytes_read())
        return {"tensors": self._tensors(), "realized_by_expert": realized, "base_read": self.input_bytes_read()}

    def _tensors(self) -> dict:
        import torch

        from mergepipe.storage.dtypes import torch_dtype_of as torch_dtype
        out = {}
        for info in (written_info(t, self.out_dtype) for t in self.order):
            writer = self.writers[self.shard_of[info.name].fname]
            offset = self.shard_of[info.name].offsets[info.name]
            count = info.nbytes // ITEMSIZE[info.dtype]
            flat = torch.frombuffer(writer.buf, dtype=torch_dtype(info.dtype), count=count, offset=offset) \
                if count else torch.empty(0, dtype=torch_dtype(info.dtype))
            out[info.name] = flat.reshape(info.shape)
        return out


def merge_in_memory(catalog: Catalog, plan: Plan, engine=None) -> MemoryMerge:
    """Execute ``plan`` into memory (see the module docstring). Refused for plans that change more than
    tensors (an incremental merge, a tokenizer change or a ``slices:`` layout: their files matter)."""
    if plan.is_extend:
        raise ExecutionError("an incremental merge cannot run in memory")
    if plan.layout is not None or plan.vocab:
        raise ExecutionError("a merge that changes the layout or the tokenizer cannot run in memory "
                             "(its config and tokenizer files are part of the result)")
    if engine is None:
        from mergepipe.engine.engine import Engine
        engine = Engine(catalog)
    for inp in plan.inputs():
        row = catalog.model(inp["id"])
        if row["fingerprint"] != inp["fingerprint"]:
            raise ExecutionError(f"{inp['id']} was re-registered since plan {plan.id} was made; plan again")
        check_unchanged(row)
    t0 = time.perf_counter()
    result = MemoryPipeline(engine, plan, Path("."), UNLIMITED_SHARD, None).run()
    return MemoryMerge(result["tensors"], sum(result["realized_by_expert"].values()), result["base_read"],
                       time.perf_counter() - t0, plan.id)
