"""Bare Hugging Face Hub repo ids as model references, as mergekit configs and model cards write them:
``org/name``, ``org/name@revision``, ``org/name/subfolder`` (also ``org/name@revision/subfolder`` and
``org/name/subfolder@revision``); mergekit's ``BASE+ADAPTER`` takes them on either side (config/references.py).

:func:`locate` is the one step that turns such a reference into a location. It runs after the catalog id
and the local path have been tried (config/references.py, catalog/models.py), so a folder that exists
always wins over a repo id spelled the same way:

1. the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``)
   through huggingface_hub's cache API (``snapshot_download(local_files_only=True)``: the revision's commit
   from ``refs/``, a snapshot the cached tree listing says is complete): a snapshot of that revision that holds
   the weights is read locally, as a local folder (``.../models--org--name/snapshots/<commit>``);
2. else the Hub by range requests: ``hf://org/name@<commit>[/subfolder]``, the revision pinned to the commit
   it names now (one small JSON request, ``$HF_ENDPOINT/api/models/{repo}/revision/{revision}``; a mirror
   without that API leaves the revision as written). With ``HF_HUB_OFFLINE=1`` this step is refused before
   any request, in one error naming the repo.

Either way the location names the commit, and the catalog and every manifest store it: :func:`hub_origin`
reads (repo, commit, subfolder) back from a registered URI.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from mergepipe.errors import StorageError
from mergepipe.storage.uris import hf_endpoint, hf_token, parse_hf

_PART = r"\w(?:[\w.-]{0,94}\w)?"
_HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^/@\s]+))?(?P<sub>(?:/[\w.-]+)*)"
                     rf"(?:@(?P<rev2>[^/@\s]+))?$", re.ASCII)
_CACHED = re.compile(r"(?:^|/)models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})"
                     r"(?P<sub>(?:/[^/]+)*)/?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TRUE = ("1", "on", "yes", "true")
API_BYTES = [0]  # body bytes of the commit look-ups (preflight counts them with the range reads)
_API_LOCK = threading.Lock()


@dataclass(frozen=True)
class HubId:
    """A Hub model reference: ``repo`` (org/name), ``revision`` (None: main) and ``subfolder`` ("" or a/b)."""

    repo: str
    revision: str | None = None
    subfolder: str = ""

    @property
    def name(self) -> str:
        """The id it is registered under: the model's name, as for ``hf://org/name`` URIs."""
        return self.repo.split("/")[-1]

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def uri(self, revision: str | None = None) -> str:
        sub = f"/{self.subfolder}" if self.subfolder else ""
        return f"hf://{self.repo}@{revision or self.rev}{sub}"

    def __str__(self) -> str:
        return f"{self.repo}@{self.rev}" + (f"/{self.subfolder}" if self.subfolder else "")


@dataclass(frozen=True)
class HubLocation:
    """Where a repo id was found: ``uri`` is a cached snapshot folder (``cached``) or an ``hf://`` URI."""

    hub: HubId
    uri: str
    commit: str | None
    cached: bool

    @property
    def how(self) -> str:
        short = self.commit[:7] if self.commit else self.hub.rev
        return f"HF cache @{short}" if self.cached else f"Hub @{short}"


def parse_hub_id(text: str) -> HubId | None:
    """The Hub reference ``text`` spells, or None when it is not one (a scheme, an absolute or ``./`` path,
    a ``~``, spaces, ``+``, ``..``/``--`` in a name, or a revision given twice)."""
    if not isinstance(text, str) or "://" in text or text.startswith(("/", ".", "~")) or "\\" in text:
        return None
    m = _HUB_ID.match(text)
    if m is None or (m["rev"] and m["rev2"]) or "--" in m["repo"] or ".." in m["repo"]:
        return None
    sub = m["sub"].strip("/")
    if any(p in (".", "..") for p in sub.split("/") if sub):
        return None
    return HubId(m["repo"], m["rev"] or m["rev2"], sub)


