"""torch's intra-op threads, limited per thread only where torch is used, and torch's version without
importing it.

A merge of bf16/fp32 safetensors with a task-vector operator runs the fused numba kernels and never
imports torch (an import of ~1.5 s of CPU). The torch path (other operators, dtypes or formats) still
runs each block with ``threads`` intra-op threads (1 by default: OpenMP spin-waits collapse when the
cores are shared, and a reduction's result depends on the thread count), so every thread that runs
merges says how many it wants (:func:`want`) and every torch entry point of the engine takes torch from
:func:`torch_module`, which applies that number in the calling thread before the first torch operation.
"""

from __future__ import annotations

import os
import re
import sys
import threading

_local = threading.local()


def want(threads: int) -> None:
    """This thread runs merges with ``threads`` torch threads: applied now if torch is loaded, else at
    the thread's first :func:`torch_module`."""
    _local.threads = threads
    _local.saved = None
    _local.applied = False
    torch = loaded()
    if torch is not None:
        _apply(torch)


def loaded():
    """torch when it is imported and initialised (not while another thread is importing it), else None."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def torch_module():
    """torch, with the calling thread's intra-op threads set to what it asked for (:func:`want`)."""
    import torch

    if getattr(_local, "threads", None) is not None and not _local.applied:
        _apply(torch)
    return torch


def _apply(torch) -> None:
    _local.saved = torch.get_num_threads()
    torch.set_num_threads(_local.threads)
    _local.applied = True


def release() -> None:
    """The thread is done merging: torch's thread count back to what it was (if torch was used)."""
    if getattr(_local, "applied", False):
        sys.modules["torch"].set_num_threads(_local.saved)
    _local.threads = None
    _local.applied = False


def torch_version() -> str | None:
    """torch's version as ``torch.__version__`` gives it, without importing torch when it is not loaded:
    the ``__version__`` line of the installed ``torch/version.py`` (what ``torch.__version__`` is made
    from), else the distribution's metadata. None when torch is not installed."""
    torch = loaded()
    if torch is not None:
        return str(torch.__version__)
    from importlib.util import find_spec

    spec = find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as f:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        found = None
    if found:
        return found.group(1)
    from importlib import metadata  # (an import of ~0.07 s: only where version.py says nothing)

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
