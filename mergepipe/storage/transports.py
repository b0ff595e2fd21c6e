"""How a remote backend moves bytes: exact ranged GETs over HTTP(S) (also the Hub) and S3.

A transport addresses the files of one checkpoint location (a URL prefix or an S3 prefix) by name and
does one request per call; retries, coalescing and parallelism live in :mod:`mergepipe.storage.remote`.
Failures worth retrying (5xx, timeouts, dropped or short connections) raise :class:`Transient`;
anything else is a :class:`~mergepipe.errors.StorageError`.

Every ranged answer is checked against what was asked: its Content-Range must name exactly the bytes
requested and the file's size (a proxy or server that answers another range of the same length is an
error, never bytes of the wrong place), and a small file fetched whole is read no further than its size
limit, whatever its Content-Length says or omits (a chunked or endless body is cut at limit + 1 bytes).
A Content-Length that is not a plain number of bytes, and a redirect to anything but an http(s) URL
(``file://``, ``ftp://``), are one StorageError, never a traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mergepipe.errors import StorageError
from mergepipe.storage.uris import redact, split_s3


_CONTENT_RANGE = re.compile(r"^bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19})$")


class Transient(Exception):
    """A failure that may go away when the request is repeated."""


@dataclass(frozen=True)
class Probe:
    """The first bytes of a file, its size and its ETag (None when the server gives none)."""

    head: bytes
    size: int
    etag: str | None


def check_content_range(where: str, header: str | None, start: int, end: int, size: int | None) -> int:
    """The file size a ranged answer's Content-Range gives, when it names exactly bytes [start, end) (and
    ``size``, when known); otherwise one StorageError naming the file and the range asked for."""
    m = _CONTENT_RANGE.match((header or "").strip())
    if m and int(m[1]) == start and int(m[2]) == end - 1 and (size is None or int(m[3]) == size):
        return int(m[3])
    asked = f"bytes {start}-{end - 1}/{size if size is not None else '*'}"
    got = "no Content-Range" if header is None else f"Content-Range {_short(header)}"
    raise StorageError(f"{where}: asked for {asked}, the server answered with {got}; refusing bytes that may "
                       "come from another place in the file")


def _short(text: str, limit: int = 80) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def content_length(where: str, resp) -> int | None:
    """An answer's Content-Length: None when it gives none; one StorageError (the connection dropped) when it
    is not a plain decimal number of bytes (``abc``, ``-1``, ``1e9``, two differing values)."""
    value = resp.headers.get("Content-Length")
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        resp.close()
        raise StorageError(f"{where}: the server sent an invalid Content-Length {_short(value)} (HTTP {resp.status})")
    return int(text)


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise StorageError(f"${name} must be a number (is {os.environ[name]!r})") from None


class HttpTransport:
    """Ranged GETs (``Range: bytes=a-b``, answered 206) on a pooled urllib3 connection manager."""

    kind = "http"

    def __init__(self, base_url: str, shown: str, headers: dict | None = None, connections: int = 16):
        import urllib3

        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.shown = shown  # the URI as stored (no secrets), for messages
        self.headers = dict(headers or {})
        timeout = env_float("MERGEPIPE_REMOTE_TIMEOUT", 30.0)
        self.pool = urllib3.PoolManager(num_pools=4, maxsize=connections, block=False,
                                        timeout=urllib3.Timeout(connect=timeout, read=timeout),
                                        retries=urllib3.Retry(total=None, connect=0, read=0, status=0, redirect=5))
        self._urllib3 = urllib3
        self._small: dict[str, tuple[str, bytes]] = {}  # name -> (ETag, bytes) of small files fetched whole

    def url(self, name: str) -> str:
        return self.base_url + name

    def identity(self, name: str) -> str:
        """What names this file on the network (its full URL, the Hub endpoint included): with its ETag and
        size, the key of its cached blocks."""
        return self.url(name)

    def where(self, name: str) -> str:
        return f"{self.shown}/{name}"

    def _request(self, method: str, name: str, headers: dict):
        u3 = self._urllib3
        try:
            resp = self.pool.request(method, self.url(name), headers={**self.headers, **headers},
                                     preload_content=False)
        except (u3.exceptions.TimeoutError, u3.exceptions.ProtocolError, u3.exceptions.NewConnectionError,
                u3.exceptions.MaxRetryError, ConnectionError) as exc:
            raise Transient(f"{type(exc).__name__}") from None
        except u3.exceptions.LocationValueError as exc:  # the URL asked for is http(s): a redirect's Location
            raise StorageError(f"{self.where(name)}: the server redirected to a location MergePipe does not read "
                               f"(only http:// and https:// URLs are followed; {_short(str(exc))})") from None
        except u3.exceptions.HTTPError as exc:  # any other answer urllib3 cannot take (a malformed header)
            raise StorageError(f"{self.where(name)}: unusable answer from the server ({type(exc).__name__}: "
                               f"{_short(str(exc))})") from None
        if resp.status >= 500 or resp.status in (408, 429):
            resp.drain_conn()
            raise Transient(f"HTTP {resp.status}")
        return resp

    def _body(self, resp, expected: int | None) -> bytes:
        u3 = self._urllib3
        try:
            data = resp.read()
        except (u3.exceptions.TimeoutError, u3.exceptions.ProtocolError, ConnectionError) as exc:
            raise Transient(f"connection dropped ({type(exc).__name__})") from None
        finally:
            resp.release_conn()
        if expected is not None and len(data) != expected:
            raise Transient(f"short body ({len(data)} of {expected} bytes)")
        return data

    def _bounded_body(self, resp, name: str, limit: int, expected: int | None) -> bytes:
        """A whole body, read in pieces and stopped after ``limit`` + 1 bytes (then refused): a body sent
        chunked, without a Content-Length, or endless costs at most the limit in memory."""
        u3 = self._urllib3
        parts, got = [], 0
        try:
            while True:
                chunk = resp.read(min(1 << 20, limit + 1 - got))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
                if got > limit:
                    resp.close()  # drop the connection rather than read the rest
                    raise StorageError(f"{self.where(name)}: larger than the {limit}-byte limit for this file "
                                       "(sent without a Content-Length; stopped reading at the limit)")
        except (u3.exceptions.TimeoutError, u3.exceptions.ProtocolError, ConnectionError) as exc:
            resp.close()
            raise Transient(f"connection dropped ({type(exc).__name__})") from None
        resp.release_conn()
        data = b"".join(parts)
        if expected is not None and len(data) != expected:
            raise Transient(f"short body ({len(data)} of {expected} bytes)")
        return data

    def _refuse(self, resp, name: str):
        resp.drain_conn()
        if resp.status in (401, 403):
            raise StorageError(f"{self.where(name)}: access denied (HTTP {resp.status}); for the Hub set HF_TOKEN "
                               "or log in with `huggingface-cli login`")
        raise StorageError(f"{self.where(name)}: HTTP {resp.status}")

    def probe(self, name: str, n: int) -> Probe | None:
        resp = self._request("GET", name, {"Range": f"bytes=0-{n - 1}"})
        if resp.status == 404:
            resp.drain_conn()
            return None
        if resp.status == 416:  # shorter than n bytes: ask its size
            resp.drain_conn()
            return Probe(b"", self._size_of_empty(name), resp.headers.get("ETag"))
        if resp.status not in (200, 206):
            self._refuse(resp, name)
        if resp.status == 200:  # the server ignores Range: read no further than asked
            size = content_length(self.where(name), resp)
            head = resp.read(n)
            resp.close()  # drop the connection rather than download the rest
            if size is None:
                raise StorageError(f"{self.where(name)}: the server gives no Content-Length")
            return Probe(head, size, resp.headers.get("ETag"))
        content_length(self.where(name), resp)
        total = resp.headers.get("Content-Range", "").rpartition("/")[2]
        if not (total.isascii() and total.isdigit() and len(total) <= 19):
            resp.drain_conn()
            raise StorageError(f"{self.where(name)}: the server's Content-Range gives no file size")
        size, want = int(total), None
        if n > 0:
            want = min(n, size)
            try:
                check_content_range(self.where(name), resp.headers.get("Content-Range"), 0, want, size)
            except StorageError:
                resp.close()
                raise
        return Probe(self._body(resp, want), size, resp.headers.get("ETag"))

    def _size_of_empty(self, name: str) -> int:
        resp = self._request("HEAD", name, {})
        if resp.status != 200:
            self._refuse(resp, name)
        size = content_length(self.where(name), resp)
        resp.drain_conn()
        return 0 if size is None else size

    def get(self, name: str, start: int, end: int, etag: str | None, size: int | None = None) -> bytes:
        """Bytes [start, end) of ``name`` (of ``size`` bytes, when known), exactly: the answer's Content-Range
        must say so; a changed ETag is an error, not a retry."""
        resp = self._request("GET", name, {"Range": f"bytes={start}-{end - 1}"})
        if resp.status != 206:
            if resp.status == 200:
                resp.close()
                raise StorageError(f"{self.where(name)}: the server ignores Range requests (answered 200 to a "
                                   "ranged GET); MergePipe reads remote checkpoints only through byte ranges")
            self._refuse(resp, name)
        got = resp.headers.get("ETag")
        if etag and got and got != etag:
            resp.close()
            raise StorageError(f"{self.where(name)}: the file changed since it was opened (ETag {got} != {etag}); "
                               "re-register the model")
        content_length(self.where(name), resp)
        try:
            check_content_range(self.where(name), resp.headers.get("Content-Range"), start, end, size)
        except StorageError:
            resp.close()
            raise
        return self._body(resp, end - start)

    def fetch_all(self, name: str, limit: int) -> tuple[bytes, bool] | None:
        """A small file whole (config.json, a shard index) and whether it came over the wire (False:
        unchanged since fetched last, by its ETag); None when it does not exist."""
        known = self._small.get(name)
        resp = self._request("GET", name, {"If-None-Match": known[0]} if known else {})
        if resp.status == 404:
            resp.drain_conn()
            return None
        if resp.status == 304 and known:  # unchanged since last fetched: no body sent
            resp.drain_conn()
            return known[1], False
        if resp.status != 200:
            self._refuse(resp, name)
        size = content_length(self.where(name), resp)
        if size is not None and size > limit:
            resp.close()
            raise StorageError(f"{self.where(name)}: {size} bytes is larger than the {limit}-byte limit for this file")
        data = self._bounded_body(resp, name, limit, size)
        if resp.headers.get("ETag"):
            self._small[name] = (resp.headers["ETag"], data)
        return data, True

    def list(self) -> list[str] | None:
        return None  # plain HTTP cannot list a folder: files are found by their standard names

    def close(self) -> None:
        self.pool.clear()


class _Changed(Exception):
    """S3 refused a conditional read: the object's ETag is no longer the one it was opened with."""


