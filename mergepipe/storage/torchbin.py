"""PyTorch ``.bin`` checkpoints (``pytorch_model.bin``, or ``pytorch_model-0000k-of-0000n.bin`` shards with
``pytorch_model.bin.index.json``), read in place with exact byte ranges, never unpickled.

A zip-format ``torch.save`` file (the format since torch 1.6) stores the pickled state dict as
``<prefix>/data.pkl`` and each tensor storage as an uncompressed zip entry ``<prefix>/data/<key>``. The
layout is read here without importing torch and without executing anything:

* the zip's central directory gives each entry's local header offset; the 30-byte local header (read
  with ``pread``) gives where the entry's bytes start, so a tensor's bytes are one exact range of the
  ``.bin`` file, like a safetensors tensor's (``TensorInfo.offset`` points into the zip);
* ``data.pkl`` is parsed by a restricted unpickler that resolves only ``collections.OrderedDict``,
  ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_tensor`` / ``_rebuild_parameter`` and the typed
  storage classes (``torch.FloatStorage``, ...) -- each to a stand-in of our own that only records the
  storage key, dtype, shape, stride and offset. Any other global (``os.system``, ``builtins.eval``,
  ``torch.load`` itself, ...) is refused before it is called: a malicious pickle cannot run code.

Refused with a clear message: the legacy (pre-1.6, non-zip) format, compressed or encrypted entries,
big-endian files, non-contiguous tensors, tensors that are partial views of a storage another tensor
also uses (two names for the very same bytes -- tied weights -- are fine), storages whose size does not
match, and a top-level object that is not a flat ``{name: tensor}`` mapping. The layers above see an
ordinary :class:`~mergepipe.storage.safetensors.Checkpoint`: register, analyze and merge read
``.bin`` experts and bases with the same exact ranges and byte counts; outputs are safetensors.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

from mergepipe.errors import StorageError, brief
from mergepipe.storage.paths import open_regular
from mergepipe.storage.safetensors import ITEMSIZE, Checkpoint, TensorInfo, read_json_object

BIN_INDEX = "pytorch_model.bin.index.json"
BIN_NAME = "pytorch_model.bin"
MAX_PICKLE_BYTES = 64 * 1024 * 1024
# A state dict's pickle takes ~32 opcodes per tensor; a million is ~30,000 tensors in one file (a
# shard holds a few thousand at most). Counted before unpickling: 8 MiB of `]` would otherwise build 8
# million lists (680 MiB); a memo index of 2^31 would size the memo table to 16 GiB.
MAX_PICKLE_OPS = 1_000_000
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
STORAGE_DTYPES = {
    "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16", "DoubleStorage": "F64",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL",
}
_LOCAL_HEADER = b"PK\x03\x04"


# what zipfile raises on a corrupt directory: a bad signature, an unknown version (NotImplementedError),
# offsets or sizes past the file (OSError, EOFError, OverflowError), undecodable names (ValueError)
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError, OverflowError, struct.error)


def _esc(*parts: str) -> str:
    """Names from the file (zip entries, pickle globals) for a message: control characters escaped, cut."""
    text = ".".join(str(p) for p in parts)
    return repr(text[:200])[1:-1] + ("..." if len(text) > 200 else "")


class _StorageType:
    def __init__(self, dtype: str):
        self.dtype = dtype


class _Storage:
    def __init__(self, key: str, dtype: str, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    def __init__(self, storage, offset, shape, stride):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored):
    if not isinstance(storage, _Storage):
        raise StorageError("a tensor is not backed by a storage of the checkpoint")
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, *_ignored):
    return data


def _ordered_dict(*args):
    if args:  # OrderedDict(iterable) would call into the pickle's objects; torch never writes it
        raise StorageError("unexpected OrderedDict arguments")
    return OrderedDict()


_ALLOWED = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _LayoutUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed globals, to stand-ins; every other global is refused."""

    def __init__(self, data: bytes, label: str):
        super().__init__(io.BytesIO(data))
        self.label = label

    def find_class(self, module, name):
        fn = _ALLOWED.get((module, name))
        if fn is not None:
            return fn
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch" or module.startswith("torch."):
            raise StorageError(f"{self.label}: refused to load: its pickle uses {_esc(module, name)}; MergePipe reads "
                               f"dense tensors of the standard dtypes only (convert it to safetensors)")
        raise StorageError(f"{self.label}: refused to load: its pickle asks for {_esc(module, name)}, which a "
                           f"checkpoint of tensors never needs (MergePipe never executes a checkpoint's "
                           f"pickle; convert it to safetensors with a tool you trust)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise StorageError(f"{self.label}: unsupported storage reference in data.pkl")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise StorageError(f"{self.label}: untyped or unknown storage type in data.pkl "
                               f"(re-save with torch.save, or convert to safetensors)")
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise StorageError(f"{self.label}: malformed storage reference in data.pkl")
        return _Storage(key, stype.dtype, numel)


