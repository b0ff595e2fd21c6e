"""Warm-up reads: the first bytes a plan reads, asked of the kernel while the engine is still loading.

Importing the engine (numba; torch where an operator needs it) takes CPU time during which the disk is idle. Once a plan is
known, its first reads are known too: :func:`start_warm_up` hands the leading ``limit`` bytes of them,
in the order the engine reads them, to the kernel (``POSIX_FADV_WILLNEED``: asynchronous reads of exactly
those ranges, rounded to pages) on a background thread, so the engine's exact reads find them in the page
cache. Nothing outside the plan is read. Local files only; other plans (remote inputs, LoRA sources,
``slices:`` layouts, re-ordered vocabularies) are left alone. This module must not import torch (it runs before the engine loads).
"""

from __future__ import annotations

import os
import threading

from mergepipe.planner.plan import expand_ranges
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.registry import open_checkpoint, scheme_of

DEFAULT_LIMIT = 1 << 30


def start_warm_up(plan, limit: int | None = None) -> threading.Thread | None:
    """Ask the kernel for the plan's first ``limit`` bytes (default: 1 GiB, at most a quarter of the
    available memory) on a daemon thread; returns it, or None when the plan is not one it warms."""
    try:
        ranges = first_ranges(plan, limit if limit is not None else default_limit())
    except Exception:  # a warm-up is a hint: the engine reports any real problem with the inputs
        return None
    if not ranges:
        return None
    thread = threading.Thread(target=_advise, args=(ranges,), name="mergepipe-warm-up", daemon=True)
    thread.start()
    return thread


def default_limit() -> int:
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 256 << 20
    return min(DEFAULT_LIMIT, avail // 4)


def first_ranges(plan, limit: int) -> list[tuple[str, int, int]]:
    """(path, offset, nbytes) of the plan's reads in the engine's order, until ``limit`` bytes."""
    if plan.layout is not None or plan.vocab or limit <= 0:
        return []  # other models' tensors, or re-ordered embedding rows read whole: the engine's own order
    inputs = [plan.base, *plan.experts, plan.parent or {}, plan.changed or {}]
    if any(scheme_of(i["uri"]) is not None for i in inputs if i.get("uri")) or \
            any(i.get("kind") == "lora" for i in inputs):
        return []
    base = open_checkpoint(plan.base["uri"])
    block_bytes = plan.block_bytes
    if plan.parent:
        per_tensor = _extend_reads(plan, base)
    else:
        per_tensor = _merge_reads(plan, base)
    out, total = [], 0
    for info in sorted(base.tensors.values(), key=lambda t: (t.file, t.offset)):
        for path, off, n in per_tensor(info, tensor_grid(info, block_bytes)):
            out.append((path, off, n))
            total += n
        if total >= limit:
            break
    return out


def _blocks(ck, name, spans, chosen) -> list[tuple[str, int, int]]:
    info = ck.tensors.get(name)
    if info is None:
        return []
    path = str(ck.path_of(info))
    return [(path, info.offset + s.rel_offset, s.nbytes) for s in spans if s.index in chosen]


def _extend_reads(plan, base):
    """An incremental merge: the parent snapshot's tensor, then the base and expert blocks it needs."""
    snap = open_checkpoint(plan.parent["uri"])
    expert = open_checkpoint(plan.changed["uri"])
    reads = plan.reads

    def per_tensor(info, spans):
        s = snap.tensors.get(info.name)
        whole = [(str(snap.path_of(s)), s.offset, s.nbytes)] if s is not None else []
        return (whole + _blocks(base, info.name, spans, set(expand_ranges(reads["base"].get(info.name, []))))
                + _blocks(expert, info.name, spans, set(expand_ranges(reads["expert"].get(info.name, [])))))
    return per_tensor


def _merge_reads(plan, base):
    """A merge: the base's tensor, then each expert's selected blocks of it."""
    experts = [(open_checkpoint(e["uri"]), plan.access_for(e["id"])) for e in plan.experts]

    def per_tensor(info, spans):
        out = [(str(base.path_of(info)), info.offset, info.nbytes)]
        for ck, access in experts:
            out += _blocks(ck, info.name, spans, set(expand_ranges(access.get(info.name, []))))
        return out
    return per_tensor


def _advise(ranges: list[tuple[str, int, int]]) -> None:
    fds: dict[str, int] = {}
    try:
        for path, off, n in ranges:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # a hint only
    finally:
        for fd in fds.values():
            os.close(fd)
