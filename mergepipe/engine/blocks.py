"""Merging one block: the fused numba kernels where they apply, else the torch path of the operators
(sparsify each contributing expert's delta, then combine). Both give bit-identical bytes.

Every merged block is checked for NaN/Inf in its final bytes (after the rounding to the output dtype, the
base's unless the plan converts, so a finite float32 value that overflows bf16 or fp16 is caught as well): one fails the merge with an
ExecutionError naming the tensor and block, and nothing is published. Blocks copied from the base
unmerged are not checked (a merge never adds what its inputs did not have there), unless they are converted
to another dtype (a bf16 value beyond fp16's range).
"""

from __future__ import annotations

import math

from mergepipe.engine.threads import torch_module
from mergepipe.errors import ExecutionError
from mergepipe.ops.core import combine, sparsify
from mergepipe.ops.streams import block_seed, content_id
from mergepipe.planner.settings import expert_params, tensor_density, tensor_weight
from mergepipe.storage.compact import CompactBlock
from mergepipe.storage.dtypes import torch_dtype_of
from mergepipe.storage.safetensors import bytes_to_tensor, rows_shape


def tensor_bytes(t) -> memoryview:
    """The raw bytes of a torch tensor (the torch path; torch is loaded when there is one)."""
    torch = torch_module()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def as_bytes(t, code: str) -> memoryview:
    """The raw bytes of torch tensor ``t`` converted to safetensors dtype ``code`` (torch's rounding)."""
    return tensor_bytes(t.to(torch_dtype_of(code)))


def merge_block(fused, op, params, seed, experts, sources, weight_sum, info, span, raw, contributors, thresholds,
                method=None, soup=None, out_dtype=None):
    """The merged bytes of one block (``raw``: its base bytes; ``contributors``: (expert index, buffers)),
    refused when they hold NaN or Inf. ``method``: the tensor's scalars of an interpolation method;
    ``soup``: a model soup's (weights in config order, the base's position); ``out_dtype``: the dtype the
    float32 result is rounded to (None: the base tensor's, ``info.dtype``)."""
    out = out_dtype or info.dtype
    if soup is not None:
        data = soup_block(params, sources, info, span, raw, contributors, len(experts), *soup, out=out)
    elif op.nonlinear:
        data = method_block(op, params, sources, info, span, raw, contributors, method, len(experts), out=out)
    else:
        data = _merged_bytes(fused, op, params, seed, experts, sources, weight_sum, info, span, raw, contributors,
                             thresholds, out)
    check_finite(data, info, span, out)
    return data


def converted_block(info, span, raw, out_dtype: str):
    """A block copied from the base, in the output dtype (torch's rounding, as mergekit's ``.to``, by
    numpy: storage/convert.py), refused when the conversion overflows it (a bf16 value beyond fp16's range)."""
    from mergepipe.storage.convert import convert
    data = memoryview(convert(raw, info.dtype, out_dtype))
    check_finite(data, info, span, out_dtype)
    return data


def check_finite(data, info, span, out_dtype=None) -> None:
    """Raise ExecutionError when a merged block's bytes (in ``out_dtype``, default the tensor's) hold NaN or Inf."""
    from mergepipe.ops import kernels
    code = out_dtype or info.dtype
    if not kernels.nonfinite_count(data, code):
        return
    nan, inf, largest = kernels.nonfinite_kinds(data, code)
    dtype = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}.get(code, code.lower())
    why = (f"merged values beyond the largest {dtype} number ({largest:.6g}) overflow to Inf: lower the weights "
           f"or lambda, or merge into a wider dtype" if inf and not nan else
           "an input or a parameter made them (check the experts' and the base's values, the weights and lambda)")
    raise ExecutionError(f"the merge of tensor {info.name} (block {span.index}) gives {nan + inf} non-finite "
                         f"values ({nan} NaN, {inf} Inf) in {dtype}; {why}; nothing was published")


def _merged_bytes(fused, op, params, seed, experts, sources, weight_sum, info, span, raw, contributors, thresholds,
                  out):
    shape = rows_shape(info, span.row_end - span.row_start)
    if fused:
        data = fused_block(op, params, seed, experts, sources, weight_sum, info, span, shape, raw,
                           contributors, thresholds, out)
        if data is not None:
            return data
    torch = torch_module()  # the torch path, with this thread's intra-op threads (engine/threads.py)
    base = bytes_to_tensor(raw, info.dtype, shape).float()
    deltas = []
    for ei, (bufs, fixed) in contributors:
        e = experts[ei]
        if isinstance(bufs, CompactBlock):  # the compact tier: the record's decoded delta stands for the block's
            delta = torch.from_numpy(decoded(bufs)).reshape(shape)
        else:
            delta = sources[ei].delta(info.name, span, bufs, fixed, base).reshape(shape)
        thr = thresholds.get(e["id"], {}).get(info.name, [])
        density = tensor_density(e, info.name) or 1.0
        bseed = block_seed(seed, block_content(bufs), info.name, span.index) if op.random and density < 1.0 else 0
        d = sparsify(op, delta, density, expert_params(params, e, info.name), thr, bseed, span.index)
        deltas.append((tensor_weight(e, info.name), d))
    merged = combine(op, base, deltas, weight_sum, params)
    return as_bytes(merged, out)


