"""The safetensors format: dtype tables, header parsing and validation, checkpoint layouts (a file or a
sharded Hugging Face directory), row geometry and bytes -> tensor.

Headers are parsed by hand (8-byte little-endian length + JSON) so that registering a checkpoint reads
no tensor bytes. Reading tensor data is the storage backend's job (mergepipe.storage.local).

Parsing headers and configs uses the standard library only; torch is imported on first use of a
tensor (``bytes_to_tensor``, ``TensorInfo.torch_dtype``, ``DTYPES``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.errors import StorageError
from mergepipe.storage.paths import open_regular, read_regular

if TYPE_CHECKING:
    import torch

    from mergepipe.storage.base import Reader, Storage

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, shard indexes, adapter configs
INDEX_NAME = "model.safetensors.index.json"

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


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live. ``offset`` is absolute within ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype_of(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Checkpoint:
    """A parsed checkpoint: a single safetensors file or a (sharded) Hugging Face directory."""

    root: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    file_sizes: dict[str, int]
    config: dict = field(default_factory=dict)
    # the Storage it was opened with (mergepipe.storage.registry); it reads and fingerprints the files
    storage: Storage | None = field(default=None, repr=False, compare=False)

    def reader(self, sequential: bool = False) -> Reader:
        """Exact range reads of this checkpoint's files, through the storage it was opened with."""
        return self._storage().reader(self, sequential)

    def fingerprint(self) -> str:
        return self._storage().fingerprint(self)

    def _storage(self) -> Storage:
        if self.storage is None:
            raise StorageError(f"{self.root}: opened without a storage backend (use mergepipe.storage.registry)")
        return self.storage

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def path_of(self, info: TensorInfo) -> Path:
        return self.root / info.file if self.root.is_dir() else self.root

    def headers_digest_source(self) -> bytes:
        """Canonical bytes describing the layout: names, dtypes, shapes, offsets and file sizes."""
        rows = [
            [t.name, t.dtype, list(t.shape), t.file, t.offset, t.nbytes]
            for t in sorted(self.tensors.values(), key=lambda t: t.name)
        ]
        return json.dumps({"tensors": rows, "files": self.file_sizes}, sort_keys=True).encode()


def parse_header(path: Path, display_name: str | None = None) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; read nothing past it."""
    path = Path(path)
    label = display_name or path.name
    try:
        size = path.stat().st_size
        # pread on a descriptor advised RANDOM: a buffered read would let kernel read-ahead pull in
        # tensor bytes after the header (measured: ~16 KiB per file on a cold cache).
        fd = open_regular(path)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            raw_len = os.pread(fd, 8, 0)
            if len(raw_len) < 8:
                raise StorageError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            header_len = int.from_bytes(raw_len, "little")
            if header_len > MAX_HEADER_BYTES:
                raise StorageError(
                    f"{path}: not a safetensors file (header length {header_len} exceeds the "
                    f"{MAX_HEADER_BYTES}-byte limit)"
                )
            if 8 + header_len > size:
                raise StorageError(
                    f"{path}: header length {header_len} runs past the end of the file ({size} bytes); "
                    "the file is truncated or not a safetensors file"
                )
            raw = os.pread(fd, header_len, 8)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StorageError(f"{path}: not a safetensors file (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise StorageError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + header_len
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _validate_entry(path, name, entry, data_start, data_len, label)
    _check_overlaps(path, tensors, data_start)
    return tensors


def _validate_entry(path, name, entry, data_start, data_len, label) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise StorageError(f"{path}: tensor {name!r} has a malformed header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ITEMSIZE:
        raise StorageError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise StorageError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise StorageError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise StorageError(
            f"{path}: tensor {name!r} data_offsets [{begin}, {end}] lie outside the file's "
            f"{data_len} data bytes (truncated file?)"
        )
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != expected:
        raise StorageError(
            f"{path}: tensor {name!r} has {end - begin} bytes but shape {shape} x {dtype} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), label, data_start + begin, end - begin)


def _check_overlaps(path: Path, tensors: dict[str, TensorInfo], data_start: int) -> None:
    ordered = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.offset < prev.offset + prev.nbytes:
            raise StorageError(f"{path}: tensors {prev.name!r} and {cur.name!r} have overlapping data_offsets")


def open_checkpoint(uri: str | os.PathLike) -> Checkpoint:
    """Parse a checkpoint's headers (and config.json) without reading tensor data."""
    root = Path(uri).expanduser()
    if not root.exists():
        raise StorageError(f"{root}: no such file or directory")
    if root.is_file():
        tensors = parse_header(root)
        files = [root]
        config = {}
    else:
        files = _shard_files(root)
        tensors = {}
        for f in files:
            for name, info in parse_header(f, f.name).items():
                if name in tensors:
                    raise StorageError(f"{root}: tensor {name!r} appears in more than one shard")
                tensors[name] = info
        _check_index(root, tensors)
        config = read_json_object(root / "config.json") if (root / "config.json").exists() else {}
    if not tensors:
        raise StorageError(f"{root}: checkpoint holds no tensors")
    sizes = {(f.name if root.is_dir() else f.name): f.stat().st_size for f in files}
    return Checkpoint(root, files, tensors, sizes, config)


def _shard_files(root: Path) -> list[Path]:
    index = root / INDEX_NAME
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise StorageError(f"{index}: no weight_map")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise StorageError(f"{root}: shard(s) named in {INDEX_NAME} are missing: {', '.join(missing)}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise StorageError(f"{root}: no .safetensors files in this directory")
    return files


def _check_index(root: Path, tensors: dict[str, TensorInfo]) -> None:
    index = root / INDEX_NAME
    if not index.exists():
        return
    weight_map = read_json_object(index)["weight_map"]
    for name, fname in weight_map.items():
        if name not in tensors:
            raise StorageError(f"{index}: tensor {name!r} is listed but not present in {fname}")
        if tensors[name].file != fname:
            raise StorageError(f"{index}: tensor {name!r} is listed in {fname} but found in {tensors[name].file}")


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; one clear error otherwise."""
    try:
        data = json.loads(read_regular(path, MAX_JSON_BYTES))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StorageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise StorageError(f"{path}: expected a JSON object")
    return data


def row_nbytes(info: TensorInfo) -> int:
    """Bytes of one row of dim 0 (one element for 0-D and 1-D tensors)."""
    return math.prod(info.shape[1:]) * info.itemsize if len(info.shape) >= 2 else info.itemsize


def n_rows(info: TensorInfo) -> int:
    if len(info.shape) == 0:
        return 1
    return info.shape[0] if len(info.shape) >= 2 else info.shape[0]


def rows_shape(info: TensorInfo, rows: int) -> tuple[int, ...]:
    if len(info.shape) == 0:
        return ()
    return (rows, *info.shape[1:])


def bytes_to_tensor(buf, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    tdtype = torch_dtype_of(dtype)
    if len(buf) == 0:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(buf, dtype=tdtype).reshape(shape)
