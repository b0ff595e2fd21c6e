"""The built-in publisher: a merged snapshot published to an ``s3://`` prefix, its files staged under the
prefix, the manifest last (the :class:`~mergepipe.storage.base.Publisher` protocol, registered for
``s3`` by :mod:`mergepipe.storage.publish`).

Sequence (:class:`S3Publisher`): (1) ``check``: the bucket exists and the prefix holds no object (a
published snapshot is never overwritten); (2) ``stage``: every file except the manifest is uploaded to
``prefix/.mergepipe-staging-<txn>/<name>`` (in parallel; a shard's upload may start while the merge
writes the next ones: ``upload_soon``); (3) ``publish``: the staged objects are copied server-side to
``prefix/<name>`` (in parallel), then, every copy done, the manifest object
``prefix/mergepipe_manifest.json`` is written LAST, then the staging objects are deleted. The manifest object's presence is what makes the snapshot visible:
a reader (``register``, ``verify``, a merge input) that finds no manifest at the prefix sees no snapshot.
A crash before the manifest leaves, at most, staging objects and manifest-less data objects: ``abort``
(or, after a crash, ``leftovers`` + ``remove``) deletes them.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from mergepipe.errors import StorageError
from mergepipe.storage.base import MANIFEST_NAME, STAGING_PREFIX
from mergepipe.storage.uris import canonical_remote

PART_BYTES = 8 << 20
UPLOAD_WORKERS = 8  # objects uploaded (or copied) at once
PUT_CHUNK_BYTES = 32 << 20  # part size of a multipart upload (files of twice that or more)
MAX_PARTS = 10_000  # S3's limit on the parts of one upload


def check_s3_output(uri: str) -> str:
    """The canonical form of an ``s3://`` output URI, which must name a prefix inside the bucket."""
    canonical = canonical_remote(str(uri))
    if "/" not in canonical[len("s3://"):].strip("/"):
        raise StorageError(f"{canonical}: give a prefix inside the bucket (s3://bucket/prefix)")
    return canonical


