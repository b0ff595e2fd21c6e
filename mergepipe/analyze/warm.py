"""ANALYZE's start: the disk begins reading while the process pays its fixed costs.

A fresh ``mergepipe analyze`` spends ~0.4 s of CPU in numba's first dispatch (its target and typing
contexts; the kernels themselves come from numba's on-disk cache) and more in opening the catalog and the
thread pool before the first block is read: on a small family that is as long as the whole cold read. So
before the pass starts, the first bytes of the pass (whole tensors in the order the tasks take them, base
and experts, up to ``START_BYTES``) are asked for with ``POSIX_FADV_WILLNEED``: asynchronous reads the
kernel does meanwhile. Nothing is counted until read; the pages are read once either way.
"""

from __future__ import annotations

from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import FLOAT_DTYPES

START_BYTES = 1 << 30  # asked for ahead, over all inputs (page cache; evictable)


def prefetch_start(jobs, budget: int = START_BYTES) -> int:
    """Ask for the first ``budget`` bytes the pass over ``jobs`` will read, in its order; the bytes asked for."""
    by_base: dict[str, list] = {}
    for job in jobs:
        by_base.setdefault(job.base["id"], []).append(job)
    asked = 0
    for group in by_base.values():
        for binfo in group[0].tensor_order():
            if asked >= budget:
                return asked
            if binfo.dtype not in FLOAT_DTYPES:  # not read by the pass
                continue
            whole = tensor_grid(binfo, 1 << 62)[0]
            if any(j.source.needs_base and j.source.has_delta(binfo.name, binfo.shape) for j in group):
                group[0].rb.prefetch(binfo.file, binfo.offset, binfo.nbytes)
                asked += binfo.nbytes
            for job in group:
                if job.source.kind != "lora" and job.source.has_delta(binfo.name, binfo.shape):
                    (rng,) = job.source.block_ranges(binfo.name, whole)
                    job.re.prefetch(*rng)
                    asked += rng[2]
    return asked
