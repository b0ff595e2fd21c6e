"""Where an expert's delta comes from: a full checkpoint, a delta checkpoint or a PEFT LoRA adapter.

Analyze and the engine see every expert through one interface: for a block of a base tensor (rows
[r0, r1) of the base's grid), which byte ranges of the expert's files to read, which bytes to read
once per tensor (LoRA's A), and how to turn those bytes into the float32 delta of the block.

- ``full``: rows [r0, r1) of the expert's tensor; delta = expert - base (the base block is needed).
- ``delta``: rows [r0, r1) of the stored delta, in its own float dtype; the base is not needed.
- ``lora``: rows [r0, r1) of B plus all of A (read once per tensor); delta = scale * B[r0:r1] @ A.
  Tensors the adapter does not target have delta = 0 and are never read.
"""

from __future__ import annotations

from mergepipe.storage.grid import BlockSpan
from mergepipe.storage.lora import LoraAdapter
from mergepipe.storage.registry import open_adapter, open_checkpoint
from mergepipe.storage.safetensors import Checkpoint, TensorInfo, bytes_to_tensor, row_nbytes, rows_shape

Range = tuple[str, int, int]  # (file, absolute offset, nbytes)


def _rows_range(info: TensorInfo, span: BlockSpan) -> Range:
    rb = row_nbytes(info)
    return (info.file, info.offset + span.row_start * rb, (span.row_end - span.row_start) * rb)


class CheckpointSource:
    """A full or delta checkpoint with the base's names and shapes."""

    def __init__(self, kind: str, checkpoint: Checkpoint):
        self.kind = kind
        self.checkpoint = checkpoint
        self.needs_base = kind == "full"

    def has_delta(self, name: str, shape=None) -> bool:
        """Whether it holds ``name`` (of ``shape`` when given: an expert whose embedding rows differ from
        its base's, another vocabulary, has no block-wise delta there)."""
        info = self.checkpoint.tensors.get(name)
        return info is not None and (shape is None or tuple(info.shape) == tuple(shape))

    def block_ranges(self, name: str, span: BlockSpan) -> list[Range]:
        return [_rows_range(self.checkpoint.tensors[name], span)]

    def fixed_ranges(self, name: str) -> list[Range]:
        return []

    def delta(self, name: str, span: BlockSpan, bufs, fixed, base: torch.Tensor | None) -> torch.Tensor:
        """float32 delta of one block; ``base`` is the base block as float32 (full checkpoints only)."""
        info = self.checkpoint.tensors[name]
        x = bytes_to_tensor(bufs[0], info.dtype, rows_shape(info, span.row_end - span.row_start))
        if self.kind == "delta":
            return x.float()
        return x.sub(base)  # promotes to float32 in one pass


class LoraSource:
    """A PEFT LoRA adapter: delta rows are scale * B[rows] @ A."""

    kind = "lora"
    needs_base = False

    def __init__(self, adapter: LoraAdapter):
        self.adapter = adapter
        self.checkpoint = adapter.checkpoint

    def has_delta(self, name: str, shape=None) -> bool:
        return name in self.adapter.pairs

    def block_ranges(self, name: str, span: BlockSpan) -> list[Range]:
        return [_rows_range(self.adapter.pairs[name].b, span)]

    def fixed_ranges(self, name: str) -> list[Range]:
        a = self.adapter.pairs[name].a
        return [(a.file, a.offset, a.nbytes)]

    def delta(self, name: str, span: BlockSpan, bufs, fixed, base: torch.Tensor | None) -> torch.Tensor:
        pair = self.adapter.pairs[name]
        b = bytes_to_tensor(bufs[0], pair.b.dtype, (span.row_end - span.row_start, pair.rank))
        a = bytes_to_tensor(fixed[0], pair.a.dtype, tuple(pair.a.shape))
        # PEFT: (B @ A) * scaling, in the adapter's dtype; here in float32 (exact for fp32 adapters)
        return (b.float() @ a.float()) * pair.scale


def open_source(kind: str, uri: str):
    if kind == "lora":
        return LoraSource(open_adapter(uri))
    return CheckpointSource(kind, open_checkpoint(uri))


def fixed_bytes(source, name: str) -> int:
    """Bytes read once per tensor whenever any block of it is read (LoRA's A)."""
    return sum(n for _, _, n in source.fixed_ranges(name)) if source.has_delta(name) else 0