def is_torch_bin(root: Path) -> bool:
    """Whether ``root`` is a ``.bin`` checkpoint (a file, or a directory with one and no safetensors)."""
    root = Path(root)
    if root.is_file():
        return root.suffix == ".bin"
    if not root.is_dir() or any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").exists():
        return False
    return (root / BIN_INDEX).is_file() or any(root.glob("pytorch_model*.bin"))


def bin_files(root: Path) -> list[Path]:
    """The .bin shards of a directory: those named by its index, else pytorch_model*.bin."""
    index = root / BIN_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise StorageError(f"{index}: no weight_map")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if "/" in n or n in (".", "..")]
        if bad:
            raise StorageError(f"{index}: shard names must be file names in the directory: {', '.join(bad)}")
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise StorageError(f"{root}: shard(s) named in {BIN_INDEX} are missing: {', '.join(missing)}")
        return [root / n for n in names]
    files = sorted(root.glob("pytorch_model*.bin"))
    if not files:
        raise StorageError(f"{root}: no pytorch_model*.bin files in this directory")
    return files


class _LocalBytes:
    """A local .bin file's bytes: positioned reads, and a file object for the zip directory."""

    def __init__(self, fd: int):
        self.fd = fd

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def file(self):
        return os.fdopen(os.dup(self.fd), "rb")


def parse_bin(path: Path, label: str | None = None) -> dict[str, TensorInfo]:
    """The tensors of one zip-format torch.save file: names, dtypes, shapes and absolute byte offsets."""
    path = Path(path)
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise StorageError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return parse_bin_bytes(_LocalBytes(fd), os.fstat(fd).st_size, path, label or path.name)
    finally:
        os.close(fd)


def parse_bin_bytes(src, size: int, path, label: str) -> dict[str, TensorInfo]:
    """:func:`parse_bin` of any byte source: ``src.pread(n, offset)`` and ``src.file()`` (a seekable binary
    file object for the zip's central directory); a remote file's reads are range requests."""
    if src.pread(4, 0) != _LOCAL_HEADER:
        raise StorageError(f"{path}: not a zip-format torch checkpoint (the legacy torch.save format "
                           f"of torch < 1.6 is not read: re-save it with a current torch, or convert "
                           f"it to safetensors)")
    with src.file() as fh:
        try:
            zf = zipfile.ZipFile(fh)
        except _ZIP_ERRORS as exc:
            raise StorageError(f"{path}: not a valid torch checkpoint zip ({exc})") from None
        with zf:
            entries = {i.filename: i for i in zf.infolist()}
            pkl = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise StorageError(f"{path}: not a torch checkpoint (no single <name>/data.pkl entry)")
            prefix = pkl[0][: -len("data.pkl")]
            order = entries.get(prefix + "byteorder")
            if order is not None and _entry_bytes(src, path, order, size, 16) != b"little":
                raise StorageError(f"{path}: a big-endian torch checkpoint is not supported")
            info = entries[pkl[0]]
            if info.file_size > MAX_PICKLE_BYTES:
                raise StorageError(f"{path}: data.pkl is {info.file_size} bytes (limit {MAX_PICKLE_BYTES})")
            raw = _entry_bytes(src, path, info, size, MAX_PICKLE_BYTES)
            obj = _unpickle(raw, label)
            return _layout(path, label, src, size, prefix, entries, obj)


