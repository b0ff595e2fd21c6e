"""``mergepipe serve DIR``: a small read-only HTTP server for remote reads of the checkpoints under DIR.

What MergePipe's HTTP reads need, and what ``python -m http.server`` lacks: single byte ranges (``Range:
bytes=a-b``, ``bytes=a-``, ``bytes=-n``) answered 206 with a Content-Range, 416 with ``bytes */size`` for a
range past the end, HEAD, and a strong ETag (size, mtime and inode) with Last-Modified and ``If-None-Match``
(304). GET and HEAD only; files only (no listings); a path that leaves DIR (``..``, a symlink pointing out,
an encoded slash) or names a hidden file or folder is 404. It listens on 127.0.0.1 unless a host is given
explicitly (``allow_remote``): anyone who can reach it can read every file under DIR."""

from __future__ import annotations

import email.utils
import hashlib
import ipaddress
import re
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mergepipe.errors import StorageError

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000
CHUNK = 1 << 20
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(root, port: int = DEFAULT_PORT, host: str = LOOPBACK, allow_remote: bool = False,
          on_ready=None) -> None:
    """Serve the files under ``root`` read-only until interrupted (KeyboardInterrupt ends it quietly).
    ``on_ready(url, loopback)`` is called once listening (``port`` 0: a free port; ``loopback``: reachable
    from this machine only); a host that is not loopback is refused unless ``allow_remote``."""
    server = make_server(root, port, host, allow_remote)
    stop_on_signals()
    try:
        if on_ready is not None:
            on_ready(server_url(server), is_loopback(host))
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM end the server, even when it was started with SIGINT ignored (a background job of a
    script, a child of a process that ignores it: Python then keeps SIGINT ignored), when this is the main
    thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def make_server(root, port: int = DEFAULT_PORT, host: str = LOOPBACK, allow_remote: bool = False):
    """The listening (not yet serving) server: ``serve_forever()`` to serve, ``server_close()`` to end."""
    folder = _check_root(root)
    if not allow_remote and not is_loopback(host):
        raise StorageError(f"{host} is not a loopback address: serving there lets anyone who can reach it read "
                           f"every file under {folder}; give the host explicitly (--host) to do so")
    if not 0 <= port <= 65535:
        raise StorageError(f"port {port} is not in 0..65535")
    handler = type("Handler", (_Handler,), {"root": folder})
    server_class = _Server6 if ":" in host else _Server
    try:
        return server_class((host, port), handler)
    except OSError as exc:
        raise StorageError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port, or "
                           f"--port 0 for a free one)") from None


def server_url(server) -> str:
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_root(root) -> Path:
    folder = Path(root).expanduser()
    if not folder.exists():
        raise StorageError(f"{folder}: no such directory")
    if not folder.is_dir():
        raise StorageError(f"{folder} is not a directory")
    return folder.resolve()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Closing does not wait for the connection threads: a client's idle keep-alive connection (a reader's pool)
    # would hold a thread, and an interrupted server would never exit.
    block_on_close = False
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """A client that goes away mid-answer is normal (a reader cancelled, a retry): not a traceback on
        stderr for each one, which could also fill a pipe nobody reads and stall the server; anything else
        is one line."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        print(f"mergepipe serve: {client_address[0]}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mergepipe-serve"
    disable_nagle_algorithm = True
    root: Path

    def log_message(self, *args) -> None:  # thousands of ranged reads per merge: not logged
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _read_only(self) -> None:
        self.close_connection = True  # its body, if any, is not read
        self._empty(405, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _read_only

    def _answer(self, body: bool) -> None:
        full = resolve(self.root, self.path)
        if full is None:
            return self._empty(404)
        st = full.stat()
        size, etag = st.st_size, file_etag(st)
        headers = {"ETag": etag, "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
                   "Accept-Ranges": "bytes"}
        if _etags(self.headers.get("If-None-Match")) & {etag, "*"}:
            return self._empty(304, headers)
        span = self._range(size, etag)
        if span == "unsatisfiable":
            return self._empty(416, {**headers, "Content-Range": f"bytes */{size}"})
        start, end = span or (0, size)
        self.send_response(206 if span else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        if span:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if body:
            self._send(full, start, end)

    def _range(self, size: int, etag: str):
        """(start, end) of a satisfiable single range, "unsatisfiable", or None: the whole file (no Range, a
        form this server does not answer -- several ranges -- or an If-Range naming another version)."""
        header = self.headers.get("Range")
        if header is None or self.headers.get("If-Range", etag) != etag:
            return None
        m = _RANGE.match(header.strip())
        if m is None or (m[1] == "" and m[2] == ""):
            return None
        if m[1] == "":  # the last n bytes
            n = int(m[2])
            return (max(size - n, 0), size) if n > 0 and size > 0 else "unsatisfiable"
        start = int(m[1])
        end = size if m[2] == "" else min(int(m[2]) + 1, size)
        if start >= size or end <= start:
            return "unsatisfiable"
        return start, end

    def _send(self, full: Path, start: int, end: int) -> None:
        try:
            with open(full, "rb") as fh:
                fh.seek(start)
                left = end - start
                while left > 0:
                    chunk = fh.read(min(CHUNK, left))
                    if not chunk:  # the file shrank while being sent: end the connection short
                        self.close_connection = True
                        return
                    self.wfile.write(chunk)
                    left -= len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _empty(self, status: int, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()


def resolve(root: Path, request_path: str) -> Path | None:
    """The file a request path names under ``root``, or None: outside ``root`` (``..``, a symlink pointing
    out, an absolute or encoded path), hidden (a part starting with '.'), not a regular file."""
    path = urlsplit(request_path).path
    parts = [unquote(p) for p in path.split("/") if p]
    if any(p.startswith(".") or "/" in p or "\\" in p or "\0" in p for p in parts) or not parts:
        return None
    full = root.joinpath(*parts)
    try:
        real = full.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if not real.is_relative_to(root) or not real.is_file():
        return None
    return real


def file_etag(st) -> str:
    """A strong ETag of one version of a file: its inode, size and modification time in nanoseconds."""
    return '"' + hashlib.sha256(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()[:24] + '"'


def _etags(header: str | None) -> set[str]:
    if not header:
        return set()
    return {t.strip().removeprefix("W/") for t in header.split(",")}
