"""Real servers on loopback for the remote-storage tests and benchmark.

``RangeServer``: a threaded HTTP/1.1 server that serves a folder of checkpoints under Hub-shaped paths
``/{org}/{model}/resolve/{revision}/{file}`` (``root/{org}/{model}/{file}``) and plain paths
``/files/{path}`` (``root/{path}``), honouring single ``Range: bytes=a-b`` requests with 206 and
Content-Range, giving ETags, counting requests and body bytes per file, optionally limited to a
bandwidth (shared by all connections) and a per-request latency, and able to inject 500s or dropped connections.

``moto_s3``: moto's S3 in server mode on a free port, with the environment pointed at it.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_HUB = re.compile(r"^/(?P<org>[^/]+)/(?P<model>[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class Faults:
    """Fail data requests (ranges starting at or past ``min_offset``): skip ``skip`` of them, then fail
    ``count`` (-1: all) with ``mode`` "500" or "drop" (half the body, then the connection closes)."""

    def __init__(self, mode: str = "500", skip: int = 0, count: int = 0, min_offset: int = 0):
        self.mode, self.skip, self.count, self.min_offset = mode, skip, count, min_offset
        self.injected = 0
        self.lock = threading.Lock()

    def hit(self, start: int) -> str | None:
        with self.lock:
            if start < self.min_offset or self.count == 0:
                return None
            if self.skip > 0:
                self.skip -= 1
                return None
            if self.count > 0:
                self.count -= 1
            self.injected += 1
            return self.mode


class RangeServer:
    def __init__(self, root: Path, bandwidth: float | None = None, revisions=("main",), token: str | None = None,
                 latency: float = 0.0):
        self.root = Path(root)
        self.bandwidth = bandwidth  # bytes per second, all connections together
        self.latency = latency  # seconds each request waits before its response starts (a long link)
        self.revisions = set(revisions)
        self.token = token
        self.faults = Faults()
        self.lock = threading.Lock()
        self.bytes = defaultdict(int)  # file path (relative to root) -> body bytes sent
        self.requests = defaultdict(int)
        self.ranges: list[tuple[str, int, int]] = []  # (file, start, end) of every ranged GET
        self._next_send = time.monotonic()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # --- addresses -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def hub_url(self, repo: str, rev: str = "main") -> str:
        return f"{self.url}/{repo}/resolve/{rev}"

    def files_url(self, rel: str) -> str:
        return f"{self.url}/files/{rel}"

    # --- counters --------------------------------------------------------------------------------------
    def total_bytes(self, prefix: str = "") -> int:
        with self.lock:
            return sum(n for f, n in self.bytes.items() if f.startswith(prefix))

    def total_requests(self, prefix: str = "") -> int:
        with self.lock:
            return sum(n for f, n in self.requests.items() if f.startswith(prefix))

    def reset(self) -> None:
        with self.lock:
            self.bytes.clear()
            self.requests.clear()
            self.ranges.clear()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- serving ---------------------------------------------------------------------------------------
    def throttle(self, n: int) -> None:
        if not self.bandwidth:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + n / self.bandwidth
        delay = start + n / self.bandwidth - now
        if delay > 0:
            time.sleep(delay)

    def resolve(self, path: str) -> tuple[str, Path] | None:
        m = _HUB.match(path)
        if m:
            if m["rev"] not in self.revisions:
                return None
            rel = f"{m['org']}/{m['model']}/{m['file']}"
        elif path.startswith("/files/"):
            rel = path[len("/files/"):]
        else:
            return None
        full = (self.root / rel).resolve()
        if not full.is_file() or not full.is_relative_to(self.root.resolve()):
            return None
        return rel, full

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else each response waits out a delayed ACK (~40 ms)

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.serve(body=False)

            def do_GET(self):
                self.serve(body=True)

            def serve(self, body: bool):
                if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self.empty(401)
                found = server.resolve(self.path.split("?")[0])
                if found is None:
                    return self.empty(404)
                rel, full = found
                st = full.stat()
                etag = '"' + hashlib.sha256(f"{rel}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:20] + '"'
                start, end, status = 0, st.st_size, 200
                rng = self.headers.get("Range")
                if rng:
                    m = _RANGE.match(rng.strip())
                    if m is None:
                        return self.empty(416)
                    start = int(m[1])
                    end = min(st.st_size, int(m[2]) + 1) if m[2] else st.st_size
                    if start >= st.st_size or end <= start:
                        return self.empty(416, {"Content-Range": f"bytes */{st.st_size}"})
                    status = 206
                with server.lock:
                    server.requests[rel] += 1
                    if rng and body:
                        server.ranges.append((rel, start, end))
                if server.latency:
                    time.sleep(server.latency)
                if not rng and self.headers.get("If-None-Match") == etag:
                    return self.empty(304, {"ETag": etag})
                fault = server.faults.hit(start) if body and rng else None
                if fault == "500":
                    return self.empty(500)
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                self.send_header("ETag", etag)
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
                self.end_headers()
                if not body:
                    return
                self.send_body(full, start, end, fault == "drop")

            def send_body(self, full: Path, start: int, end: int, drop: bool):
                stop = start + (end - start) // 2 if drop else end
                with open(full, "rb") as fh:
                    fh.seek(start)
                    pos = start
                    while pos < stop:
                        chunk = fh.read(min(64 << 10, stop - pos))
                        server.throttle(len(chunk))
                        with server.lock:  # counted before sending: a client never sees bytes not yet counted
                            server.bytes[str(full.relative_to(server.root.resolve()))] += len(chunk)
                        try:
                            self.wfile.write(chunk)
                        except (BrokenPipeError, ConnectionResetError):
                            return
                        pos += len(chunk)
                if drop:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)

            def empty(self, status: int, headers: dict | None = None):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


@contextmanager
def moto_s3(monkeypatch=None):
    """moto's S3 server on 127.0.0.1 (free port); AWS_* variables point s3fs at it with dummy creds."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"http://{host}:{port}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def upload_tree(local: Path, bucket_prefix: str) -> None:
    """Copy a local folder's files into S3 at ``bucket/prefix`` (through s3fs)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for f in sorted(Path(local).rglob("*")):
        if f.is_file():
            fs.pipe_file(f"{bucket_prefix}/{f.relative_to(local)}", f.read_bytes())


def upstream_headers(handler, up) -> dict:
    """A proxied request's headers for the upstream server ``up`` (a urlsplit result)."""
    headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "expect")}
    headers["Host"] = up.netloc
    return headers