def hub_origin(uri: str) -> HubId | None:
    """(repo, revision, subfolder) of a registered location that came from the Hub: an ``hf://`` URI, or a
    folder of the Hugging Face cache (``.../models--org--name/snapshots/<commit>[/sub]``: revision = the
    commit); None for anything else."""
    text = str(uri)
    if text.lower().startswith("hf://"):
        try:
            ref = parse_hf(text)
        except StorageError:
            return None
        return HubId(ref.repo, ref.revision, ref.subfolder)
    m = _CACHED.search(text.replace(os.sep, "/"))
    if m is None:
        return None
    return HubId(f"{m['org']}/{m['name']}", m["commit"], m["sub"].strip("/"))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read now, not at import)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: nothing may go to the Hub."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def holds_weights(folder: Path) -> bool:
    """Whether a folder holds a whole checkpoint or adapter: every shard its index names, else a weight file."""
    if not folder.is_dir():
        return False
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return False
            return bool(shards) and all((folder / str(s)).is_file() for s in shards)
    if (folder / "adapter_config.json").is_file():
        return (folder / "adapter_model.safetensors").is_file()
    return any(p.is_file() for p in folder.glob("*.safetensors")) or (folder / "pytorch_model.bin").is_file()


def cached_snapshot(hub: HubId) -> Path | None:
    """The cached snapshot folder (plus subfolder) of ``hub``'s revision when it holds the weights; None when
    it is not cached, only partly, or huggingface_hub is not installed."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        folder = snapshot_download(hub.repo, revision=hub.rev, cache_dir=str(hub_cache_dir()),
                                   local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError
        return None
    path = Path(folder) / hub.subfolder if hub.subfolder else Path(folder)
    return path if holds_weights(path) else None


def remote_commit(hub: HubId) -> str | None:
    """The commit ``hub``'s revision names on the Hub now (``/api/models/{repo}/revision/{rev}``), or None
    when the endpoint gives none (a mirror without the API, a private repo without a token: the ranged
    reads that follow say what is wrong)."""
    if _COMMIT.match(hub.rev):
        return hub.rev
    import urllib3

    url = f"{hf_endpoint().rstrip('/')}/api/models/{hub.repo}/revision/{quote(hub.rev, safe='')}"
    token = hf_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = urllib3.Timeout(connect=10.0, read=10.0)
    try:
        resp = urllib3.request("GET", url, headers=headers, timeout=timeout, retries=False, preload_content=False)
        data = resp.read(1 << 20) if resp.status == 200 else b""
        resp.drain_conn()
    except urllib3.exceptions.HTTPError:
        return None
    with _API_LOCK:
        API_BYTES[0] += len(data)
    try:
        sha = json.loads(data).get("sha") if data else None
    except (ValueError, AttributeError):
        return None
    return sha if isinstance(sha, str) and _COMMIT.match(sha) else None


def locate(text: str) -> HubLocation | None:
    """Where the repo id ``text`` is read from (see the module docstring); None when ``text`` is no repo id.
    Call it after the catalog id and the local path: it looks only at the cache and the Hub."""
    hub = parse_hub_id(text)
    if hub is None:
        return None
    snapshot = cached_snapshot(hub)
    if snapshot is not None:
        commit = hub_origin(str(snapshot))
        return HubLocation(hub, str(snapshot), commit.revision if commit else None, True)
    if offline():
        raise StorageError(f"{text}: the Hugging Face repo {hub.repo} (revision {hub.rev}) is not in the local "
                           f"Hugging Face cache ({hub_cache_dir()}) and HF_HUB_OFFLINE is set, so nothing is "
                           f"fetched; download it once online (huggingface-cli download {hub.repo}) or unset "
                           f"HF_HUB_OFFLINE")
    commit = remote_commit(hub)
    return HubLocation(hub, hub.uri(commit), commit, False)


def exists_locally(text: str) -> bool:
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError, RuntimeError):
        return False


def resolve_text(text: str) -> str:
    """``text`` itself when it is a remote URI, an existing path or no repo id; else where :func:`locate` finds
    it (for ``register`` and the command line's model references)."""
    if "://" in text or exists_locally(text):
        return text
    found = locate(text)
    return text if found is None else found.uri


def transferred() -> int:
    """Bytes moved over the network so far by this process's remote backends and commit look-ups (block-cache
    hits and unchanged small files excluded): preflight reports the difference."""
    from mergepipe.storage.registry import _BACKENDS
    total = API_BYTES[0]
    for backend in list(_BACKENDS.values()):
        stats = getattr(backend, "stats", None)
        if stats is not None:
            total += stats.snapshot()["bytes"]
    return total
