"""Remote reads trust nothing a server says without checking it, against real servers on 127.0.0.1
(tests/remote_helpers.py's RangeServer, here made to misbehave in one way each):

* a 206 whose Content-Range names another range of the same length (or none) ends the merge in one
  ``error:`` line naming the file and the range, with nothing published and the catalog unchanged;
* the same on S3 (moto's server, behind a loopback proxy that moves the Range of GetObject requests);
* the optional block cache keys blocks by the file's URL as well as its ETag and size: two servers giving
  identical (nginx-style) ETags to different files of the same size each get their own bytes back;
* a config.json sent chunked (no Content-Length) is read no further than its size limit: longer than the
  limit, or endless, it is refused with one line, and the server could send at most the limit plus what
  the sockets buffer.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register, register_many
from mergepipe.research.family import make_family
from mergepipe.storage import remote
from mergepipe.storage.remote import http_storage
from mergepipe.storage.safetensors import MAX_JSON_BYTES

from merge_helpers import dump_db, run_cli
from remote_helpers import RangeServer, moto_s3, relay, upload_tree, upstream_headers

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
SLACK = 16 << 20  # what loopback socket buffers may hold beyond what the client read


class Misbehaving(RangeServer):
    """A RangeServer that can answer ranges starting at or past ``shift_from`` with the bytes ``shift_by``
    away (default one earlier; same length, an honest Content-Range of what it sent), omit Content-Range
    from ``omit_from``, give every file the ETag ``fixed_etag``, and send config.json chunked (no
    Content-Length): ``stream_bytes`` of valid JSON, or endless (``stream_bytes`` None, cut by the server
    only at ``stream_cap``)."""

    def __init__(self, root: Path, **kw):
        self.shift_from: int | None = None
        self.shift_by = -1
        self.omit_from: int | None = None
        self.fixed_etag: str | None = None
        self.stream_config = False
        self.stream_bytes: int | None = None
        self.stream_cap = 64 << 20
        self.stream_sent = 0
        super().__init__(root, **kw)
        # a client that refuses an answer drops its connection: not an error of this server worth printing
        # (it would print into the CLI's captured stderr, the server running in the test's process)
        self.httpd.handle_error = lambda request, client_address: None

    def _handler(self):
        base = super()._handler()
        server = self

        class Handler(base):
            def do_GET(self):
                path = self.path.split("?")[0]
                if server.stream_config and path.endswith("/config.json"):
                    return self.stream()
                m = _RANGE.match((self.headers.get("Range") or "").strip())
                if m and server.shift_from is not None and int(m[1]) >= server.shift_from:
                    del self.headers["Range"]
                    d = server.shift_by
                    self.headers["Range"] = f"bytes={int(m[1]) + d}-{int(m[2]) + d}"
                return super().do_GET()

            def send_header(self, keyword, value):
                if keyword == "ETag" and server.fixed_etag:
                    value = server.fixed_etag
                if keyword == "Content-Range" and server.omit_from is not None:
                    start = int(value.split()[1].split("-")[0])
                    if start >= server.omit_from:
                        return
                return super().send_header(keyword, value)

            def stream(self):
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                total = server.stream_bytes
                head, tail = b'{"model_type": "llama", "pad": "', b'"}'
                sent = 0
                try:
                    self.chunk(head)
                    sent += len(head)
                    limit = (total - len(head) - len(tail)) if total is not None else server.stream_cap
                    pad = b"x" * (64 << 10)
                    done = 0
                    while done < limit:
                        piece = pad[:min(len(pad), limit - done)]
                        with server.lock:  # counted before sending
                            server.stream_sent += len(piece)
                        self.chunk(piece)
                        done += len(piece)
                    self.chunk(tail)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def chunk(self, data: bytes):
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        return Handler


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-integrity")
    fam = make_family(root / "org", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=7)
    return root, fam


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    monkeypatch.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)


def shards(folder) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def data_start(folders) -> int:
    """The first offset past every shard's header (8 + header length): ranges from here are tensor data."""
    return max(8 + int.from_bytes(f.read_bytes()[:8], "little") for d in folders for f in shards(d))


def url_of(server, root: Path):
    return lambda p: server.files_url(str(Path(p).relative_to(root)))


