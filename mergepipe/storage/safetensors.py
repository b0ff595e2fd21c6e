"""The safetensors format: header parsing and validation, checkpoint layouts (a file or a sharded Hugging
Face directory), row geometry and bytes -> tensor. The dtype tables live in :mod:`mergepipe.storage.dtypes`
and the layout types (``TensorInfo``, ``Checkpoint``) in :mod:`mergepipe.storage.base`; both are
re-exported here, as is ``DTYPES``/``TORCH_TO_CODE`` (built on first use). The strict JSON reading and the
kind-only descriptions of values that errors use live in :mod:`mergepipe.storage.json_checks`.

Headers are parsed by hand (8-byte little-endian length + JSON) so that registering a checkpoint reads
no tensor bytes. Reading tensor data is the storage backend's job (mergepipe.storage.local).

Parsing headers and configs uses the standard library only; torch is imported on first use of a
tensor (``bytes_to_tensor``, ``TensorInfo.torch_dtype``, ``DTYPES``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.errors import StorageError
from mergepipe.storage import dtypes as _dtypes
from mergepipe.storage.base import Checkpoint, TensorInfo  # noqa: F401 (re-exported)
from mergepipe.storage.dtypes import FLOAT_DTYPES, ITEMSIZE, torch_dtype_of  # noqa: F401 (re-exported)
from mergepipe.storage.json_checks import (  # under the private names the validators below use
    MAX_JSON_DEPTH, is_int as _is_int, is_text as _is_text, kind as _kind, loads as _loads, short as _short,
    too_deep as _too_deep,
)
from mergepipe.storage.paths import expand_path, open_regular, read_regular  # noqa: F401 (expand_path: re-exported)

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, shard indexes, adapter configs
INDEX_NAME = "model.safetensors.index.json"


def __getattr__(name: str):
    # ``DTYPES`` and ``TORCH_TO_CODE`` are built (and torch imported) on first use by
    # mergepipe.storage.dtypes; the same objects are then cached here as ordinary globals.
    if name in ("DTYPES", "TORCH_TO_CODE"):
        value = getattr(_dtypes, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_header(path: Path, display_name: str | None = None) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; read nothing past it.

    Follows the safetensors format: an 8-byte little-endian header length (at most
    ``MAX_HEADER_BYTES``), then a UTF-8 JSON object beginning with ``{`` (trailing spaces allowed),
    whose ``__metadata__`` maps strings to strings and whose other keys are unique tensor names, each
    with a known ``dtype``, a ``shape`` of non-negative integers and ``data_offsets`` [begin, end]
    within the data section and consistent with dtype x shape. Anything else is a StorageError that
    names the file and the field, never quoting the file's bytes."""
    path = Path(path)
    label = display_name or path.name
    try:
        # pread on a descriptor advised RANDOM: a buffered read would let kernel read-ahead pull in
        # tensor bytes after the header (measured: ~16 KiB per file on a cold cache).
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            header_len = header_length(path, os.pread(fd, 8, 0), size)
            raw = os.pread(fd, header_len, 8)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"{path}: cannot read ({exc.strerror})") from None
    if len(raw) != header_len:
        raise StorageError(f"{path}: header is shorter than its stated length (file changed while reading?)")
    return header_tensors(path, raw, size, label)


def header_length(path, first8: bytes, size: int) -> int:
    """The header length stated by a safetensors file's first 8 bytes, checked against the file size."""
    if len(first8) < 8:
        raise StorageError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    header_len = int.from_bytes(first8, "little")
    if header_len > MAX_HEADER_BYTES:
        raise StorageError(f"{path}: not a safetensors file (its header length exceeds the "
                           f"{MAX_HEADER_BYTES}-byte limit)")
    if 8 + header_len > size:
        raise StorageError(f"{path}: its header length runs past the end of the file ({size} bytes); "
                           "the file is truncated or not a safetensors file")
    return header_len


def header_tensors(path, raw: bytes, size: int, label: str) -> dict[str, TensorInfo]:
    """Validate a header's JSON bytes (read by any storage) against a file of ``size`` bytes."""
    header = _loads(raw, path, "not a safetensors file: header is ")
    if not isinstance(header, dict):
        raise StorageError(f"{path}: not a safetensors file (header is not a JSON object)")
    if not raw.startswith(b"{"):
        raise StorageError(f"{path}: not a safetensors file (header does not begin with '{{')")
    data_start = 8 + len(raw)
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(path, entry)
            continue
        tensors[name] = _validate_entry(path, name, entry, data_start, data_len, label)
    _check_overlaps(path, tensors, data_start)
    return tensors