class S3Transport:
    """S3 (or any S3-compatible store) through s3fs: exact ``cat_file`` ranges, no read-ahead blocks."""

    kind = "s3"

    def __init__(self, uri: str):
        try:
            import s3fs
        except ImportError:
            raise StorageError("s3:// needs the s3fs package: pip install 'mergepipe[remote]'") from None
        self.bucket, self.prefix = split_s3(uri)
        self.shown = uri
        # credentials and endpoint from the standard places only (AWS_* variables incl. AWS_ENDPOINT_URL,
        # ~/.aws/config and credentials); no listings cache: an ETag must be current
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        self._small: dict[str, tuple[str, bytes]] = {}  # name -> (ETag, bytes) of small files fetched whole

    def key(self, name: str) -> str:
        return "/".join(p for p in (self.bucket, self.prefix, name) if p)

    def where(self, name: str) -> str:
        return f"{self.shown}/{name}"

    def identity(self, name: str) -> str:
        """What names this object: its S3 key and the endpoint it is read from."""
        endpoint = getattr(self.fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL") or "aws"
        return f"s3://{self.key(name)} at {endpoint}"

    def _call(self, name: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, _Changed):
            raise
        except PermissionError:
            raise StorageError(f"{self.where(name)}: access denied; check AWS credentials (AWS_ACCESS_KEY_ID, "
                               "AWS_PROFILE) and the bucket policy") from None
        except (OSError, TimeoutError, ConnectionError) as exc:
            raise Transient(type(exc).__name__) from None
        except Exception as exc:  # botocore / aiohttp errors that s3fs does not translate
            if "NoCredentials" in type(exc).__name__:
                raise StorageError(f"{self.where(name)}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                                   "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)") from None
            raise Transient(type(exc).__name__) from None

    def probe(self, name: str, n: int) -> Probe | None:
        try:
            info = self._call(name, self.fs.info, self.key(name))
            if info.get("type") != "file":
                return None
            end = min(n, info["size"])
            head = self._range(name, 0, end, info.get("ETag"), int(info["size"])) if end else b""
        except FileNotFoundError:
            return None
        return Probe(head, int(info["size"]), info.get("ETag"))

    def get(self, name: str, start: int, end: int, etag: str | None, size: int | None = None) -> bytes:
        """Bytes [start, end) of ``name`` (of ``size`` bytes, when known), exactly: the answer's ContentRange
        must say so; with ``etag``, a GetObject with If-Match: the store refuses (412) when the object changed
        since it was opened, so a merge never mixes two versions' bytes."""
        try:
            return self._range(name, start, end, etag, size)
        except FileNotFoundError:
            raise StorageError(f"{self.where(name)}: no longer exists") from None

    def _range(self, name: str, start: int, end: int, etag: str | None, size: int | None) -> bytes:
        from fsspec.asyn import sync

        try:
            data, got = self._call(name, sync, self.fs.loop, self._get_object, self.key(name), start, end, etag)
        except _Changed:
            raise StorageError(f"{self.where(name)}: the object changed since it was opened (its ETag is no "
                               f"longer {etag}); re-register the model") from None
        check_content_range(self.where(name), got, start, end, size)
        if len(data) != end - start:
            raise Transient(f"short body ({len(data)} of {end - start} bytes)")
        return data

    async def _get_object(self, key: str, start: int, end: int, etag: str | None) -> tuple[bytes, str | None]:
        bucket, path, _ = self.fs.split_path(key)
        condition = {"IfMatch": etag} if etag else {}
        try:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=path, Range=f"bytes={start}-{end - 1}",
                                          **condition)
        except OSError as exc:
            cause = exc.__cause__ or exc.__context__
            if getattr(cause, "response", {}).get("Error", {}).get("Code") == "PreconditionFailed":
                raise _Changed() from None
            raise
        try:
            return await resp["Body"].read(), resp.get("ContentRange")
        finally:
            resp["Body"].close()

    def fetch_all(self, name: str, limit: int) -> tuple[bytes, bool] | None:
        probe = self.probe(name, 0)
        if probe is None:
            return None
        if probe.size > limit:
            raise StorageError(f"{self.where(name)}: {probe.size} bytes is larger than the {limit}-byte limit")
        known = self._small.get(name)
        if known and probe.etag and known[0] == probe.etag:  # unchanged since last fetched
            return known[1], False
        data = self.get(name, 0, probe.size, None, probe.size) if probe.size else b""
        if probe.etag:
            self._small[name] = (probe.etag, data)
        return data, True

    def list(self) -> list[str] | None:
        try:
            paths = self._call("", self.fs.ls, "/".join(p for p in (self.bucket, self.prefix) if p), detail=False)
        except FileNotFoundError:
            return []
        return sorted(p.rsplit("/", 1)[-1] for p in paths)

    def put(self, name: str, data: bytes) -> None:
        try:
            self._call(name, self.fs.pipe_file, self.key(name), data)
        except FileNotFoundError:
            raise StorageError(f"{self.where(name)}: the bucket does not exist") from None

    def remove(self, names: list[str]) -> None:
        for name in names:
            try:
                self._call(name, self.fs.rm_file, self.key(name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        pass


def describe(exc: Transient, where: str, attempts: int) -> str:
    return f"{redact(where)}: failed after {attempts} attempts ({exc})"