def soup_block(params, sources, info, span, raw, contributors, n_experts, weights, position, out=None):
    """One block of a model soup: mergekit's linear over the base and every expert's values (an expert not
    read for this block is the base's values there: its delta is omitted, as in any additive merge)."""
    from mergepipe.ops.linear import soup_block as kernel
    shape, base, xs = _values(sources, info, span, raw, contributors, n_experts)
    return as_bytes(kernel(base, xs, weights, position, params).reshape(shape), out or info.dtype)


def _values(sources, info, span, raw, contributors, n_experts):
    """(block shape, the base's values, every expert's values) in float32 (torch tensors)."""
    torch_module()  # the torch path, with this thread's intra-op threads (engine/threads.py)
    shape = rows_shape(info, span.row_end - span.row_start)
    base = bytes_to_tensor(raw, info.dtype, shape).float()
    xs = [base] * n_experts
    for ei, (bufs, fixed) in contributors:
        src = sources[ei]
        if getattr(src, "kind", None) == "full" and len(bufs) == 1:
            xinfo = src.checkpoint.tensors[info.name]
            xs[ei] = bytes_to_tensor(bufs[0], xinfo.dtype, shape).float()
        else:
            xs[ei] = base + src.delta(info.name, span, bufs, fixed, base).reshape(shape)
    return shape, base, xs


def method_block(op, params, sources, info, span, raw, contributors, scalars, n_experts, out=None):
    """One block of an interpolation method (ops/interp.py): every expert's values in float32 (a full
    checkpoint's own values; else base + delta; an expert not read for this block changed nothing here,
    so its values are the base's), then the method's block kernel with the tensor's scalars."""
    from mergepipe.ops.core import METHODS
    shape, base, xs = _values(sources, info, span, raw, contributors, n_experts)
    # the block's index in the tensor's grid: sce's exact-k cut among tied entries is by block (ops/topk.py)
    merged = METHODS[op.name][1](op, base, xs, scalars, {**params, "block_index": span.index}, len(info.shape))
    return as_bytes(merged.reshape(shape), out or info.dtype)


def fused_block(op, params, seed, experts, sources, weight_sum, info, span, shape, raw, contributors, thresholds,
                out=None):
    """The fused kernel (kernels.fused_merge) for full or delta checkpoints with linear, task
    arithmetic, TIES, DARE, breadcrumbs or DELLA; None where it does not apply (LoRA, other operators,
    fp16/fp64 in or out)."""
    from mergepipe.ops import kernels
    if op.sparsify not in kernels.FUSED_SPARSIFY or info.dtype not in kernels.CODES or \
            (out or info.dtype) not in kernels.CODES:
        return None
    contributions = []
    for ei, (bufs, _fixed) in contributors:
        src = sources[ei]
        compact = isinstance(bufs, CompactBlock)
        if not compact and (getattr(src, "kind", None) not in ("full", "delta") or len(bufs) != 1):
            return None
        e = experts[ei]
        density = tensor_density(e, info.name) or 1.0
        bseed = block_seed(seed, block_content(bufs), info.name, span.index) if op.random and density < 1.0 else 0
        data, dtype, is_delta = ((memoryview(decoded(bufs)).cast("B"), "F32", True) if compact else
                                 (bufs[0], src.checkpoint.tensors[info.name].dtype, src.kind == "delta"))
        contributions.append((data, dtype, is_delta, tensor_weight(e, info.name), density,
                              thresholds.get(e["id"], {}).get(info.name, []), bseed,
                              expert_params(params, e, info.name)))
    n = math.prod(shape)
    row = math.prod(shape[1:]) if len(shape) >= 2 else n  # DELLA ranks within rows (ops/della.py)
    data = kernels.fused_merge(op, params, raw, info.dtype, n, contributions, weight_sum, span.index, out_dtype=out,
                               row=max(1, row))
    return None if data is None else memoryview(data)


def decoded(block: CompactBlock):
    """A compact record's float32 delta, by the compiled decoder (the same values as storage/compact.decode)."""
    from mergepipe.analyze.compact import decode_block
    return decode_block(block.record, block.n, block.group, block.level)


def block_content(bufs) -> str:
    """The content id of an expert block's input (ops/streams.py): its raw buffers, or its compact record."""
    return content_id([bufs.record]) if isinstance(bufs, CompactBlock) else content_id(bufs)


def warm_kernels() -> None:
    from mergepipe.ops import kernels
    kernels.warm_up()