# --- 1. a 206 answer is checked against its Content-Range -------------------------------------------------
@pytest.mark.parametrize("fault", ["shifted", "missing"])
def test_a_206_with_another_range_or_none_is_one_error_and_publishes_nothing(family, tmp_path, fault):
    root, fam = family
    models = [fam["base"], *fam["experts"]]
    with Misbehaving(root) as server:
        url = url_of(server, root)
        db = tmp_path / "c.sqlite"
        cat = Catalog(db)
        register(cat, "base", url(fam["base"]))
        register_many(cat, [(f"e{i}", url(e)) for i, e in enumerate(fam["experts"], 1)], base_id="base")
        analyze(cat, block_bytes=16 << 10, densities=(0.5,))
        cat.close()
        before = dump_db(db)
        start = data_start(models)
        if fault == "shifted":  # one bf16 value earlier: same length, finite values, a Content-Range saying so
            server.shift_from, server.shift_by = start, -2
        else:
            server.omit_from = start
        server.reset()
        res = run_cli(["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--op", "ties",
                       "--density", "0.5", "--budget", "100%", "--out", tmp_path / "out"])
        served = [r for r in server.ranges if r[1] >= start]
    assert served, "the merge read no tensor data over HTTP"
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, "a wrong model was published"
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    assert server.url in lines[0] and ".safetensors" in lines[0]
    m = re.search(r"asked for bytes (\d+)-(\d+)/(\d+)", lines[0])
    assert m and int(m[1]) >= start, lines[0]
    assert ("no Content-Range" in lines[0]) if fault == "missing" else \
        (f"Content-Range 'bytes {int(m[1]) - 2}-{int(m[2]) - 2}/{m[3]}'" in lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []
    after = dump_db(db)
    assert after["models"] == before["models"] and after.get("snapshots") == before.get("snapshots")


class RangeShiftingS3Proxy:
    """A loopback proxy in front of an S3 server that forwards every request, moving the Range of GETs of
    ``.safetensors`` objects starting at or past ``shift_from`` by ``shift_by`` bytes (S3 then answers that
    range, with a ContentRange saying so)."""

    def __init__(self, upstream: str):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        up = urlsplit(upstream)
        self.shift_from: int | None = None
        self.shift_by = -2
        self.moved = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = upstream_headers(self, up)
                m = _RANGE.match((self.headers.get("Range") or "").strip())
                if (self.command == "GET" and m and ".safetensors" in self.path and proxy.shift_from is not None
                        and int(m[1]) >= proxy.shift_from):
                    d = proxy.shift_by
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                    headers["Range"] = f"bytes={int(m[1]) + d}-{int(m[2]) + d}"
                    proxy.moved += 1
                relay(self, up, headers, body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128

            def handle_error(self, request, client_address):
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_an_s3_answer_with_another_range_is_one_error_and_publishes_nothing(family, tmp_path, monkeypatch):
    from mergepipe.storage import registry

    root, fam = family
    models = [fam["base"], *fam["experts"]]
    with moto_s3() as endpoint, RangeShiftingS3Proxy(endpoint) as proxy:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("integrity")
        upload_tree(root / "org", "integrity/org")
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        registry._BACKENDS.pop("s3", None)
        try:
            uri = lambda p: f"s3://integrity/org/{Path(p).name}"  # noqa: E731
            db = tmp_path / "c.sqlite"
            cat = Catalog(db)
            register(cat, "base", uri(fam["base"]))
            register_many(cat, [(f"e{i}", uri(e)) for i, e in enumerate(fam["experts"], 1)], base_id="base")
            analyze(cat, block_bytes=16 << 10, densities=(0.5,))
            cat.close()
            before = dump_db(db)
            start = data_start(models)
            proxy.shift_from = start
            res = run_cli(["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--op", "ties",
                           "--density", "0.5", "--budget", "100%", "--out", tmp_path / "out"])
        finally:
            registry._BACKENDS.pop("s3", None)
    assert proxy.moved > 0
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, "a wrong model was published"
    assert len(lines) == 1 and lines[0].startswith("error: s3://integrity/org/"), res.stderr
    m = re.search(r"asked for bytes (\d+)-(\d+)/(\d+), the server answered with Content-Range "
                  r"'bytes (\d+)-(\d+)/(\d+)'", lines[0])
    assert m and int(m[1]) >= start and int(m[4]) == int(m[1]) - 2 and m[3] == m[6], lines[0]
    assert not (tmp_path / "out").exists()
    after = dump_db(db)
    assert after["models"] == before["models"] and after.get("snapshots") == before.get("snapshots")


def test_a_probe_answered_with_another_range_is_refused(family, tmp_path):
    root, fam = family
    with Misbehaving(root) as server:
        server.shift_from, server.shift_by = 0, 8  # the 8-byte probe answered with bytes 8-15
        res = run_cli(["register", "--db", tmp_path / "c.sqlite", "--model-id", "base", "--uri",
                       url_of(server, root)(fam["base"])])
    assert res.returncode != 0
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    assert "asked for bytes 0-7/" in res.stderr and "Content-Range 'bytes 8-15/" in res.stderr, res.stderr
    assert "model.safetensors.index.json" not in res.stderr and ".safetensors" in res.stderr


# --- 2. the block cache is keyed by the file's URL, not only its ETag -------------------------------------
def test_the_block_cache_keeps_two_servers_with_the_same_etags_apart(family, tmp_path, monkeypatch):
    _, fam = family
    a_dir, b_dir = fam["experts"]  # same layout, same file sizes, different bytes
    assert [f.stat().st_size for f in shards(a_dir)] == [f.stat().st_size for f in shards(b_dir)]
    assert [f.read_bytes() for f in shards(a_dir)] != [f.read_bytes() for f in shards(b_dir)]
    monkeypatch.setenv("MERGEPIPE_REMOTE_CACHE", str(tmp_path / "cache"))
    root_a, root_b = Path(a_dir).parent, Path(b_dir).parent
    with Misbehaving(root_a) as sa, Misbehaving(root_b) as sb:
        for s in (sa, sb):
            s.fixed_etag = '"5f0c1a2b-10000"'  # nginx-style: mtime-size, the same for both files

        def read_all(server, folder) -> dict[str, bytes]:
            storage = http_storage()
            ckpt = storage.open(server.files_url(Path(folder).name))
            with storage.reader(ckpt) as reader:
                return {f: bytes(reader.read(f, 0, n)) for f, n in ckpt.file_sizes.items()}

        got_a = read_all(sa, a_dir)
        got_b = read_all(sb, b_dir)
        assert sb.total_bytes() > sum(f.stat().st_size for f in shards(b_dir)) // 2  # B's bytes came from B
        sb.reset()
        again_b = read_all(sb, b_dir)  # the cache still serves a repeated read of the same file
        assert sb.ranges and all(end <= 8 for _, _, end in sb.ranges), sb.ranges  # only the 8-byte probes
    assert got_a == {f.name: f.read_bytes() for f in shards(a_dir)}
    assert got_b == {f.name: f.read_bytes() for f in shards(b_dir)}, "server B's file was read from A's blocks"
    assert again_b == got_b


# --- 3. small files without a Content-Length are read no further than their limit --------------------
def test_a_chunked_config_longer_than_the_limit_is_refused_at_the_limit(family, tmp_path):
    root, fam = family
    with Misbehaving(root) as server:
        server.stream_config = True
        server.stream_bytes = MAX_JSON_BYTES + (1 << 20)  # valid JSON, just over the limit
        res = run_cli(["register", "--db", tmp_path / "c.sqlite", "--model-id", "base", "--uri",
                       url_of(server, root)(fam["base"])])
        sent = server.stream_sent
    assert res.returncode != 0, "a config.json over the limit was accepted"
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    assert "config.json" in res.stderr and f"{MAX_JSON_BYTES}-byte limit" in res.stderr
    assert sent <= MAX_JSON_BYTES + SLACK
    assert dump_db(tmp_path / "c.sqlite")["models"] == []


def test_an_endless_chunked_config_is_cut_at_the_limit(family, tmp_path, monkeypatch):
    root, fam = family
    limit = 1 << 20
    monkeypatch.setattr(remote, "MAX_JSON_BYTES", limit)
    result = {}
    with Misbehaving(root) as server:
        server.stream_config = True
        server.stream_bytes = None  # endless as far as any reader can tell (the server stops at 64 MiB)
        uri = url_of(server, root)(fam["base"])
        worker = threading.Thread(target=lambda: result.update(res=run_cli(
            ["register", "--db", tmp_path / "c.sqlite", "--model-id", "base", "--uri", uri])), daemon=True)
        worker.start()
        worker.join(60)  # the timeout guard: an unbounded read would still be reading
        assert not worker.is_alive(), "the endless config.json is still being read"
        sent = server.stream_sent
    res = result["res"]
    assert res.returncode != 0
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    assert "config.json" in res.stderr and f"{limit}-byte limit" in res.stderr
    assert sent <= limit + SLACK, f"the server sent {sent} bytes for a {limit}-byte limit"
    assert sent < server.stream_cap


def test_a_small_file_with_a_content_length_is_still_read_whole(family, tmp_path):
    """The bounded read changes nothing for an ordinary server (Content-Length given): config.json arrives."""
    root, fam = family
    with Misbehaving(root) as server:
        ckpt = http_storage().open(url_of(server, root)(fam["base"]))
    assert ckpt.config == json.loads((Path(fam["base"]) / "config.json").read_text())
