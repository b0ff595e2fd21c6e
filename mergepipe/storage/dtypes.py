"""A checkpoint's dtypes as people know them: float tensors (what a merge merges) and non-float
buffers (``position_ids``, ``token_type_ids``, step counters, boolean masks: copied from the base as
they are, never merged, never read for an expert).

A pretrained BERT holds fp32 weights and an int64 ``position_ids`` buffer: its dtype is shown as
``F32 (+I64 buffers)``, and ``dtype``/``out_dtype`` in a config apply to its float tensors only."""

from __future__ import annotations

from collections.abc import Iterable

from mergepipe.storage.safetensors import FLOAT_DTYPES


def split_dtypes(codes: Iterable[str]) -> tuple[list[str], list[str]]:
    """(float dtypes, non-float dtypes), each sorted and without repeats."""
    codes = set(codes)
    return sorted(codes & FLOAT_DTYPES), sorted(codes - FLOAT_DTYPES)


def float_dtype(codes: Iterable[str]) -> str | None:
    """The one float dtype of a checkpoint's tensors (None when it has none or several)."""
    floats, _ = split_dtypes(codes)
    return floats[0] if len(floats) == 1 else None


def dtype_label(codes: Iterable[str]) -> str:
    """``F32``, ``F32 (+I64 buffers)``, ``mixed:BF16,F32 (+I64 buffers)``, ``I64`` (no float tensor)."""
    floats, others = split_dtypes(codes)
    if not floats:
        return others[0] if len(others) == 1 else "mixed:" + ",".join(others)
    head = floats[0] if len(floats) == 1 else "mixed:" + ",".join(floats)
    return head + (f" (+{','.join(others)} buffers)" if others else "")


def label_float_dtype(label: str | None) -> str | None:
    """The float dtype a :func:`dtype_label` (or an older ``mixed:...`` label) names, when only one."""
    if not label:
        return None
    head = label.split(" (+", 1)[0]
    if head.startswith("mixed:"):
        return float_dtype(head[len("mixed:"):].split(","))
    return head if head in FLOAT_DTYPES else None