def _unpickle(raw: bytes, label: str):
    _check_pickle_size(raw, label)
    try:
        return _LayoutUnpickler(raw, label).load()
    except StorageError:
        raise
    except Exception as exc:  # malformed pickle: never a partial layout
        raise StorageError(f"{label}: data.pkl is not a readable torch state dict ({type(exc).__name__}: {exc})") \
            from None


def _check_pickle_size(raw: bytes, label: str) -> None:
    """Refuse, from its opcodes (nothing is built), a pickle of more than MAX_PICKLE_OPS operations, one
    storing to a memo slot beyond that, and one whose opcodes or lengths are malformed (a length prefix
    of 2^60 would have the unpickler allocate it before finding the data short)."""
    ops = 0
    try:
        for op, arg, _ in pickletools.genops(raw):
            ops += 1
            if ops > MAX_PICKLE_OPS:
                raise StorageError(f"{label}: refused to load: data.pkl has more than {MAX_PICKLE_OPS:,} pickle "
                                   f"operations (a state dict of tensors needs about 32 per tensor)")
            if op.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg < MAX_PICKLE_OPS):
                raise StorageError(f"{label}: refused to load: data.pkl stores to memo slot {brief(arg)} (a state "
                                   f"dict's pickle numbers its objects from 0)")
    except StorageError:
        raise
    except Exception as exc:  # an unknown opcode, a length past the end, a bad argument
        raise StorageError(f"{label}: data.pkl is not a readable torch state dict ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None


def _data_start(src, path: Path, info: zipfile.ZipInfo, size: int) -> int:
    """Absolute offset of an entry's bytes: after its local header (whose extra field, torch's alignment
    padding, may differ from the central directory's)."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise StorageError(f"{path}: entry {_esc(info.filename)} is compressed; MergePipe reads tensors in place "
                           f"(re-save with torch.save, which stores them uncompressed)")
    if info.flag_bits & 0x1:
        raise StorageError(f"{path}: entry {_esc(info.filename)} is encrypted")
    if not 0 <= info.header_offset <= size - 30:
        raise StorageError(f"{path}: entry {_esc(info.filename)} has no valid local header (corrupt zip)")
    head = src.pread(30, info.header_offset)
    if len(head) < 30 or head[:4] != _LOCAL_HEADER:
        raise StorageError(f"{path}: entry {_esc(info.filename)} has no valid local header (corrupt zip)")
    n_name = int.from_bytes(head[26:28], "little")
    n_extra = int.from_bytes(head[28:30], "little")
    start = info.header_offset + 30 + n_name + n_extra
    if start + info.file_size > size:
        raise StorageError(f"{path}: entry {_esc(info.filename)} runs past the end of the file (truncated?)")
    return start


def _entry_bytes(src, path: Path, info: zipfile.ZipInfo, size: int, limit: int) -> bytes:
    start = _data_start(src, path, info, size)
    n = min(info.file_size, limit)
    data = src.pread(n, start)
    if len(data) != n:
        raise StorageError(f"{path}: entry {_esc(info.filename)} is truncated")
    return data


def _contiguous(shape, stride) -> bool:
    expect = 1
    for dim, st in zip(reversed(shape), reversed(stride)):
        if dim != 1 and st != expect:
            return False
        expect *= dim
    return True


def _layout(path, label, src, size, prefix, entries, obj) -> dict[str, TensorInfo]:
    if not isinstance(obj, dict):
        raise StorageError(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, _Tensor)]
    if bad:
        shown = ", ".join(brief(k) for k in bad[:5])
        raise StorageError(f"{path}: not a flat state dict of tensors (entries {shown} are not tensors; a "
                           f"training checkpoint's nested state dict must be extracted first)")
    tensors: dict[str, TensorInfo] = {}
    users: dict[str, list[tuple[str, _Tensor]]] = {}
    starts: dict[str, int] = {}
    for name, t in obj.items():
        st = t.storage
        shape, stride = _shape_stride(path, name, t)
        entry = entries.get(f"{prefix}data/{st.key}")
        if entry is None:
            raise StorageError(f"{path}: tensor {brief(name, 200)} refers to a missing storage entry "
                               f"data/{brief(st.key)}")
        item = ITEMSIZE[st.dtype]
        if entry.file_size != st.numel * item:
            raise StorageError(f"{path}: storage data/{brief(st.key)} has {entry.file_size} bytes, expected "
                               f"{brief(st.numel)} x {item}")
        numel = math.prod(shape)
        if t.offset + numel > st.numel:
            raise StorageError(f"{path}: tensor {brief(name, 200)} lies outside its storage data/{brief(st.key)}")
        if st.key not in starts:
            starts[st.key] = _data_start(src, path, entry, size)
        users.setdefault(st.key, []).append((name, t))
        tensors[name] = TensorInfo(name, st.dtype, shape, label, starts[st.key] + t.offset * item, numel * item)
    for key, used in users.items():
        first = tensors[used[0][0]]
        for name, _ in used[1:]:
            other = tensors[name]
            if (other.offset, other.nbytes, other.dtype, other.shape) != (first.offset, first.nbytes, first.dtype,
                                                                          first.shape):
                raise StorageError(f"{path}: tensors {brief(used[0][0], 200)} and {brief(name, 200)} are different "
                                   f"views of one storage (data/{brief(key)}); re-save them with .clone() or "
                                   f"convert to safetensors")
    return tensors


MAX_DIMS = 64  # torch's limit on a tensor's dimensions
_INDEX = range(2**63)  # a shape, stride or offset fits in an int64


def _shape_stride(path, name: str, t: _Tensor) -> tuple[tuple, tuple]:
    """A tensor's shape and stride: up to MAX_DIMS non-negative int64s each, contiguous."""
    shape, stride = t.shape, t.stride
    if not (isinstance(shape, (tuple, list)) and isinstance(stride, (tuple, list)) and len(shape) == len(stride)
            and len(shape) <= MAX_DIMS and all(_is_index(d) for d in (*shape, *stride, t.offset))):
        raise StorageError(f"{path}: tensor {brief(name, 200)} has a malformed shape, stride or offset")
    shape, stride = tuple(shape), tuple(stride)
    if not _contiguous(shape, stride):
        raise StorageError(f"{path}: tensor {brief(name, 200)} is not contiguous (stride {list(stride)} for shape "
                           f"{list(shape)}); re-save it with .contiguous() or convert to safetensors")
    return shape, stride


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in _INDEX


def open_bin_checkpoint(root: Path) -> Checkpoint:
    """A ``.bin`` file or a directory of ``.bin`` shards (with or without the index) as a Checkpoint."""
    root = Path(root)
    if root.is_file():
        files = [root]
        tensors = parse_bin(root)
        config = {}
    else:
        files = bin_files(root)
        tensors = {}
        for f in files:
            for name, info in parse_bin(f, f.name).items():
                if name in tensors:
                    raise StorageError(f"{root}: tensor {brief(name, 200)} appears in more than one shard")
                tensors[name] = info
        index = root / BIN_INDEX
        if index.is_file():
            for name, fname in read_json_object(index)["weight_map"].items():
                if name not in tensors:
                    raise StorageError(f"{index}: tensor {brief(name, 200)} is listed but not present in {fname}")
                if tensors[name].file != fname:
                    raise StorageError(f"{index}: tensor {brief(name, 200)} is listed in {fname} but found in "
                                       f"{tensors[name].file}")
        config = read_json_object(root / "config.json") if (root / "config.json").exists() else {}
    if not tensors:
        raise StorageError(f"{root}: checkpoint holds no tensors")
    sizes = {f.name: f.stat().st_size for f in files}
    return Checkpoint(root, files, tensors, sizes, config)
