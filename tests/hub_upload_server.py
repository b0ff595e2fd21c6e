"""A Hub-shaped upload server on loopback for the publish and reproduce tests.

``HubServer`` extends :class:`remote_helpers.RangeServer` (which serves the folders under its root at
``/{org}/{model}/resolve/{revision}/{file}``) with the endpoints the real ``huggingface_hub`` client calls to
create a repository and commit to it through the legacy LFS protocol (run with ``HF_HUB_DISABLE_XET=1``):

* ``POST /api/repos/create`` (409 when the repository exists), ``POST /api/validate-yaml``;
* ``POST /api/models/{repo}/preupload/{rev}`` (``uploadMode`` lfs for weights, regular otherwise);
* ``POST /{repo}.git/info/lfs/objects/batch`` (an upload action only for objects the server lacks) and the
  ``PUT`` of each object (its sha256 checked);
* ``POST /api/models/{repo}/commit/{rev}`` (ndjson; ``create_pr=1`` opens ``refs/pr/N``), applied all at once
  or not at all; ``POST /api/models/{repo}/branch/{branch}``;
* ``GET /api/models/{repo}[/revision/{rev}]`` and ``GET /api/models/{repo}/tree/{rev}`` (file sizes, git blob
  ids, LFS sha256s), so that ``snapshot_download`` and ``list_repo_tree`` work;
* ``GET``/``HEAD`` ``/{repo}/resolve/{rev}/{file}`` of committed files, with Range support, content ETags and
  ``X-Repo-Commit``.

Every request is logged (``calls``); ``lfs_puts`` lists the LFS objects uploaded and ``commit_paths`` the files
each commit carried. ``fail_commits`` answers that many commit requests with a 500 (-1: all) before applying
anything; ``fail_lfs_puts`` does the same for LFS uploads (huggingface_hub retries those).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from remote_helpers import _RANGE, RangeServer

_API_REPO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?P<rest>/.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_LFS_BATCH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")
_LFS_PUT = re.compile(r"^/lfs-upload/(?P<repo>[^/]+/[^/]+)/(?P<oid>[0-9a-f]{64})$")
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass
class Repo:
    private: bool
    refs: dict = field(default_factory=dict)  # branch or refs/pr/N -> commit sha
    commits: dict = field(default_factory=dict)  # sha -> {path: (kind 'regular'|'lfs', bytes)}
    lfs: dict = field(default_factory=dict)  # sha256 hex -> bytes
    prs: int = 0


class HubServer(RangeServer):
    """RangeServer plus repositories created and committed to through huggingface_hub (kept in memory)."""

    def __init__(self, root, **kw):
        super().__init__(root, **kw)
        self.repos: dict[str, Repo] = {}
        self.calls: list[tuple[str, str]] = []
        self.lfs_puts: list[str] = []
        self.commit_paths: list[list[str]] = []
        self.fail_commits = 0
        self.fail_lfs_puts = 0
        self.seen_auth: set[str] = set()
        self.hub_lock = threading.Lock()

    # --- what tests read ------------------------------------------------------------------------------
    def head(self, repo: str, ref: str = "main") -> str | None:
        r = self.repos.get(repo)
        return None if r is None else r.refs.get(ref)

    def files(self, repo: str, ref: str = "main") -> dict[str, bytes]:
        r = self.repos[repo]
        return {p: data for p, (_, data) in r.commits[r.refs[ref]].items()}

    def count(self, method: str, prefix: str) -> int:
        return sum(1 for m, p in self.calls if m == method and p.startswith(prefix))

    # --- the repository model -------------------------------------------------------------------------
    def _commit_of(self, repo: Repo, rev: str) -> str | None:
        rev = unquote(rev)
        if rev in repo.refs:
            return repo.refs[rev]
        return rev if rev in repo.commits else None

    def _new_commit(self, repo: Repo, tree: dict, message: str) -> str:
        sha = hashlib.sha1(json.dumps([message, len(repo.commits), sorted((p, git_blob_id(d)) for p, (_, d)
                                                                          in tree.items())]).encode()).hexdigest()
        repo.commits[sha] = tree
        return sha

    def create(self, repo_id: str, private: bool) -> bool:
        with self.hub_lock:
            if repo_id in self.repos:
                return False
            repo = self.repos[repo_id] = Repo(private)
            tree = {".gitattributes": ("regular", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n")}
            repo.refs["main"] = self._new_commit(repo, tree, "initial commit")
            return True

    def apply_commit(self, repo_id: str, rev: str, lines: list[dict], create_pr: bool) -> tuple[int, dict]:
        """All of a commit's operations, or none of them (an unknown LFS object refuses the commit)."""
        with self.hub_lock:
            repo = self.repos.get(repo_id)
            if repo is None:
                return 404, {"error": "Repository not found"}
            parent = self._commit_of(repo, rev)
            if parent is None:
                return 404, {"error": f"Invalid rev id: {rev}"}
            tree = dict(repo.commits[parent])
            header, paths = {}, []
            for item in lines:
                key, value = item.get("key"), item.get("value") or {}
                if key == "header":
                    header = value
                elif key == "file":
                    tree[value["path"]] = ("regular", base64.b64decode(value["content"]))
                    paths.append(value["path"])
                elif key == "lfsFile":
                    if value["oid"] not in repo.lfs:
                        return 422, {"error": f"LFS object {value['oid']} was never uploaded"}
                    tree[value["path"]] = ("lfs", repo.lfs[value["oid"]])
                    paths.append(value["path"])
                elif key in ("deletedFile", "deletedFolder"):
                    tree = {p: v for p, v in tree.items() if p != value["path"]
                            and not p.startswith(value["path"].rstrip("/") + "/")}
                else:
                    return 400, {"error": f"unknown commit line {key!r}"}
            sha = self._new_commit(repo, tree, header.get("summary", ""))
            self.commit_paths.append(paths)
            answer = {"commitUrl": f"{self.url}/{repo_id}/commit/{sha}", "commitOid": sha}
            if create_pr:
                repo.prs += 1
                repo.refs[f"refs/pr/{repo.prs}"] = sha
                answer["pullRequestUrl"] = f"{self.url}/{repo_id}/discussions/{repo.prs}"
            else:
                repo.refs[unquote(rev)] = sha
            return 200, answer

    def tree_entries(self, repo_id: str, commit: str) -> list[dict]:
        out, folders = [], set()
        for path, (kind, data) in sorted(self.repos[repo_id].commits[commit].items()):
            parts = path.split("/")
            folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
            entry = {"type": "file", "path": path, "size": len(data)}
            if kind == "lfs":
                oid = hashlib.sha256(data).hexdigest()
                pointer = lfs_pointer(oid, len(data))
                entry.update(oid=git_blob_id(pointer), lfs={"oid": oid, "size": len(data), "pointerSize": len(pointer)})
            else:
                entry["oid"] = git_blob_id(data)
            out.append(entry)
        return [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0}
                for f in sorted(folders)] + out

    def take_fault(self, name: str) -> bool:
        with self.hub_lock:
            left = getattr(self, name)
            if left == 0:
                return False
            if left > 0:
                setattr(self, name, left - 1)
            return True

    # --- HTTP -----------------------------------------------------------------------------------------
    def _handler(self):
        base = super()._handler()
        server = self

        class Handler(base):
            def log_call(self):
                with server.hub_lock:
                    server.calls.append((self.command, self.path.split("?")[0]))
                    auth = self.headers.get("Authorization")
                    if auth:
                        server.seen_auth.add(auth)

            def body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def send_json(self, status: int, obj, headers: dict | None = None):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def not_found(self, code: str, message: str):
                self.send_json(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

            def denied(self) -> bool:
                if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                    self.send_json(401, {"error": "Invalid credentials in Authorization header"})
                    return True
                return False

            def do_POST(self):
                self.log_call()
                data = self.body()
                if self.denied():
                    return
                path = urlsplit(self.path).path
                query = parse_qs(urlsplit(self.path).query)
                if path == "/api/repos/create":
                    req = json.loads(data)
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    created = server.create(repo_id, req.get("visibility") == "private" or bool(req.get("private")))
                    answer = {"url": f"{server.url}/{repo_id}", "name": repo_id}
                    if not created:
                        answer["error"] = "You already created this model repo"
                    return self.send_json(200 if created else 409, answer)
                if path == "/api/validate-yaml":
                    return self.send_json(200, {"errors": [], "warnings": []})
                m = _LFS_BATCH.match(path)
                if m:
                    return self.lfs_batch(m["repo"], json.loads(data))
                m = _API_REPO.match(path)
                if m is None or m["repo"] not in server.repos:
                    return self.not_found("RepoNotFound", "Repository not found")
                rest = m["rest"] or ""
                if rest.startswith("/preupload/"):
                    files = json.loads(data)["files"]
                    return self.send_json(200, {"files": [
                        {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES)
                         or f["size"] >= 10 << 20 else "regular", "shouldIgnore": False} for f in files]})
                if rest.startswith("/commit/"):
                    if server.take_fault("fail_commits"):
                        return self.send_json(500, {"error": "Internal Error - injected"})
                    lines = [json.loads(x) for x in data.splitlines() if x.strip()]
                    status, answer = server.apply_commit(m["repo"], rest[len("/commit/"):], lines,
                                                         query.get("create_pr") == ["1"])
                    return self.send_json(status, answer)
                if rest.startswith("/branch/"):
                    repo = server.repos[m["repo"]]
                    start = (json.loads(data) if data else {}).get("startingPoint") or "main"
                    repo.refs[unquote(rest[len("/branch/"):])] = server._commit_of(repo, start)
                    return self.send_json(200, {})
                return self.send_json(404, {"error": f"no endpoint {path}"})

            def lfs_batch(self, repo_id: str, req: dict):
                repo = server.repos.get(repo_id)
                if repo is None:
                    return self.not_found("RepoNotFound", "Repository not found")
                objects = []
                for obj in req["objects"]:
                    entry = {"oid": obj["oid"], "size": obj["size"]}
                    if obj["oid"] not in repo.lfs:
                        entry["actions"] = {"upload": {"href": f"{server.url}/lfs-upload/{repo_id}/{obj['oid']}"}}
                    objects.append(entry)
                self.send_json(200, {"transfer": "basic", "objects": objects})

            def do_PUT(self):
                self.log_call()
                data = self.body()
                m = _LFS_PUT.match(urlsplit(self.path).path)
                if m is None or m["repo"] not in server.repos:
                    return self.send_json(404, {"error": "no such upload"})
                if server.take_fault("fail_lfs_puts"):
                    return self.send_json(500, {"error": "Internal Error - injected"})
                if hashlib.sha256(data).hexdigest() != m["oid"]:
                    return self.send_json(400, {"error": "sha256 mismatch"})
                with server.hub_lock:
                    server.repos[m["repo"]].lfs[m["oid"]] = data
                    server.lfs_puts.append(m["oid"])
                self.send_json(200, {})

            def do_GET(self):
                self.hub_get(body=True)

            def do_HEAD(self):
                self.hub_get(body=False)

            def hub_get(self, body: bool):
                path = urlsplit(self.path).path
                m = _API_REPO.match(path)
                if m:
                    self.log_call()
                    if self.denied():
                        return None
                    return self.api_get(m["repo"], m["rest"] or "")
                m = _RESOLVE.match(path)
                if m and m["repo"] in server.repos:
                    self.log_call()
                    if self.denied():
                        return None
                    return self.resolve_hosted(m["repo"], m["rev"], unquote(m["file"]), body)
                return self.serve(body)

            def api_get(self, repo_id: str, rest: str):
                repo = server.repos.get(repo_id)
                if repo is None:
                    return self.not_found("RepoNotFound", "Repository not found")
                rev, tree_path = "main", False
                if rest.startswith("/revision/"):
                    rev = rest[len("/revision/"):]
                elif rest.startswith("/tree/"):
                    rev, tree_path = rest[len("/tree/"):].split("/", 1)[0], True
                commit = server._commit_of(repo, rev)
                if commit is None:
                    return self.not_found("RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
                if tree_path:
                    return self.send_json(200, server.tree_entries(repo_id, commit))
                self.send_json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                                     "siblings": [{"rfilename": p} for p in sorted(repo.commits[commit])]})

            def resolve_hosted(self, repo_id: str, rev: str, name: str, body: bool):
                repo = server.repos[repo_id]
                commit = server._commit_of(repo, rev)
                if commit is None:
                    return self.not_found("RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
                if name not in repo.commits[commit]:
                    return self.not_found("EntryNotFound", f"{name} does not exist at {rev}")
                kind, data = repo.commits[commit][name]
                etag = hashlib.sha256(data).hexdigest() if kind == "lfs" else git_blob_id(data)
                start, end, status = 0, len(data), 200
                rng = self.headers.get("Range")
                if rng:
                    m = _RANGE.match(rng.strip())
                    if m is None or int(m[1]) >= len(data):
                        return self.empty(416, {"Content-Range": f"bytes */{len(data)}"})
                    start, end, status = int(m[1]), min(len(data), int(m[2]) + 1) if m[2] else len(data), 206
                rel = f"{repo_id}/{name}"
                with server.lock:
                    server.requests[rel] += 1
                    if body:
                        server.bytes[rel] += end - start
                        if rng:
                            server.ranges.append((rel, start, end))
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Repo-Commit", commit)
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:end])

        return Handler