def relay(handler, up, headers: dict, body) -> None:
    """Send ``handler``'s request to ``up`` with ``headers`` and answer with the upstream's response."""
    import http.client
    conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
    conn.request(handler.command, handler.path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    handler.send_response(resp.status)
    head = handler.command == "HEAD"
    for k, v in resp.getheaders():
        if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
            handler.send_header(k, v)
    if not head:
        handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if not head:
        handler.wfile.write(data)
    conn.close()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops the SYNs of a burst of parallel connections (each then
    # waits 1 s for its retransmission); S3 accepts them
    request_queue_size = 128


class S3Proxy:
    """A loopback reverse proxy in front of an S3 server (moto) that logs every request (method, path,
    whether it is a server-side copy) in arrival order, can run a hook before a ranged GET, and answers ``fail_copies_after`` copy requests
    later with a real HTTP 500 (the S3 server is not asked): a server failing mid-upload. ``spans`` holds
    each request's (method, path, arrival, answer) times (time.monotonic); ``put_delay`` holds every plain
    PUT that long before forwarding it (a slow link); every plain PUT whose path contains
    ``fail_puts_matching`` is answered 500 (retries included)."""

    def __init__(self, upstream: str):
        from urllib.parse import urlsplit

        up = urlsplit(upstream)
        self.log: list[tuple[str, str, bool]] = []
        self.spans: list[tuple[str, str, float, float]] = []
        self.lock = threading.Lock()  # requests arrive on several threads at once
        self.put_delay = 0.0
        self.fail_puts_matching: str | None = None
        self.fail_copies_after: int | None = None
        # hold the copy request after that many until ``release`` is set (a process killed mid-upload)
        self.hold_copies_after: int | None = None
        self.held, self.release = threading.Event(), threading.Event()
        # called with (path, Range header) before a ranged GET is forwarded (e.g. to change the object)
        self.before_range_get = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self):
                start = time.monotonic()
                try:
                    self._answer()
                finally:
                    with proxy.lock:
                        proxy.spans.append((self.command, self.path, start, time.monotonic()))

            def _fail(self):
                msg = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                self.send_response(500)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

            def _take(self, counter: str) -> str:
                """'pass' while the counter is None or positive (counted down), else 'stop'."""
                with proxy.lock:
                    left = getattr(proxy, counter)
                    if left is None:
                        return "pass"
                    if left == 0:
                        return "stop"
                    setattr(proxy, counter, left - 1)
                    return "pass"

            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                copy = "x-amz-copy-source" in {k.lower() for k in self.headers}
                with proxy.lock:
                    proxy.log.append((self.command, self.path, copy))
                if self.command == "GET" and self.headers.get("Range") and proxy.before_range_get:
                    proxy.before_range_get(self.path.split("?")[0], self.headers["Range"])
                if copy and self._take("hold_copies_after") == "stop":
                    proxy.held.set()
                    proxy.release.wait(120)
                    self.close_connection = True
                    return
                if copy and self._take("fail_copies_after") == "stop":
                    return self._fail()
                if self.command == "PUT" and not copy:
                    time.sleep(proxy.put_delay)
                    if proxy.fail_puts_matching and proxy.fail_puts_matching in self.path:
                        return self._fail()
                relay(self, up, upstream_headers(self, up), body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = _ProxyServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.saved = os.environ.get("AWS_ENDPOINT_URL")
        os.environ["AWS_ENDPOINT_URL"] = self.url
        return self

    def __exit__(self, *exc):
        self.release.set()
        os.environ["AWS_ENDPOINT_URL"] = self.saved
        self.server.shutdown()
        self.server.server_close()


def family_catalog(path: Path, fam, uri, block_bytes: int):
    """A catalog of a family registered under ``uri(folder)`` (e.g. its loopback URL, or ``str`` for the local
    path) as base and e1, e2, ..., analyzed on a ``block_bytes`` grid (density 0.5 thresholds too)."""
    from mergepipe.analyze.runner import analyze
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register, register_many

    cat = Catalog(path)
    register(cat, "base", uri(fam["base"]))
    register_many(cat, [(f"e{i}", uri(e)) for i, e in enumerate(fam["experts"], start=1)], base_id="base")
    analyze(cat, block_bytes=block_bytes, densities=(0.5,))
    return cat
