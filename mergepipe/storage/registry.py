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

import os
import re
from pathlib import Path

from mergepipe.errors import StorageError
from mergepipe.storage import lora
from mergepipe.storage.base import Storage
from mergepipe.storage.local import LocalStorage
from mergepipe.storage.paths import expand_path
from mergepipe.storage.safetensors import Checkpoint
from mergepipe.storage.uris import canonical_remote, redact

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
    carry no credentials or query string (refused otherwise), without a trailing slash."""
    if scheme_of(uri) is not None:
        return canonical_remote(os.fspath(uri))
    return str(expand_path(local_path(uri)).resolve())


def open_checkpoint(uri: str | os.PathLike) -> Checkpoint:
    """Parse the checkpoint at ``uri`` through its storage; it then reads and fingerprints through it."""
    storage = storage_for(uri)
    return storage.open(local_path(uri) if storage is LOCAL else uri)


def open_adapter(uri: str | os.PathLike) -> lora.LoraAdapter:
    """A PEFT LoRA adapter directory (local only for now: its config is a small JSON file)."""
    if storage_for(uri) is not LOCAL:
        raise StorageError(f"{os.fspath(uri)}: LoRA adapters are read from local directories only")
    adapter = lora.open_adapter(local_path(uri))
    adapter.checkpoint.storage = LOCAL
    return adapter
