"""Output shards: the layout of the merged checkpoint (shards of at most a given size, headers built up
front), a writer that fills a pre-sized shard with positioned writes in order while hashing it, and the
files that complete a snapshot (the shard index, the base's config and tokenizer files)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from mergepipe.errors import ExecutionError
from mergepipe.storage.dtypes import FLOAT_DTYPES, ITEMSIZE, TORCH_NAMES
from mergepipe.storage.safetensors import INDEX_NAME, Checkpoint, TensorInfo

from mergepipe.storage.tokenizer_files import copy_tokenizer_files, write_chat_template

# copied from the base as they are; the tokenizer and processor files come from the tokenizer source
# (the base by default): see mergepipe.storage.tokenizer_files for the rule
COPIED_FILES = ("config.json",)


def write_failure(exc: OSError, action: str, path) -> ExecutionError:
    """The one-line error for a failed file operation of a merge's output (a full disk, an I/O error,
    a read-only filesystem): what was being done to which file, and that nothing was published."""
    name = errno.errorcode.get(exc.errno or 0, "")
    reason = (exc.strerror or str(exc)).rstrip(".")
    reason = reason[:1].lower() + reason[1:]
    return ExecutionError(f"{action} {path}: {reason}{f' ({name})' if name else ''}; nothing was published")


@dataclass
class OutShard:
    fname: str
    header: bytes
    offsets: dict[str, int]  # tensor -> absolute offset of its data in the file
    size: int
    names: list[str] | None = None  # the tensor names its header holds (None: those of ``offsets``)


def written_info(info: TensorInfo, out_dtype: str | None) -> TensorInfo:
    """A tensor as written: a float tensor in ``out_dtype`` (its size in that dtype) when given, else as it is."""
    if out_dtype is None or info.dtype == out_dtype or info.dtype not in FLOAT_DTYPES:
        return info
    return replace(info, dtype=out_dtype, nbytes=info.nbytes // ITEMSIZE[info.dtype] * ITEMSIZE[out_dtype])


def plan_shards(tensors: list[TensorInfo], shard_bytes: int, heads: dict | None = None) -> list[OutShard]:
    """Split tensors (in order) into shards of at most ``shard_bytes`` of data; build each header.

    ``heads`` (storage/moe_layout.py): tensor -> (name written, shape written); consecutive tensors written
    under one name are one fused tensor, their data one after the other (each keeps its own offset)."""
    heads = heads or {}
    units: list[list[TensorInfo]] = []  # the tensors of each header entry
    for t in tensors:
        head = heads.get(t.name, (t.name,))[0]
        if units and head != t.name and heads.get(units[-1][-1].name, (None,))[0] == head:
            units[-1].append(t)
        else:
            units.append([t])
    groups: list[list[list[TensorInfo]]] = [[]]
    size = 0
    for unit in units:
        nbytes = sum(t.nbytes for t in unit)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += nbytes
    return [_shard(group, heads, i, len(groups)) for i, group in enumerate(groups)]


def _shard(group: list[list[TensorInfo]], heads: dict, i: int, n: int) -> OutShard:
    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    rel = {}
    for unit in group:
        name, shape = heads.get(unit[0].name, (unit[0].name, tuple(unit[0].shape)))
        nbytes = sum(t.nbytes for t in unit)
        header[name] = {"dtype": unit[0].dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        for t in unit:
            rel[t.name] = pos
            pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return OutShard(fname, len(raw).to_bytes(8, "little") + raw, {n: start + r for n, r in rel.items()}, start + pos,
                    [k for k in header if k != "__metadata__"])


class ShardWriter:
    """Pre-sized output file written with positioned writes, hashed in write order. With ``on_closed``,
    the file is closed as soon as its last byte is written, and ``on_closed(path)`` is called then (an
    s3:// output starts its upload while the merge writes the next shards)."""

    def __init__(self, directory: Path, shard: OutShard, on_closed=None):
        import hashlib
        self.shard = shard
        self.path = directory / shard.fname
        self.fd = -1
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(self.fd, shard.size)
        except OSError as exc:
            self.discard()
            raise write_failure(exc, "creating", self.path) from exc
        # A merge that fails leaves its writers behind: their descriptors close when they are collected.
        self._closer = weakref.finalize(self, _close_fd, self.fd)
        self.hash = hashlib.sha256()
        self.pos = 0
        self.on_closed = None
        self.digest: dict | None = None
        self.write(0, shard.header)
        self.on_closed = on_closed

    def write(self, offset: int, data) -> None:
        if offset != self.pos:
            raise ExecutionError(f"{self.path.name}: out-of-order write at {offset} (expected {self.pos})")
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            self.discard()
            raise write_failure(exc, "writing", self.path) from exc
        self.hash.update(view)
        self.pos += len(view)
        if self.on_closed is not None and self.pos == self.shard.size:
            self.close()
            self.on_closed(self.path)

    def close(self) -> dict:
        if self.digest is not None:
            return self.digest
        if self.pos != self.shard.size:
            raise ExecutionError(f"{self.path.name}: wrote {self.pos} of {self.shard.size} bytes")
        try:
            os.fsync(self.fd)
        except OSError as exc:
            self.discard()
            raise write_failure(exc, "flushing (fsync)", self.path) from exc
        self.discard()
        self.digest = {"sha256": "sha256:" + self.hash.hexdigest(), "bytes": self.pos}
        return self.digest

    def discard(self) -> None:
        """Close the file (after a failure: the transaction removes the staging directory)."""
        closer = getattr(self, "_closer", None)
        if closer is not None:
            closer()
        elif self.fd >= 0:
            _close_fd(self.fd)
        self.fd = -1


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass



def finish_files(base_ck: Checkpoint, staging: Path, shards: list[OutShard], tokenizer: dict | None = None) -> None:
    """Write the index of a sharded output, copy the base's config.json and the tokenizer files of the
    tokenizer source (``tokenizer["source_uri"]``, default the base), and set ``tokenizer["chat_template"]``."""
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.size - len(s.header) for s in shards)},
                 "weight_map": {n: s.fname for s in shards for n in (s.names or s.offsets)}}
        write_text(staging / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True))
    tokenizer = tokenizer or {}
    side_files = base_ck.storage.side_files(base_ck) if base_ck.storage is not None else None
    if side_files is not None:  # a remote base: config.json and tokenizer files fetched whole (small)
        for name, data in side_files.items():
            if name == "config.json" or not tokenizer.get("source_uri"):
                write_bytes(staging / name, data)
    elif base_ck.root.is_dir():
        for name in COPIED_FILES:
            src = base_ck.root / name
            if src.is_file():
                try:
                    shutil.copyfile(src, staging / name)
                except OSError as exc:
                    failed = staging / name if exc.filename != str(src) else src
                    raise write_failure(exc, "copying" if failed == src else "writing", failed) from exc
    from mergepipe.storage.registry import tokenizer_folder  # a remote source's files are fetched first
    source = tokenizer_folder(tokenizer["source_uri"]) if tokenizer.get("source_uri") else base_ck.root
    try:
        if side_files is None or tokenizer.get("source_uri"):
            copy_tokenizer_files(source, staging)
        if tokenizer.get("chat_template"):
            write_chat_template(staging, tokenizer["chat_template"])
    except OSError as exc:
        raise write_failure(exc, "copying tokenizer files into", staging) from exc


