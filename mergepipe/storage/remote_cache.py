"""The optional block cache of remote reads (off by default; see :mod:`mergepipe.storage.remote`).

``$MERGEPIPE_REMOTE_CACHE=/some/dir`` keeps every fetched request's bytes in a file named by sha256(file
identity, ETag, file size, start, end); the identity is the file's full URL (S3: key and endpoint), since
ETags are not unique across servers. Only files with an ETag are cached."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path


def identity_of(transport, name: str) -> str:
    """The full identity of a remote file (its URL; a transport without ``identity``: its shown URI)."""
    identity = getattr(transport, "identity", None)
    return identity(name) if identity is not None else transport.where(name)


def cache_path(identity: str, etag: str | None, size: int, start: int, end: int) -> Path | None:
    """The cache entry of bytes [start, end) of one version of one file: keyed by the file's identity (its
    URL) as well as its ETag and size, never by the ETag alone."""
    root = os.environ.get("MERGEPIPE_REMOTE_CACHE")
    if not root or not etag:
        return None
    digest = hashlib.sha256(f"{identity}\0{etag}\0{size}\0{start}\0{end}".encode()).hexdigest()
    return Path(root).expanduser() / digest[:2] / digest


def store(path: Path, data: bytes) -> None:
    """Write a cache entry atomically (a reader sees a whole entry or none); failures are ignored."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        pass
