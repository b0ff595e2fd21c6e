"""Publishing a merged snapshot to an ``s3://`` prefix: files staged under the prefix, the manifest last.

Sequence (:class:`RemoteOutput`): (1) ``check``: the bucket exists and the prefix holds no object (a
published snapshot is never overwritten); (2) ``stage``: every file except the manifest is uploaded to
``prefix/.mergepipe-staging-<txn>/<name>``; (3) ``publish``: each staged object is copied server-side
to ``prefix/<name>``, then the manifest object ``prefix/mergepipe_manifest.json`` is written LAST, then
the staging objects are deleted. The manifest object's presence is what makes the snapshot visible:
a reader (``register``, ``verify``, a merge input) that finds no manifest at the prefix sees no snapshot.
A crash before the manifest leaves, at most, staging objects and manifest-less data objects: ``abort``
(or, after a crash, ``leftovers`` + ``remove``) deletes them. http(s):// and hf:// are read-only.
"""

from __future__ import annotations

from pathlib import Path

from mergepipe.errors import StorageError
from mergepipe.storage.registry import scheme_of
from mergepipe.storage.uris import canonical_remote

STAGING_PREFIX = ".mergepipe-staging-"
MANIFEST_NAME = "mergepipe_manifest.json"
PART_BYTES = 8 << 20


def is_remote(out) -> bool:
    return scheme_of(str(out)) is not None


def check_remote_output(uri: str) -> str:
    """The canonical ``s3://`` output URI; any other scheme is refused with one clear error."""
    scheme = scheme_of(uri)
    canonical = canonical_remote(str(uri))
    if scheme != "s3":
        raise StorageError(f"{canonical}: {scheme}:// is read-only for MergePipe; merge output goes to a "
                           "local directory or an s3:// prefix")
    if "/" not in canonical[len("s3://"):].strip("/"):
        raise StorageError(f"{canonical}: give a prefix inside the bucket (s3://bucket/prefix)")
    return canonical


class RemoteOutput:
    """One snapshot's output prefix on S3 (see the module docstring for the publish sequence)."""

    def __init__(self, uri: str, txn_id: str):
        from mergepipe.storage.transports import S3Transport

        self.uri = check_remote_output(uri)
        self.t = S3Transport(self.uri)
        self.staging = f"{STAGING_PREFIX}{txn_id}"
        self.written: list[str] = []  # object names (relative to the prefix) this publish created

    def _call(self, name: str, fn, *args):
        from mergepipe.storage.transports import Transient, describe
        try:
            return self.t._call(name, fn, *args)
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

    def stage(self, local: Path) -> None:
        """Upload every file of ``local`` except the manifest under the staging prefix."""
        for f in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
            name = f"{self.staging}/{f.relative_to(local).as_posix()}"
            self.written.append(name)
            self._call(name, self.t.fs.put_file, str(f), self.t.key(name))

    def publish(self, local: Path) -> None:
        """Copy the staged objects to their final keys, then write the manifest object, then tidy up."""
        staged = [n for n in self.written if n.startswith(self.staging + "/")]
        for name in staged:
            final = name[len(self.staging) + 1:]
            self.written.append(final)
            self._call(final, self.t.fs.copy, self.t.key(name), self.t.key(final))
        self.written.append(MANIFEST_NAME)
        self._call(MANIFEST_NAME, self.t.fs.put_file, str(local / MANIFEST_NAME), self.t.key(MANIFEST_NAME))
        self.remove(staged)
        self.written = [n for n in self.written if n not in staged]

    def remove(self, names: list[str]) -> None:
        """Delete objects (the manifest first, so a half-removed snapshot is never visible)."""
        for name in sorted(names, key=lambda n: n != MANIFEST_NAME):
            try:
                self.t._call(name, self.t.fs.rm_file, self.t.key(name))
            except FileNotFoundError:
                pass

    def abort(self) -> None:
        """Remove what this publish created; never raises (the error being propagated is the one to report)."""
        try:
            self.remove(list(self.written))
        except Exception:  # noqa: BLE001
            pass


def leftovers(uri: str, txn_id: str, committed: bool) -> list[str]:
    """What a crashed publish of txn ``txn_id`` left at ``uri`` (names relative to it): its staging
    objects; and, when the catalog holds no snapshot there (``committed`` False), every object at the
    prefix: data objects copied before the crash, or a manifest written just before it."""
    out = RemoteOutput(uri, txn_id)
    names = out.names()
    if not committed:
        return names
    return [n for n in names if n.startswith(out.staging + "/")]


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