class S3Publisher:
    """One snapshot's output prefix on S3 (see the module docstring for the publish sequence).

    Uploads and copies run on a pool of up to UPLOAD_WORKERS threads; :meth:`upload_soon` starts a
    finished file's upload while the merge goes on. ``written`` names every object a request was sent
    for (appended, under a lock, before the request goes out), so that ``abort`` removes all of them."""

    def __init__(self, uri: str, txn_id: str):
        from mergepipe.storage.transports import S3Transport

        self.uri = check_s3_output(uri)
        self.t = S3Transport(self.uri)
        self.staging = f"{STAGING_PREFIX}{txn_id}"
        self.written: list[str] = []  # object names (relative to the prefix) this publish created
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._uploads: dict[str, Future] = {}  # staged name -> its upload

    def _call(self, name: str, fn, *args, **kwargs):
        from mergepipe.storage.transports import Transient, describe
        try:
            return self.t._call(name, fn, *args, **kwargs)
        except FileNotFoundError:
            raise StorageError(f"{self.t.where(name)}: the bucket {self.t.bucket!r} does not exist") from None
        except Transient as exc:
            raise StorageError(describe(exc, self.t.where(name), 1)) from None

    def check(self) -> None:
        if not self._call("", self.t.fs.exists, self.t.bucket):
            raise StorageError(f"{self.uri}: the bucket {self.t.bucket!r} does not exist")
        if self.names():
            raise StorageError(f"{self.uri}: output prefix already holds objects; published snapshots are "
                               "never overwritten")

    def names(self) -> list[str]:
        """Every object under the prefix, relative to it (staging objects included)."""
        root = self.t.key("")
        found = self._call("", self.t.fs.find, root)
        return sorted(p[len(root) + 1:] for p in found if p.startswith(root + "/"))

    # --- requests on the pool --------------------------------------------------------------------------
    def _submit(self, name: str, fn, *args, **kwargs) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=UPLOAD_WORKERS, thread_name_prefix="mergepipe-upload")
            return self._pool.submit(self._write, name, fn, *args, **kwargs)

    def _write(self, name: str, fn, *args, **kwargs) -> None:
        """One request that creates object ``name``, recorded before it is sent."""
        with self._lock:
            self.written.append(name)
        self._call(name, fn, *args, **kwargs)

    def _upload(self, local: Path, path: Path) -> Future:
        name = f"{self.staging}/{path.relative_to(local).as_posix()}"
        # one part at a time per file (the files are the parallelism): at most 2 * PUT_CHUNK_BYTES in
        # memory per worker, 512 MiB for all; s3fs alone reads up to 10 parts of 50 MiB of one file at once
        part = max(PUT_CHUNK_BYTES, -(-path.stat().st_size // MAX_PARTS))
        return self._submit(name, self.t.fs.put_file, str(path), self.t.key(name), chunksize=part, max_concurrency=1)

    def _copy_to_final(self, staged: str) -> Future:
        final = staged[len(self.staging) + 1:]
        return self._submit(final, self.t.fs.copy, self.t.key(staged), self.t.key(final))

    def _wait(self, futures: list[Future]) -> None:
        """Wait for every request; on the first failure, cancel those not started, wait for those in
        flight (so that ``written`` is complete) and raise it."""
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            self._drain()
            raise failed[0].exception()

    def _drain(self) -> None:
        """Cancel the requests not started and wait for the ones in flight."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # --- the publish sequence --------------------------------------------------------------------------
    def upload_soon(self, local: Path, path: Path) -> None:
        """Start uploading ``path`` (a finished file of the snapshot at ``local``) to the staging prefix."""
        failed = [f for f in self._uploads.values() if f.done() and f.exception() is not None]
        if failed:  # end the merge now rather than after it
            self._wait(failed)
        if path.name != MANIFEST_NAME:
            self._uploads[path.relative_to(local).as_posix()] = self._upload(local, path)

    def stage(self, local: Path) -> None:
        """Upload every file of ``local`` except the manifest under the staging prefix (those
        :meth:`upload_soon` started are waited for)."""
        for f in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
            rel = f.relative_to(local).as_posix()
            if rel not in self._uploads:
                self._uploads[rel] = self._upload(local, f)
        self._wait(list(self._uploads.values()))

    def publish(self, local: Path) -> None:
        """Copy the staged objects to their final keys, then (every copy done) write the manifest object,
        then tidy up."""
        staged = [f"{self.staging}/{rel}" for rel in sorted(self._uploads)]
        self._wait([self._copy_to_final(name) for name in staged])
        self._drain()
        self._write(MANIFEST_NAME, self.t.fs.put_file, str(local / MANIFEST_NAME), self.t.key(MANIFEST_NAME))
        self.remove(staged)
        with self._lock:
            self.written = [n for n in self.written if n not in staged]

    def leftovers(self, committed: bool) -> list[str]:
        """What a crashed publish of this txn left at the prefix (names relative to it): its staging
        objects; and, when the catalog holds no snapshot there (``committed`` False), every object at the
        prefix: data objects copied before the crash, or a manifest written just before it."""
        names = self.names()
        if not committed:
            return names
        return [n for n in names if n.startswith(self.staging + "/")]

    def remove(self, names: list[str]) -> None:
        """Delete objects (the manifest first, so a half-removed snapshot is never visible)."""
        for name in sorted(names, key=lambda n: n != MANIFEST_NAME):
            try:
                self.t._call(name, self.t.fs.rm_file, self.t.key(name))
            except FileNotFoundError:
                pass

    def abort(self) -> None:
        """Remove what this publish created, once its requests in flight are done; never raises (the
        error being propagated is the one to report)."""
        try:
            self._drain()
            self.remove(list(self.written))
        except Exception:  # noqa: BLE001
            pass


def read_object(uri: str, name: str, limit: int | None = None) -> bytes | None:
    """A whole object under an s3:// prefix (None when missing)."""
    from mergepipe.storage.transports import S3Transport
    t = S3Transport(canonical_remote(uri))
    got = t.fetch_all(name, limit or (1 << 62))
    return None if got is None else got[0]


def object_sha256(uri: str, name: str) -> tuple[str, int] | None:
    """sha256 hex digest and size of one object, read by range requests of PART_BYTES (None when missing)."""
    import hashlib
    from mergepipe.storage.transports import S3Transport
    t = S3Transport(canonical_remote(uri))
    probe = t.probe(name, 0)
    if probe is None:
        return None
    h = hashlib.sha256()
    for start in range(0, probe.size, PART_BYTES):
        h.update(t.get(name, start, min(probe.size, start + PART_BYTES), probe.etag))
    return "sha256:" + h.hexdigest(), probe.size
