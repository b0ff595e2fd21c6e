"""Which :class:`~mergepipe.storage.base.Publisher` publishes a merge whose output is a URI (the write side
of the storage seam; :mod:`mergepipe.storage.registry` is the read side).

A plain path is published by the engine itself (engine/txn.py: staged, fsynced, renamed). A URI
``scheme://...`` is published by the publisher registered for its scheme (:func:`register_publisher`):
``factory(uri, txn_id)`` makes one per transaction, and the optional ``check_uri(uri)`` refuses an
unusable output URI before anything is recorded. ``s3://`` (:mod:`mergepipe.storage.s3_publisher`) is
the one built-in registration, made here (s3fs is imported by its first publish only). A scheme with no
publisher (``http(s)://``, ``hf://``) is read-only and refused with one clear error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from mergepipe.errors import StorageError
from mergepipe.storage.base import MANIFEST_NAME, STAGING_PREFIX, Publisher  # noqa: F401 (re-exported)
from mergepipe.storage.registry import scheme_of
from mergepipe.storage.s3_publisher import (  # noqa: F401 (re-exported: the names this module had)
    MAX_PARTS, PART_BYTES, PUT_CHUNK_BYTES, UPLOAD_WORKERS, S3Publisher, check_s3_output, object_sha256,
    read_object,
)
from mergepipe.storage.uris import canonical_remote

RemoteOutput = S3Publisher  # its former name (benchmarks/remote_upload.py)


@dataclass(frozen=True)
class Registration:
    factory: Callable[[str, str], Publisher]  # (canonical output URI, txn id) -> the txn's publisher
    check_uri: Callable[[str], object] | None = None  # raises StorageError for an unusable output URI


_PUBLISHERS: dict[str, Registration] = {}


def register_publisher(scheme: str, factory: Callable[[str, str], Publisher],
                       check_uri: Callable[[str], object] | None = None) -> None:
    """Publish merge outputs ``scheme://...`` with ``factory(uri, txn_id)`` (replacing any publisher
    registered for it); ``check_uri(uri)``, given the canonical URI, refuses one that cannot be an output."""
    _PUBLISHERS[scheme.lower()] = Registration(factory, check_uri)


def unregister_publisher(scheme: str) -> None:
    _PUBLISHERS.pop(scheme.lower(), None)


register_publisher("s3", S3Publisher, check_uri=check_s3_output)  # the one built-in publisher


def is_remote(out) -> bool:
    return scheme_of(str(out)) is not None


def check_remote_output(uri: str) -> str:
    """The canonical output URI of a scheme with a publisher; any other scheme is refused with one clear error."""
    scheme = scheme_of(uri)
    canonical = canonical_remote(str(uri))
    registration = _PUBLISHERS.get(scheme)
    if registration is None:
        raise StorageError(f"{canonical}: {scheme}:// is read-only for MergePipe; merge output goes to a "
                           "local directory or an s3:// prefix")
    if registration.check_uri is not None:
        registration.check_uri(canonical)
    return canonical


def publisher_for(uri: str | os.PathLike, txn_id: str) -> Publisher:
    """The publisher of transaction ``txn_id`` writing to ``uri`` (checked as :func:`check_remote_output` does)."""
    canonical = check_remote_output(os.fspath(uri))
    return _PUBLISHERS[scheme_of(canonical)].factory(canonical, txn_id)


def leftovers(uri: str, txn_id: str, committed: bool) -> list[str]:
    """What a crashed publish of txn ``txn_id`` left at ``uri`` (names relative to it; see
    :meth:`Publisher.leftovers`)."""
    return publisher_for(uri, txn_id).leftovers(committed)