# --- validation helpers: errors name the file and the field, and describe values by kind only -----------
_MAX_DIM = 2**63 - 1
_MAX_BYTES = 2**64


def _check_metadata(path, metadata) -> None:
    """``__metadata__``: a map of string to string (the format allows nothing else)."""
    if not isinstance(metadata, dict):
        raise StorageError(f"{path}: __metadata__ must be an object of strings (is {_kind(metadata)})")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise StorageError(f"{path}: __metadata__ value of {_short(key)} must be a string (is {_kind(value)})")


def _validate_entry(path, name, entry, data_start, data_len, label) -> TensorInfo:
    where = f"{path}: tensor {_short(name)}"
    if not _is_text(name):
        raise StorageError(f"{where}: the name is not valid text")
    if not isinstance(entry, dict):
        raise StorageError(f"{where}: malformed header entry ({_kind(entry)}, not an object)")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise StorageError(f"{where}: malformed header entry (no {', '.join(missing)})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise StorageError(f"{where}: dtype must be a string (is {_kind(dtype)})")
    if dtype not in ITEMSIZE:
        raise StorageError(f"{where}: unknown dtype {_short(dtype, 16)} (known: {', '.join(ITEMSIZE)})")
    if not isinstance(shape, list):
        raise StorageError(f"{where}: shape must be a list of non-negative integers (is {_kind(shape)})")
    for i, d in enumerate(shape):
        if not _is_int(d) or not 0 <= d <= _MAX_DIM:
            what = _kind(d) if not _is_int(d) else "negative" if d < 0 else "too large"
            raise StorageError(f"{where}: shape[{i}] must be a non-negative integer (is {what})")
    if not isinstance(offsets, list) or len(offsets) != 2:
        what = f"a list of {len(offsets)}" if isinstance(offsets, list) else _kind(offsets)
        raise StorageError(f"{where}: data_offsets must be a list [begin, end] of two integers (is {what})")
    for i, o in enumerate(offsets):
        if not _is_int(o):
            raise StorageError(f"{where}: data_offsets[{i}] must be an integer (is {_kind(o)})")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        shown = f"[{begin}, {end}]" if max(abs(begin), abs(end)) < 10**20 else "(huge numbers)"
        raise StorageError(
            f"{where}: data_offsets {shown} lie outside the file's {data_len} data bytes "
            f"(truncated file?)" if 0 <= begin <= end else
            f"{where}: data_offsets {shown} must satisfy 0 <= begin <= end"
        )
    # dtype x shape, stopping past 2^64 bytes (a product of millions of huge dimensions would take
    # minutes); a zero dimension makes the tensor empty whatever the others are.
    expected = 0 if 0 in shape else ITEMSIZE[dtype]
    for d in shape if expected else ():
        expected *= d
        if expected > _MAX_BYTES:
            break
    if end - begin != expected:
        shown = list(shape) if len(shape) <= 8 else f"of {len(shape)} dimensions"
        needs = expected if expected <= _MAX_BYTES else "more than 2^64"
        raise StorageError(f"{where}: data_offsets span {end - begin} bytes but shape {shown} x {dtype} needs {needs}")
    return TensorInfo(name, dtype, tuple(shape), label, data_start + begin, end - begin)


def _check_overlaps(path: Path, tensors: dict[str, TensorInfo], data_start: int) -> None:
    ordered = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.offset < prev.offset + prev.nbytes:
            raise StorageError(f"{path}: tensors {_short(prev.name)} and {_short(cur.name)} have overlapping "
                               f"data_offsets")


def open_checkpoint(uri: str | os.PathLike) -> Checkpoint:
    """Parse a checkpoint's headers (and config.json) without reading tensor data."""
    root = expand_path(uri)
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
                    raise StorageError(f"{root}: tensor {_short(name)} appears in more than one shard")
                tensors[name] = info
        _check_index(root, tensors)
        config = read_config(root / "config.json") if (root / "config.json").exists() else {}
    if not tensors:
        raise StorageError(f"{root}: checkpoint holds no tensors")
    sizes = {(f.name if root.is_dir() else f.name): f.stat().st_size for f in files}
    return Checkpoint(root, files, tensors, sizes, config)


def _shard_files(root: Path) -> list[Path]:
    index = root / INDEX_NAME
    if index.exists():
        names = sorted(set(read_index(index).values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            shown = ", ".join(_short(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise StorageError(f"{root}: shard(s) named in {INDEX_NAME} are missing: {shown}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise StorageError(f"{root}: no .safetensors files in this directory")
    return files


def _check_index(root: Path, tensors: dict[str, TensorInfo]) -> None:
    index = root / INDEX_NAME
    if index.exists():
        check_index(index, read_index(index), tensors)


def check_index(index, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the index lists is present, in the shard it names."""
    for name, fname in weight_map.items():
        if name not in tensors:
            raise StorageError(f"{index}: tensor {_short(name)} is listed in {_short(fname)} but not present in it")
        if tensors[name].file != fname:
            raise StorageError(f"{index}: tensor {_short(name)} is listed in {_short(fname)} but found in "
                               f"{_short(tensors[name].file)}")


def read_index(index: Path) -> dict[str, str]:
    """A shard index's ``weight_map``: tensor name -> shard file name (a plain name in the directory)."""
    return index_weight_map(index, read_json_object(index))


def index_weight_map(index, data: dict) -> dict[str, str]:
    """The checked ``weight_map`` of a parsed shard index (``index``: its name, for messages)."""
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise StorageError(f"{index}: weight_map must be an object of tensor names to shard files "
                           f"(is {'missing' if weight_map is None else _kind(weight_map)})")
    for name, fname in weight_map.items():
        where = f"{index}: weight_map[{_short(name)}]"
        if not _is_text(name):
            raise StorageError(f"{where}: the tensor name is not valid text")
        if not isinstance(fname, str):
            raise StorageError(f"{where} must be a shard file name (is {_kind(fname)})")
        if (not _is_text(fname) or fname in ("", ".", "..") or "/" in fname or "\\" in fname):
            raise StorageError(f"{where} must be a file name in the checkpoint directory (no path)")
    return weight_map


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object (UTF-8, unique keys, not nested absurdly deep); one
    StorageError naming the file otherwise."""
    path = Path(path)
    try:
        raw = read_regular(path, MAX_JSON_BYTES)
    except OSError as exc:
        raise StorageError(f"{path}: cannot read ({exc.strerror})") from None
    return json_object(path, raw)


def json_object(path, raw: bytes) -> dict:
    """Parse a JSON object's bytes (read by any storage); ``path`` names it in messages."""
    data = _loads(raw, path)
    if not isinstance(data, dict):
        raise StorageError(f"{path}: expected a JSON object (is {_kind(data)})")
    if _too_deep(data):
        raise StorageError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep")
    return data


# config.json fields MergePipe reads: the architecture names and the number of layers.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
MAX_LAYERS = 1_000_000


def read_config(path: Path) -> dict:
    """A checkpoint's config.json, with the fields MergePipe reads checked."""
    return checked_config(path, read_json_object(path))


def checked_config(path, config: dict) -> dict:
    """A parsed config.json with the fields MergePipe reads checked (``path`` names it in messages)."""
    arch = config.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(_is_text(a) for a in arch)):
        what = _kind(arch) if not isinstance(arch, list) else "a list holding " + next(
            _kind(a) if not isinstance(a, str) else "invalid text" for a in arch if not _is_text(a))
        raise StorageError(f"{path}: architectures must be a list of names (is {what})")
    model_type = config.get("model_type")
    if model_type is not None and not _is_text(model_type):
        raise StorageError(f"{path}: model_type must be a name (is {_kind(model_type)})")
    for key in _LAYER_KEYS:
        n = config.get(key)
        if n is not None and not (_is_int(n) and 0 <= n <= MAX_LAYERS):
            what = _kind(n) if not _is_int(n) else "negative" if n < 0 else "too large"
            raise StorageError(f"{path}: {key} must be a non-negative integer of at most {MAX_LAYERS} (is {what})")
    return config


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
