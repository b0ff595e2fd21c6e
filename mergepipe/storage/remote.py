"""Remote checkpoints: ``s3://``, ``http(s)://`` and ``hf://`` behind the Storage seam (see base.py).

Opening a checkpoint costs range requests only: per weight file the first 8 bytes (which also give
the file's size and ETag) and then exactly its header; plus the shard index and config.json when the
location has them. No tensor byte is fetched to register or plan.

Reads are exact: a reader (:class:`~mergepipe.storage.remote_reader.RemoteReader`) fetches the byte
ranges asked for and nothing more. Ranges passed together to ``read_ranges`` that touch are coalesced
into one request; a long run is cut into parts of ``$MERGEPIPE_REMOTE_PART_BYTES`` (default 8 MiB) and
all requests go out in parallel on the backend's pool of ``$MERGEPIPE_REMOTE_CONNECTIONS`` (default
16) connections. A request that fails with a 5xx, a timeout or a dropped/short connection is repeated
up to ``$MERGEPIPE_REMOTE_RETRIES`` attempts in all (default 4), waiting ``$MERGEPIPE_REMOTE_BACKOFF``
seconds (default 0.25) doubled each time; then the read fails with one StorageError. A file whose ETag
changes while it is read is an error, never mixed bytes.

Optional block cache (off by default): ``$MERGEPIPE_REMOTE_CACHE=/some/dir`` keeps every fetched
request's bytes in a file named by sha256(file identity, ETag, file size, start, end) -- the identity is
the file's full URL (S3: key and endpoint), since ETags are not unique across servers (nginx's are
mtime-size) -- so a repeated merge of the same plan reads its blocks locally. Only files with an ETag are cached;
bytes served from the cache count in ``bytes_read`` (what the plan asked for) but not in the
backend's transferred bytes. Delete the folder to empty it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from mergepipe.errors import CatalogError, StorageError
from mergepipe.storage.base import Storage
from mergepipe.storage.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraAdapter, adapter_of, checked_config
from mergepipe.storage.remote_cache import cache_path, identity_of, store
from mergepipe.storage.remote_reader import RemoteBytes, RemoteReader, env_int
from mergepipe.storage.safetensors import (
    INDEX_NAME, MAX_JSON_BYTES, Checkpoint, check_index, checked_config, header_length, header_tensors,
    index_weight_map, json_object,
)
from mergepipe.storage.tokenizer_files import is_tokenizer_file
from mergepipe.storage.torchbin import BIN_INDEX, BIN_NAME, parse_bin_bytes
from mergepipe.storage.transports import HttpTransport, S3Transport, Transient, describe, env_float
from mergepipe.storage.uris import RemoteRoot, canonical_remote, hf_endpoint, hf_token, parse_hf

# side files a merged model takes from a remote base that cannot list its folder (plain HTTP, the Hub)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
              "chat_template.jinja")
_HEADER_CACHE: OrderedDict = OrderedDict()  # (location, file, etag, size) -> tensors; headers by content
_HEADER_CACHE_LOCK = threading.Lock()


def split_location(uri: str) -> tuple[str, str | None]:
    """(folder URI, file name) for ``.../model.safetensors`` or ``.../pytorch_model.bin``; (uri, None) for a
    folder."""
    if uri.endswith((".safetensors", ".bin")):
        folder, _, name = uri.rpartition("/")
        return folder, name
    return uri, None


class TransferStats:
    """Requests and bytes a backend moved (all readers and openings), for tests and benchmarks."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.bytes = self.retries = self.cache_hits = 0

    def add(self, nbytes: int, retries: int = 0) -> None:
        with self.lock:
            self.requests += 1
            self.bytes += nbytes
            self.retries += retries

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests": self.requests, "bytes": self.bytes, "retries": self.retries,
                    "cache_hits": self.cache_hits}


class _Missing(StorageError):
    """A weight file that is not there."""


