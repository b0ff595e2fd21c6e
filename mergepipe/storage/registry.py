"""Which :class:`~mergepipe.storage.base.Storage` serves a URI, and opening checkpoints through it.

Everything above storage/ opens checkpoints here (``open_checkpoint``, ``open_adapter``) and reads
and fingerprints them through the storage they were opened with (``Checkpoint.reader()``,
``Checkpoint.fingerprint()``), never through local files directly. A plain path is served by
:class:`~mergepipe.storage.local.LocalStorage`; a URI ``scheme://...`` by the backend registered for
its scheme (:func:`register_backend`), and is refused with one clear error when none is. The remote
backends ``s3://``, ``http(s)://`` and ``hf://`` (:mod:`mergepipe.storage.remote`) are built in and
made on first use, so their client libraries are imported only by a catalog that uses them.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from mergepipe.errors import StorageError
from mergepipe.storage import lora
from mergepipe.storage.base import Storage
from mergepipe.storage.local import LocalStorage
from mergepipe.storage.paths import expand_path
from mergepipe.storage.safetensors import Checkpoint
from mergepipe.storage.uris import canonical_remote, redact
from mergepipe.storage.views import layer_view, split_view, view_uri

LOCAL = LocalStorage()
_BACKENDS: dict[str, Storage] = {}
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def register_backend(scheme: str, storage: Storage) -> None:
    """Serve URIs ``scheme://...`` with ``storage`` (replacing any backend registered for it)."""
    _BACKENDS[scheme.lower()] = storage


def unregister_backend(scheme: str) -> None:
    _BACKENDS.pop(scheme.lower(), None)


def scheme_of(uri: str | os.PathLike) -> str | None:
    """``s3`` for ``s3://bucket/key``; None for a local path (``file://`` counts as local)."""
    m = _SCHEME.match(os.fspath(uri))
    return None if m is None or m[1].lower() == "file" else m[1].lower()


def storage_for(uri: str | os.PathLike) -> Storage:
    scheme = scheme_of(uri)
    if scheme is None:
        return LOCAL
    if scheme not in _BACKENDS:
        from mergepipe.storage.remote import BUILTIN

        if scheme not in BUILTIN:
            known = ", ".join(f"{s}://" for s in sorted({*_BACKENDS, *BUILTIN}))
            raise StorageError(f"{redact(os.fspath(uri))}: no storage backend for {scheme}:// "
                               f"(local paths are supported; remote backends: {known})")
        _BACKENDS[scheme] = BUILTIN[scheme]()
    return _BACKENDS[scheme]


def local_path(uri: str | os.PathLike) -> str:
    text = os.fspath(uri)
    return text[len("file://"):] if text.lower().startswith("file://") else text


def canonical_uri(uri: str | os.PathLike) -> str:
    """The form a catalog stores: an absolute, resolved path for local files; a remote URI checked to
    carry no credentials or query string (refused otherwise), without a trailing slash. A layer view's URI
    (storage/views.py) is its checkpoint's canonical URI and its layer map."""
    own, mapping = split_view(uri)
    if mapping is not None:
        return view_uri(canonical_uri(own), mapping)
    if scheme_of(uri) is not None:
        return canonical_remote(os.fspath(uri))
    return str(expand_path(local_path(uri)).resolve())


def open_checkpoint(uri: str | os.PathLike) -> Checkpoint:
    """Parse the checkpoint at ``uri`` through its storage; it then reads and fingerprints through it. A layer
    view's URI (storage/views.py) opens its checkpoint seen through the view."""
    own, mapping = split_view(uri)
    if mapping is not None:
        return layer_view(open_checkpoint(own), mapping, os.fspath(uri))
    storage = storage_for(uri)
    return storage.open(local_path(uri) if storage is LOCAL else uri)


def open_adapter(uri: str | os.PathLike) -> lora.LoraAdapter:
    """A PEFT LoRA adapter directory, local or remote (config by one small request, weights by ranges)."""
    if split_view(uri)[1] is not None:
        raise StorageError(f"{redact(os.fspath(uri))}: a LoRA adapter has no layer view (it is merged at its base's "
                           f"layers)")
    storage = storage_for(uri)
    if storage is not LOCAL:
        if not hasattr(storage, "open_adapter"):
            raise StorageError(f"{redact(os.fspath(uri))}: this storage backend cannot read LoRA adapters")
        return storage.open_adapter(uri)
    adapter = lora.open_adapter(local_path(uri))
    adapter.checkpoint.storage = LOCAL
    return adapter


def tokenizer_folder(uri: str | os.PathLike) -> Path:
    """A local folder holding the tokenizer files at ``uri``: the folder itself when it is local; for a
    remote folder, its tokenizer files (small, fetched whole) in a folder named by their content under the
    temporary directory, so tokenizer code reads local files either way."""
    if scheme_of(uri) is None:
        return Path(local_path(uri))
    storage = storage_for(uri)
    if not hasattr(storage, "tokenizer_files"):
        raise StorageError(f"{redact(os.fspath(uri))}: this storage backend cannot fetch tokenizer files")
    files = storage.tokenizer_files(os.fspath(uri))
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    folder = Path(tempfile.gettempdir()) / "mergepipe-tokenizers" / h.hexdigest()[:32]
    if not folder.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=_made(folder.parent)))
        for name, data in files.items():
            (staging / name).write_bytes(data)
        try:
            os.replace(staging, folder)
        except OSError:  # another process made the same folder first: same content
            for f in staging.iterdir():
                f.unlink()
            staging.rmdir()
    return folder


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
