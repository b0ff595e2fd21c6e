"""A checkpoint's dtypes as people know them: float tensors (what a merge merges) and non-float
buffers (``position_ids``, ``token_type_ids``, step counters, boolean masks: copied from the base as
they are, never merged, never read for an expert).

A pretrained BERT holds fp32 weights and an int64 ``position_ids`` buffer: its dtype is shown as
``F32 (+I64 buffers)``, and ``dtype``/``out_dtype`` in a config apply to its float tensors only.

Also the safetensors dtype tables (item sizes, float codes, torch dtypes built on first use): a leaf
module, imported by :mod:`mergepipe.storage.base` and :mod:`mergepipe.storage.safetensors`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# safetensors dtype code -> item size in bytes. Header parsing needs nothing else, so registering a
# checkpoint never imports torch (an import of ~1-3 s; see the module's __getattr__ for DTYPES).
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# safetensors dtype code -> name of the torch dtype
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


TORCH_NAMES = _TORCH_NAMES  # the public name of the table (a config.json's torch_dtype)


def _torch_tables() -> dict:
    """DTYPES (code -> (torch dtype, item size)) and TORCH_TO_CODE, built on first use."""
    import torch

    dtypes = {code: (getattr(torch, name), ITEMSIZE[code]) for code, name in _TORCH_NAMES.items()}
    return {"DTYPES": dtypes, "TORCH_TO_CODE": {v[0]: k for k, v in dtypes.items()}}


def __getattr__(name: str):
    # PEP 562: ``DTYPES`` and ``TORCH_TO_CODE`` hold torch dtypes, so they are made (and torch
    # imported) only when some module asks for them; they are then cached as ordinary globals.
    if name in ("DTYPES", "TORCH_TO_CODE"):
        tables = _torch_tables()
        globals().update(tables)
        return tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_dtype_of(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (imports torch on first use)."""
    dtypes = globals().get("DTYPES") or __getattr__("DTYPES")
    return dtypes[code][0]


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