class RemoteStorage(Storage):
    """A remote tier: ``make_transport(folder_uri)`` builds the transport of one checkpoint folder."""

    def __init__(self, tier: str, make_transport: Callable[[str], object]):
        self.tier = tier
        self.make_transport = make_transport
        self.stats = TransferStats()
        self._transports: dict[str, object] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # --- plumbing --------------------------------------------------------------------------------------
    def transport(self, folder: str):
        with self._lock:
            t = self._transports.get(folder)
            if t is None:
                t = self._transports[folder] = self.make_transport(folder)
            return t

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(env_int("MERGEPIPE_REMOTE_CONNECTIONS", 16),
                                                thread_name_prefix=f"mergepipe-{self.tier}")
            return self._pool

    def retrying(self, where: str, call: Callable):
        """``call()`` repeated on transient failures with exponential backoff; one StorageError at the end."""
        attempts = max(1, env_int("MERGEPIPE_REMOTE_RETRIES", 4))
        delay = env_float("MERGEPIPE_REMOTE_BACKOFF", 0.25)
        for attempt in range(1, attempts + 1):
            try:
                return call(), attempt - 1
            except Transient as exc:
                if attempt == attempts:
                    raise StorageError(describe(exc, where, attempts)) from None
                time.sleep(delay * 2 ** (attempt - 1))

    def fetch(self, transport, name: str, start: int, end: int, etag: str | None, size: int) -> bytes:
        """Bytes [start, end) of one file: from the block cache, else one ranged request (retried)."""
        cached = cache_path(identity_of(transport, name), etag, size, start, end)
        if cached is not None and cached.is_file():
            with self.stats.lock:
                self.stats.cache_hits += 1
            return cached.read_bytes()
        data, retries = self.retrying(transport.where(name), lambda: transport.get(name, start, end, etag, size))
        self.stats.add(len(data), retries)
        if cached is not None:
            store(cached, data)
        return data

    # --- the Storage interface ------------------------------------------------------------------------
    def open(self, uri: str | os.PathLike) -> Checkpoint:
        uri = canonical_remote(os.fspath(uri))
        folder, single = split_location(uri)
        t = self.transport(folder)
        listing = None if single else self.retrying(uri, t.list)[0]
        weight_map, names = self._weight_files(t, uri, single, listing)
        try:
            probes = list(self.pool.map(lambda n: self._layout(t, folder, n), names))
        except _Missing:
            if single or listing is not None or weight_map is not None:
                raise
            weight_map, names = self._bin_files(t, uri)  # no listing (HTTP, the Hub): a .bin checkpoint?
            probes = list(self.pool.map(lambda n: self._layout(t, folder, n), names))
        tensors, sizes, etags = {}, {}, {}
        for name, (found, size, etag) in zip(names, probes):
            for tname, info in found.items():
                if tname in tensors:
                    raise StorageError(f"{uri}: tensor {tname!r} appears in more than one shard")
                tensors[tname] = info
            sizes[name], etags[name] = size, etag
        if weight_map is not None:
            check_index(t.where(BIN_INDEX if names[0].endswith(".bin") else INDEX_NAME), weight_map, tensors)
        if not tensors:
            raise StorageError(f"{uri}: checkpoint holds no tensors")
        config = {}
        if not single and (listing is None or "config.json" in listing):
            raw = self._small(t, "config.json")
            config = checked_config(t.where("config.json"), json_object(t.where("config.json"), raw)) if raw else {}
        root = RemoteRoot(uri)
        ckpt = Checkpoint(root, [RemoteRoot(folder) / n for n in names], tensors, sizes, config)
        ckpt.storage = self
        ckpt.remote = {"folder": folder, "etags": etags, "listing": listing}
        return ckpt

    def _small(self, t, name: str) -> bytes | None:
        got, retries = self.retrying(t.where(name), lambda: t.fetch_all(name, MAX_JSON_BYTES))
        if got is None:
            return None
        data, fresh = got
        self.stats.add(len(data) if fresh else 0, retries)
        return data

    def _weight_files(self, t, uri: str, single: str | None, listing: list[str] | None):
        """(weight map or None, weight file names): safetensors first, else PyTorch ``.bin`` files."""
        if single:
            return None, [single]
        for index, default, suffix in ((INDEX_NAME, "model.safetensors", ".safetensors"),
                                       (BIN_INDEX, BIN_NAME, ".bin")):
            raw = self._small(t, index) if listing is None or index in listing else None
            if raw is not None:
                weight_map = index_weight_map(t.where(index), json_object(t.where(index), raw))
                return weight_map, sorted(set(weight_map.values()))
            if listing is None and suffix == ".safetensors":
                return None, [default]  # without a listing: the standard name (open falls back to .bin)
            names = [default] if listing is None else \
                [n for n in listing if n.endswith(suffix) and (suffix != ".bin" or n.startswith("pytorch_model"))]
            if names:
                return None, names
        raise StorageError(f"{uri}: no .safetensors (or pytorch_model*.bin) files at this location")

    def _bin_files(self, t, uri: str) -> tuple[dict | None, list[str]]:
        raw = self._small(t, BIN_INDEX)
        if raw is not None:
            weight_map = index_weight_map(t.where(BIN_INDEX), json_object(t.where(BIN_INDEX), raw))
            return weight_map, sorted(set(weight_map.values()))
        probe, _ = self.retrying(t.where(BIN_NAME), lambda: t.probe(BIN_NAME, 4))
        if probe is None:
            raise StorageError(f"{uri}: no model.safetensors, pytorch_model.bin or shard index at this location")
        return None, [BIN_NAME]

    def _layout(self, t, folder: str, name: str):
        """(tensors, size, etag) of one weight file: a safetensors header, or a .bin's zip directory."""
        return self._bin_layout(t, folder, name) if name.endswith(".bin") else self._header(t, folder, name)

    def _bin_layout(self, t, folder: str, name: str):
        """A ``.bin``'s tensors by range requests: its zip directory, data.pkl and each storage's local
        header (storage/torchbin.py reads the same bytes of a local file, never unpickling anything)."""
        return self._probed(t, folder, name, 4, lambda probe: parse_bin_bytes(
            RemoteBytes(self, t, name, probe.size, probe.etag), probe.size, t.where(name), name))

    def _header(self, t, folder: str, name: str):
        """(tensors, size, etag) of one weight file: its first 8 bytes, then exactly its header."""
        def parse(probe):
            n = header_length(t.where(name), probe.head, probe.size)
            raw = self.fetch(t, name, 8, 8 + n, probe.etag, probe.size)
            return header_tensors(t.where(name), raw, probe.size, name)
        return self._probed(t, folder, name, 8, parse)

    def _probed(self, t, folder: str, name: str, head: int, parse):
        """(tensors, size, etag) of one weight file: probed (its first ``head`` bytes, size and ETag), then
        ``parse(probe)`` unless the layout of that exact version (by ETag) is cached."""
        probe, retries = self.retrying(t.where(name), lambda: t.probe(name, head))
        if probe is None:
            raise _Missing(f"{t.where(name)}: not found")
        self.stats.add(len(probe.head), retries)
        key = (folder, name, probe.etag, probe.size)
        with _HEADER_CACHE_LOCK:
            hit = _HEADER_CACHE.get(key) if probe.etag else None
        if hit is None:
            hit = parse(probe)
            if probe.etag:
                with _HEADER_CACHE_LOCK:
                    _HEADER_CACHE[key] = hit
                    while len(_HEADER_CACHE) > 512:
                        _HEADER_CACHE.popitem(last=False)
        return hit, probe.size, probe.etag

    def open_adapter(self, uri: str) -> LoraAdapter:
        """A PEFT LoRA adapter folder: adapter_config.json (one small GET) and the header of its
        adapter_model.safetensors (range requests), as for a checkpoint."""
        uri = canonical_remote(os.fspath(uri)).rstrip("/")
        t = self.transport(uri)
        raw = self._small(t, ADAPTER_CONFIG)
        if raw is None:
            raise CatalogError(f"{uri}: not a PEFT adapter (no {ADAPTER_CONFIG})")
        where = t.where(ADAPTER_CONFIG)
        config = checked_config(where, json_object(where, raw))
        probe, _ = self.retrying(t.where(ADAPTER_WEIGHTS), lambda: t.probe(ADAPTER_WEIGHTS, 0))
        if probe is None:
            raise CatalogError(f"{uri}: no {ADAPTER_WEIGHTS} (an adapter saved as adapter_model.bin is not "
                               "supported: save it with safe_serialization=True)")
        return adapter_of(RemoteRoot(uri), config, self.open(f"{uri}/{ADAPTER_WEIGHTS}"))

    def size(self, checkpoint: Checkpoint, fname: str) -> int:
        return checkpoint.file_sizes[fname]

    def reader(self, checkpoint: Checkpoint, sequential: bool = False) -> RemoteReader:
        return RemoteReader(self, checkpoint)

    def fingerprint(self, checkpoint: Checkpoint) -> str:
        """sha256 over the layout, file sizes and ETags (a Hub revision's files have content ETags)."""
        h = hashlib.sha256(checkpoint.headers_digest_source())
        h.update(json.dumps(sorted(checkpoint.remote["etags"].items()), default=str).encode())
        return "sha256:" + h.hexdigest()

    def stamp(self, uri: str | os.PathLike) -> str | None:
        return None  # a re-check re-opens: range requests of a few bytes, headers from the ETag-keyed cache

    def side_files(self, checkpoint: Checkpoint) -> dict[str, bytes] | None:
        """config.json and the tokenizer/generation files at the checkpoint's folder (for a merged model)."""
        return self._folder_files(checkpoint.remote["folder"], checkpoint.remote["listing"])

    def tokenizer_files(self, uri: str) -> dict[str, bytes]:
        """The tokenizer files (and generation_config.json) at a remote folder, each fetched whole."""
        folder = split_location(canonical_remote(os.fspath(uri)))[0]
        t = self.transport(folder)
        listing = self.retrying(folder, t.list)[0]
        return {n: b for n, b in self._folder_files(folder, listing).items() if n != "config.json"}

    def _folder_files(self, folder: str, listing: list[str] | None) -> dict[str, bytes]:
        t = self.transport(folder)
        names = SIDE_FILES if listing is None else [n for n in listing if n == "config.json" or is_tokenizer_file(n)]
        out = {}
        for name in names:
            data = self._small(t, name)
            if data is not None:
                out[name] = data
        return out


# --- the built-in backends ------------------------------------------------------------------------------
def http_storage() -> RemoteStorage:
    return RemoteStorage("http", lambda folder: HttpTransport(folder, folder,
                                                              connections=env_int("MERGEPIPE_REMOTE_CONNECTIONS", 16)))


def hf_storage() -> RemoteStorage:
    def make(folder: str):
        ref = parse_hf(folder)
        token = hf_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return HttpTransport(ref.base_url(hf_endpoint()), folder, headers,
                             connections=env_int("MERGEPIPE_REMOTE_CONNECTIONS", 16))

    return RemoteStorage("hf", make)


def s3_storage() -> RemoteStorage:
    return RemoteStorage("s3", S3Transport)


BUILTIN = {"s3": s3_storage, "http": http_storage, "https": http_storage, "hf": hf_storage}
