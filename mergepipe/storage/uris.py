"""Remote checkpoint URIs: what they name, and that they carry no secrets.

A catalog, a plan and a manifest store a model's URI as text, so a URI must never hold a credential.
Credentials come only from the standard places (``AWS_*`` variables and AWS config files for ``s3://``,
``HF_TOKEN`` or huggingface_hub's token file for ``hf://``); a URI with a user-info part
(``https://user:pass@host/...``), a query string (``?token=...``, pre-signed URLs) or a fragment is
refused with one error that shows it redacted.

Forms:

* ``s3://bucket/prefix`` -- a sharded checkpoint folder (or ``.../model.safetensors``, one file);
* ``http(s)://host[:port]/path`` -- the same, served over HTTP with Range support;
* ``hf://org/model[@revision][/subfolder]`` -- a Hugging Face Hub repository at a revision (default
  ``main``), read at ``$HF_ENDPOINT/{org}/{model}/resolve/{revision}/{file}`` (default endpoint
  https://huggingface.co).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from mergepipe.errors import StorageError

REMOTE_SCHEMES = ("s3", "http", "https", "hf")
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^/]+))?(?P<sub>/.*)?$")


def redact(uri: str) -> str:
    """``uri`` with any user-info, query string and fragment replaced by ``***`` (safe to print)."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    text = f"{parts.scheme}://{netloc}{parts.path}"
    if parts.query:
        text += "?***"
    if parts.fragment:
        text += "#***"
    return text


def check_no_secrets(uri: str) -> str:
    """``uri`` itself when it carries no credentials; a StorageError (showing it redacted) otherwise."""
    parts = urlsplit(uri)
    if "@" in parts.netloc or parts.query or parts.fragment or "?" in uri:
        raise StorageError(
            f"{redact(uri)}: a remote URI must not carry credentials, query strings or fragments "
            "(it is stored in the catalog and in manifests); give credentials through the environment "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE, HF_TOKEN) instead")
    return uri


def canonical_remote(uri: str) -> str:
    """The stored form of a remote URI: checked for secrets, scheme lower-cased, no trailing slash."""
    check_no_secrets(uri)
    scheme, rest = uri.split("://", 1)
    if scheme.lower() == "hf":
        parse_hf(f"hf://{rest}")
    return f"{scheme.lower()}://{rest.rstrip('/')}"


@dataclass(frozen=True)
class HfRef:
    repo: str
    revision: str
    subfolder: str  # "" or "sub/dir"

    def base_url(self, endpoint: str) -> str:
        sub = f"{self.subfolder}/" if self.subfolder else ""
        return f"{endpoint.rstrip('/')}/{self.repo}/resolve/{quote(unquote(self.revision), safe='')}/{sub}"


def parse_hf(uri: str) -> HfRef:
    m = _HF.match(uri.rstrip("/"))
    if m is None:
        raise StorageError(f"{redact(uri)}: not a Hub URI; expected hf://org/model[@revision][/subfolder]")
    return HfRef(m["repo"], m["rev"] or "main", (m["sub"] or "").strip("/"))


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT


def hf_token() -> str | None:
    """HF_TOKEN, else huggingface_hub's stored token (its token file), else None. Never stored."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b")."""
    rest = uri.split("://", 1)[1].strip("/")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{redact(uri)}: an S3 URI names a bucket: s3://bucket/prefix")
    return bucket, key


def remote_model_name(uri: str) -> str:
    """A default model id for a remote URI: the model of ``hf://org/model@rev`` or of a Hub-shaped
    ``.../org/model/resolve/rev`` URL, else the last path segment (less ``.safetensors``)."""
    text = uri.rstrip("/")
    if text.lower().startswith("hf://"):
        return parse_hf(text).repo.split("/")[-1]
    parts = [p for p in urlsplit(text).path.split("/") if p]
    if "resolve" in parts and 0 < parts.index("resolve"):
        return parts[parts.index("resolve") - 1]
    last = parts[-1] if parts else urlsplit(text).netloc
    return last[: -len(".safetensors")] if last.endswith(".safetensors") else last


class RemoteRoot(str):
    """Where a remote checkpoint lives (its URI), standing in for a local root Path: never a local
    directory or file, so nothing local is looked for under it."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, other: str) -> "RemoteRoot":
        return RemoteRoot(f"{self.rstrip('/')}/{other}")

    def is_dir(self) -> bool:
        return False

    def is_file(self) -> bool:
        return False

    def exists(self) -> bool:
        return False