# --- the tests' setting -----------------------------------------------------------------------------------
TOKEN = "hf_mergepipe_test_secret_0123456789"


def point_hub_at(mp, server: HubServer, home) -> None:
    """Point huggingface_hub and MergePipe's hf:// reads at ``server`` (``mp``: a pytest MonkeyPatch): its
    endpoint, Xet off, HF_TOKEN the server's token, an empty HF_HOME (no stored token of the machine's)."""
    import huggingface_hub.constants as constants

    from mergepipe.storage import registry
    mp.setenv("HF_ENDPOINT", server.url)
    mp.setenv("HF_HUB_DISABLE_XET", "1")
    mp.setattr(constants, "HF_HUB_DISABLE_XET", True)  # read when huggingface_hub was imported
    mp.setenv("HF_HOME", str(home))
    mp.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    mp.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    mp.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)
    if server.token:
        mp.setenv("HF_TOKEN", server.token)
    else:
        mp.delenv("HF_TOKEN", raising=False)
    registry._BACKENDS.pop("hf", None)  # a backend made for another endpoint or token keeps its transports


def hub_snapshot(root, db, out, budget: str = "30%", seed: int = 5):
    """A family served as hf://org/{base,expert_1,expert_2} (files under ``root/org``), registered in the
    catalog ``db`` by those URIs, analyzed, and merged (ties, density 0.5, ``budget``) into ``out``.
    Returns (catalog, snapshot id)."""
    from mergepipe.analyze.runner import analyze
    from mergepipe.api import merge
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register, register_many
    from mergepipe.research.family import make_family

    make_family(root / "org", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=seed)
    cat = Catalog(db)
    register(cat, "base", "hf://org/base")
    register_many(cat, [("e1", "hf://org/expert_1"), ("e2", "hf://org/expert_2")], base_id="base")
    analyze(cat, block_bytes=16 << 10, densities=(0.5,))
    _, sid, _ = merge(cat, "base", ["e1", "e2"], out, "ties", model_id="merged", budget=budget, density=0.5)
    return cat, sid
