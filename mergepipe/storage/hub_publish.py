"""Publishing a snapshot's files to a Hugging Face Hub repository, and reading them back by range requests.

Through huggingface_hub's ``HfApi`` (imported on first use): the repository is created when missing
(``--private`` applies then), a missing branch is made from ``main``, and one commit carries every file
whose content differs from the branch's (weights go as LFS objects; a file whose LFS sha256, or git blob
id for a regular file, equals the local one is left out, so publishing again uploads nothing unchanged),
with ``create_pr`` a pull request instead. Weight files the branch holds that the snapshot does not are
deleted in the same commit (no stale shard beside new ones). A commit is atomic on the Hub: any failure
before or during it (an HTTP 500, a dropped connection, an upload refused) is one StorageError, and
nothing was committed.

The token comes only from the standard places (``HF_TOKEN``, huggingface_hub's stored token: see
:func:`~mergepipe.storage.uris.hf_token`); it is never part of a message.

:func:`range_sha256` re-hashes a committed file by ranged GETs at ``$HF_ENDPOINT/{repo}/resolve/{commit}``
(the same reads as ``hf://``), never from the block cache.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mergepipe.errors import StorageError
from mergepipe.storage.uris import check_no_secrets, hf_endpoint, hf_token, parse_hf, redact

PART_BYTES = 8 << 20  # one ranged GET of a re-hash
_WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True)
class HubTarget:
    """Where a snapshot is published: a model repository and a branch."""

    repo: str
    branch: str

    @property
    def uri(self) -> str:
        return f"hf://{self.repo}" + (f"@{self.branch}" if self.branch != "main" else "")


@dataclass(frozen=True)
class UploadFile:
    """One file of a publish: its name in the repository, its bytes (a local file or data) and sha256 (hex)."""

    name: str
    sha256: str
    size: int
    path: Path | None = None
    data: bytes | None = None

    def blob_id(self) -> str:
        """Its git blob id: how the Hub names a regular (non-LFS) file's content."""
        h = hashlib.sha1(b"blob %d\x00" % self.size)
        if self.data is not None:
            h.update(self.data)
        else:
            with open(self.path, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
        return h.hexdigest()


def parse_target(uri: str) -> HubTarget:
    """``hf://org/name[@branch]`` (no subfolder): a repository to publish to."""
    text = str(uri).strip()
    if not text.lower().startswith("hf://"):
        raise StorageError(f"{redact(text) if '://' in text else text!r}: publish to a Hub repository, "
                           "hf://org/name[@branch]")
    check_no_secrets(text)
    ref = parse_hf(text)
    if ref.subfolder:
        raise StorageError(f"{text}: a snapshot is published at the root of a repository, not in a subfolder "
                           "(hf://org/name[@branch])")
    return HubTarget(ref.repo, ref.revision)


def hub_repo_of(uri: str) -> tuple[str, str] | None:
    """(repo id, revision) of a model read from the Hub: ``hf://org/name[@rev]`` or a folder of the local
    Hugging Face cache (``.../models--org--name/snapshots/<commit>``); None for anything else."""
    from mergepipe.storage.hub_ids import hub_origin
    found = hub_origin(str(uri).split("+", 1)[0] if str(uri).lower().startswith("hf://") else uri)
    return (found.repo, found.rev) if found else None


# --- the Hub client ---------------------------------------------------------------------------------------
def _client():
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise StorageError("publishing to the Hub needs huggingface_hub: pip install 'mergepipe[remote]'") from None
    return HfApi(endpoint=hf_endpoint(), token=hf_token(), library_name="mergepipe")


def _scrub(text: str) -> str:
    token = hf_token()
    text = " ".join(str(text).split())
    return text.replace(token, "***") if token else text


def _status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def hub_failure(what: str, exc: BaseException) -> StorageError:
    """One line for a failed Hub call: the HTTP status (401/403 say where a token comes from), never the token."""
    cause = exc
    while cause.__cause__ is not None and _status(cause) is None:
        cause = cause.__cause__
    status = _status(cause)
    if status in (401, 403):
        return StorageError(f"{what}: access denied (HTTP {status}); set HF_TOKEN or log in with `hf auth login` "
                            "(a token with write access to the repository)")
    if status == 404:
        return StorageError(f"{what}: not found (HTTP 404): no such repository or revision on the Hub (a private "
                            "one needs HF_TOKEN)")
    detail = _scrub(str(cause).splitlines()[0] if str(cause) else type(cause).__name__)
    if status is not None:
        detail = f"HTTP {status} ({detail[:200]})"
    return StorageError(f"{what}: {detail[:300]}")


@contextlib.contextmanager
def quiet_hub():
    """huggingface_hub's own progress bars off for the duration (MergePipe reports its progress)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


def remote_files(api, repo: str, revision: str) -> dict[str, dict] | None:
    """The files of ``repo`` at ``revision``: name -> {size, sha256 (LFS files), blob_id}; None when the
    repository or the revision does not exist."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.hf_api import RepoFile
    try:
        entries = list(api.list_repo_tree(repo, recursive=True, revision=revision))
    except (RevisionNotFoundError, RepositoryNotFoundError):
        return None
    return {e.path: {"size": e.size, "sha256": e.lfs.sha256 if e.lfs else None, "blob_id": e.blob_id}
            for e in entries if isinstance(e, RepoFile)}


def is_unchanged(f: UploadFile, remote: dict | None) -> bool:
    if remote is None or remote["size"] != f.size:
        return False
    if remote["sha256"]:
        return remote["sha256"] == f.sha256
    return remote["blob_id"] == f.blob_id()


def stale_weights(names: set[str], remote: dict[str, dict]) -> list[str]:
    """Weight files and indexes on the branch that the snapshot does not hold."""
    return sorted(n for n in remote if n not in names and n.endswith(_WEIGHTS))


def _prepare(api, target: HubTarget, private: bool) -> dict[str, dict]:
    """The branch's files, after creating the repository and the branch when missing."""
    files = remote_files(api, target.repo, target.branch)
    if files is not None:
        return files
    if remote_files(api, target.repo, "main") is None:
        api.create_repo(target.repo, private=private, exist_ok=True)
    if target.branch != "main":
        api.create_branch(target.repo, branch=target.branch, exist_ok=True)
    files = remote_files(api, target.repo, target.branch)
    if files is None:
        raise StorageError(f"{target.uri}: the repository or branch is still missing after creating it")
    return files


def publish_files(files: list[UploadFile], target: HubTarget, message: str, description: str = "",
                  private: bool = False, create_pr: bool = False, progress: Callable | None = None) -> dict:
    """Commit ``files`` to ``target`` (see the module docstring); ``progress(stage, done, total)``. Returns
    {commit, uploaded, unchanged, deleted, uploaded_bytes, pr_url, created_commit}."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    say = progress or (lambda *a: None)
    api = _client()
    with quiet_hub():
        try:
            say("compare", 0, len(files))
            remote = _prepare(api, target, private)
            head = api.repo_info(target.repo, revision=target.branch).sha
            changed = [f for f in files if not is_unchanged(f, remote.get(f.name))]
            stale = stale_weights({f.name for f in files}, remote)
            sent = {f.name for f in changed}
            result = {"uploaded": sorted(sent), "unchanged": sorted(f.name for f in files if f.name not in sent),
                      "deleted": stale, "uploaded_bytes": sum(f.size for f in changed), "pr_url": None,
                      "commit": head, "created_commit": False}
            if not changed and not stale:
                return result
            ops = [_addition(CommitOperationAdd, f) for f in changed]
            ops += [CommitOperationDelete(n) for n in stale]
            say("upload", 0, len(changed))
            info = api.create_commit(target.repo, ops, commit_message=message, commit_description=description,
                                     revision=target.branch, create_pr=create_pr,
                                     parent_commit=None if create_pr else head)
        except StorageError:
            raise
        except Exception as exc:  # huggingface_hub's HTTP errors, httpx's connection errors, refused metadata
            raise _nothing_committed(target, exc) from None
    say("upload", len(changed), len(changed))
    return {**result, "commit": info.oid, "pr_url": info.pr_url, "created_commit": True}


def _addition(add, f: UploadFile):
    """The commit operation of one file, its sha256 given (the caller hashed the file: no second read)."""
    op = add(f.name, f.data if f.data is not None else str(f.path))
    info = getattr(op, "upload_info", None)
    if info is not None and not getattr(info, "is_hashed", True):
        info.sha256 = bytes.fromhex(f.sha256)
    return op


def _nothing_committed(target: HubTarget, exc: BaseException) -> StorageError:
    err = hub_failure(f"publishing to {target.uri} failed", exc)
    return StorageError(f"{err}; nothing was committed")


def resolve_commit(repo: str, revision: str) -> str:
    """The commit sha ``revision`` of ``repo`` names now."""
    api = _client()
    try:
        sha = api.repo_info(repo, revision=revision).sha
    except Exception as exc:
        raise hub_failure(f"hf://{repo}@{revision}", exc) from None
    if not sha:
        raise StorageError(f"hf://{repo}@{revision}: the Hub gave no commit for this revision")
    return sha


# --- reading back by range requests ---------------------------------------------------------------------
@contextlib.contextmanager
def _reading(repo: str, revision: str):
    """(backend, transport) of ``hf://repo@revision``: a fresh backend (no cached block; the transport made
    with the current token), closed afterwards."""
    from mergepipe.storage.remote import hf_storage
    storage = hf_storage()
    t = storage.transport(f"hf://{repo}@{revision}")
    try:
        yield storage, t
    finally:
        t.close()


def range_sha256(repo: str, revision: str, name: str) -> tuple[str, int] | None:
    """("sha256:<hex>", size) of a committed file, read by ranged GETs of ``PART_BYTES``; None when missing."""
    from concurrent.futures import ThreadPoolExecutor
    with _reading(repo, revision) as (storage, t), ThreadPoolExecutor(4) as pool:
        probe, _ = storage.retrying(t.where(name), lambda: t.probe(name, 1))
        if probe is None:
            return None
        h, size = hashlib.sha256(), probe.size

        def part(span):
            return storage.retrying(t.where(name), lambda: t.get(name, span[0], span[1], probe.etag, size))[0]
        spans = [(s, min(size, s + PART_BYTES)) for s in range(0, size, PART_BYTES)]
        for i in range(0, len(spans), 8):  # hashed in order, at most 8 parts (64 MiB) held at once
            for data in pool.map(part, spans[i:i + 8]):
                h.update(data)
    return "sha256:" + h.hexdigest(), size


def read_file(repo: str, revision: str, name: str, limit: int) -> bytes | None:
    """A small committed file whole (at most ``limit`` bytes); None when missing."""
    with _reading(repo, revision) as (storage, t):
        got, _ = storage.retrying(t.where(name), lambda: t.fetch_all(name, limit))
    return None if got is None else got[0]
