"""A Hub-shaped server on loopback that the real huggingface_hub client downloads from (tests/remote_helpers.py's
RangeServer plus the read API the client calls).

:class:`HubServer` serves ``root/{org}/{model}/{file}`` as RangeServer does (``/{org}/{model}/resolve/{rev}/
{file}``, Range requests, ETags, bytes counted per file) and adds what ``hf_hub_download`` and
``snapshot_download`` ask for: an ``X-Repo-Commit`` header on every resolve answer (HEAD and GET), the revision
answered at its commit as well as at ``main``, ``GET /api/models/{org}/{model}/revision/{rev}`` (the model's
info: ``sha``, ``siblings``) and ``GET /api/models/{org}/{model}/tree/{rev}`` (the file listing). A repo's
commit is a fixed sha1 of its name (``commit_of``); a missing repo is a 404 with ``X-Error-Code: RepoNotFound``,
as the Hub answers. The API's body bytes are counted apart (``api_bytes``), so ``total_bytes`` stays the file
bytes. Upload endpoints live in tests/hub_upload_server.py."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import unquote

from remote_helpers import RangeServer

_API = re.compile(r"^/api/models/(?P<org>[^/]+)/(?P<model>[^/]+)/(?P<what>revision|tree)/(?P<rev>[^/?]+)")
_RESOLVE = re.compile(r"^/(?P<org>[^/]+)/(?P<model>[^/]+)/resolve/")


def commit_of(repo: str) -> str:
    """The commit a repo's ``main`` names on this server (fixed: the sha1 of its name)."""
    return hashlib.sha1(f"{repo}@main".encode()).hexdigest()


class HubServer(RangeServer):
    """RangeServer + the read API of the Hub (see the module docstring); repos are the folders root/org/model."""

    def __init__(self, root: Path, **kw):
        root = Path(root)
        repos = [f"{o.name}/{m.name}" for o in sorted(root.iterdir()) if o.is_dir()
                 for m in sorted(o.iterdir()) if m.is_dir()]
        self.commits = {r: commit_of(r) for r in repos}
        self.api_bytes = 0
        super().__init__(root, revisions=("main", *self.commits.values()), **kw)

    def reset(self) -> None:
        super().reset()
        with self.lock:
            self.api_bytes = 0

    def repo_files(self, repo: str) -> list[Path]:
        folder = self.root / repo
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def _info(self, repo: str, what: str) -> object:
        files = self.repo_files(repo)
        if what == "tree":
            return [{"type": "file", "path": str(p.relative_to(self.root / repo)), "size": p.stat().st_size,
                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in files]
        return {"id": repo, "modelId": repo, "sha": self.commits[repo], "private": False,
                "siblings": [{"rfilename": str(p.relative_to(self.root / repo))} for p in files]}

    def _handler(self):
        base = super()._handler()
        server = self

        class Handler(base):
            def do_GET(self):
                if self.path.startswith("/api/"):
                    return self.api()
                return super().do_GET()

            def api(self):
                m = _API.match(self.path)
                repo = f"{m['org']}/{m['model']}" if m else None
                if m is None or repo not in server.commits or unquote(m["rev"]) not in server.revisions:
                    body = json.dumps({"error": "Repository not found"}).encode()
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                else:
                    body = json.dumps(server._info(repo, m["what"])).encode()
                    self.send_response(200)
                with server.lock:
                    server.api_bytes += len(body)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def end_headers(self):
                m = _RESOLVE.match(self.path)
                if m and f"{m['org']}/{m['model']}" in server.commits:
                    self.send_header("X-Repo-Commit", server.commits[f"{m['org']}/{m['model']}"])
                super().end_headers()

        return Handler


def download(server: HubServer, repo: str, cache_dir: Path) -> Path:
    """``repo`` downloaded into a Hugging Face cache by huggingface_hub itself (snapshot_download, through the
    server); its snapshot folder."""
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(repo, cache_dir=str(cache_dir), endpoint=server.url))


# --- repos to serve ---------------------------------------------------------------------------------------------
def _variant(src: Path, dst: Path, change, config_change=None) -> None:
    """A copy of checkpoint ``src`` at ``dst`` (one file) with its tensors changed by ``change(tensors)``, its
    config.json by ``config_change(config)``, and its tokenizer files."""
    import shutil
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file(change(tensors), str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if config_change:
        config_change(config)
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)


def _adapter(dst: Path, seed: int = 5, r: int = 4) -> None:
    """A PEFT LoRA adapter on the tiny family's q_proj and v_proj (written as PEFT saves one)."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, out in (("q_proj", 64), ("v_proj", 32)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, 64, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.1
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                         "target_modules": ["q_proj", "v_proj"]}))


def hub_repos(root: Path) -> dict:
    """Repos under ``root/org``: the tiny fp32 family (base, expert_1, expert_2; sharded, with an index), ``vocab``
    (expert_1 with 4 more vocabulary rows), ``shape`` (expert_1 with one tensor of another shape), ``tied`` (the
    base without lm_head, tie_word_embeddings: true) and ``adapter`` (a LoRA adapter on the base)."""
    import shutil
    import torch
    from mergepipe.research.family import make_family
    org = Path(root) / "org"
    fam = make_family(org, experts=2, size="tiny", dtype="fp32", shard_bytes=64 << 10, seed=11)
    rows = lambda t, n: torch.cat([t, torch.full((4, t.shape[1]), 0.01)])  # noqa: E731
    _variant(org / "expert_1", org / "vocab", lambda t: {**t, "model.embed_tokens.weight":
                                                          rows(t["model.embed_tokens.weight"], 4),
                                                          "lm_head.weight": rows(t["lm_head.weight"], 4)},
             lambda c: c.update(vocab_size=260))
    _variant(org / "expert_1", org / "shape", lambda t: {**t, "model.layers.0.mlp.up_proj.weight": torch.zeros(130, 64)})
    _variant(org / "base", org / "tied", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
             lambda c: c.update(tie_word_embeddings=True))
    _adapter(org / "adapter")
    shutil.copytree(org / "expert_1", org / "multi" / "text")  # a repo with the model in a subfolder
    return fam