def write_layout_config(staging: Path, layout: dict) -> None:
    """A `slices:` output's config.json: ``num_hidden_layers`` (or the architecture's key: ``n_layer``,
    ``num_layers``) is the number of output layers (as mergekit writes it), and a per-layer ``layer_types`` list follows the layers the output took."""
    path = staging / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    layers = layout["layers"]
    types = config.get("layer_types")
    if isinstance(types, list) and all(0 <= i < len(types) for _, i in layers):
        config["layer_types"] = [types[i] for _, i in layers]
    keys = [k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in config] or ["num_hidden_layers"]
    for key in keys:  # the key the architecture uses (GPT-2's n_layer), as mergekit writes it
        config[key] = len(layers)
    write_text(path, json.dumps(config, indent=2) + "\n")
def write_dtype_config(staging: Path, out_dtype: str) -> None:
    """A converted output's config.json names its dtype (``torch_dtype``, or transformers v5's ``dtype``, where
    the base's names one; else ``torch_dtype``), as mergekit writes its ``out_dtype`` there."""
    path = staging / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        return
    keys = [k for k in ("torch_dtype", "dtype") if isinstance(config.get(k), str)] or ["torch_dtype"]
    for key in keys:
        config[key] = TORCH_NAMES[out_dtype]
    write_text(path, json.dumps(config, indent=2) + "\n")


def write_bytes(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise write_failure(exc, "writing", path) from exc


def write_text(path: Path, text: str) -> None:
    """Write one small file of an output (index, manifest); failures are one-line ExecutionErrors."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise write_failure(exc, "writing", path) from exc
