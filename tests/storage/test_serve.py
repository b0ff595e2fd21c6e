"""`mergepipe serve DIR` (storage/serve.py): a read-only HTTP server with byte ranges that MergePipe's remote
reads work against, unlike `python -m http.server` (which answers a ranged GET with 200 and the whole file).

Asserted: a family served by the real command in a subprocess registers, analyzes and merges over
http://127.0.0.1:PORT/ to the same bytes as the merge of the local files; single ranges (a-b, a-, -n) are
206 with the exact Content-Range and bytes, past the end 416 `bytes */size`; HEAD, ETag, Last-Modified,
If-None-Match (304) and If-Range; nothing outside DIR is served (.., encoded dots, a symlink out, hidden
files, directories); writes are 405; a non-loopback host is refused unless asked for; bad input is one
`error:` line, exit 2."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from mergepipe.errors import StorageError
from mergepipe.research.family import make_family
from mergepipe.storage.serve import make_server, server_url

from merge_helpers import cli_cmd, dir_hashes, run_cli, run_cli_proc

MERGE = ["--op", "ties", "--density", "0.5", "--budget", "50%"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    fam = make_family(root / "fam", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=3)
    return root / "fam", fam


@pytest.fixture
def server(family):
    """The real command on a free port, in its own process; yields its URL."""
    root, _ = family
    proc = subprocess.Popen(cli_cmd() + ["serve", str(root), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {root.resolve()} at http://127.0.0.1:"), (line, proc.stderr.read())
        yield line.split(" at ")[1].split("/ ")[0]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)  # drains the pipes while waiting (a full pipe stalls the server)
        assert proc.returncode in (0, 130)
        assert "Traceback" not in err


def _merge(db: Path, out: Path, base: str, experts: list[str]) -> dict[str, str]:
    for args in (["register", "--db", db, "--model-id", "base", "--uri", base],
                 ["register", "--db", db, "--base", "base", "--model-id", "e1", "--uri", experts[0]],
                 ["register", "--db", db, "--base", "base", "--model-id", "e2", "--uri", experts[1]],
                 ["analyze", "--db", db, "--block-bytes", 16 << 10],
                 ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", *MERGE, "--out", out]):
        res = run_cli(args)
        assert res.returncode == 0, (args, res.stderr)
    return dir_hashes(out, "*.safetensors")


def test_merge_over_mergepipe_serve_equals_the_local_merge(family, server, tmp_path, monkeypatch):
    monkeypatch.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)
    root, fam = family
    local = _merge(tmp_path / "local.sqlite", tmp_path / "out-local", fam["base"], fam["experts"])
    remote = _merge(tmp_path / "remote.sqlite", tmp_path / "out-remote", f"{server}/base",
                    [f"{server}/{Path(e).name}" for e in fam["experts"]])
    assert remote == local and len(local) >= 1
    res = run_cli(["models", "--db", tmp_path / "remote.sqlite", "--json"])
    assert {m["id"]: m["uri"] for m in __import__("json").loads(res.stdout) if m["id"] in ("base", "e1")} == \
        {"base": f"{server}/base", "e1": f"{server}/expert_1"}


@pytest.fixture
def inproc(family):
    root, _ = family
    srv = make_server(root, port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, root
    srv.shutdown()
    srv.server_close()


def request(srv, method: str, path: str, headers: dict | None = None):
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


def test_single_ranges_heads_and_validators(inproc):
    srv, root = inproc
    shard = sorted((root / "base").glob("*.safetensors"))[0]
    data = shard.read_bytes()
    size, path = len(data), f"/base/{shard.name}"
    for rng, (a, b) in {"bytes=0-7": (0, 8), "bytes=100-": (100, size), "bytes=-16": (size - 16, size),
                        f"bytes=10-{size + 50}": (10, size)}.items():
        status, headers, body = request(srv, "GET", path, {"Range": rng})
        assert (status, headers["Content-Range"], body) == (206, f"bytes {a}-{b - 1}/{size}", data[a:b]), rng
        assert headers["Content-Length"] == str(b - a) and headers["Accept-Ranges"] == "bytes"
    for rng in (f"bytes={size}-", f"bytes={size + 5}-{size + 9}", "bytes=-0"):
        status, headers, body = request(srv, "GET", path, {"Range": rng})
        assert (status, headers["Content-Range"], body) == (416, f"bytes */{size}", b""), rng
    status, headers, body = request(srv, "GET", path)
    assert (status, body) == (200, data) and "Content-Range" not in headers
    etag, modified = headers["ETag"], headers["Last-Modified"]
    assert etag.startswith('"') and modified.endswith(" GMT")
    status, headers, body = request(srv, "HEAD", path)
    assert (status, headers["Content-Length"], headers["ETag"], body) == (200, str(size), etag, b"")
    assert request(srv, "GET", path, {"If-None-Match": etag})[0] == 304
    # several ranges, or an If-Range naming another version: the whole file, 200
    assert request(srv, "GET", path, {"Range": "bytes=0-1,4-5"})[:3:2] == (200, data)
    assert request(srv, "GET", path, {"Range": "bytes=0-7", "If-Range": '"other"'})[:3:2] == (200, data)
    assert request(srv, "GET", path, {"Range": "bytes=0-7", "If-Range": etag})[0] == 206


def test_nothing_outside_the_folder_is_served(inproc, tmp_path):
    srv, root = inproc
    secret = root.parent / "secret.txt"
    secret.write_text("secret")
    (root / "base" / ".hidden").write_text("hidden")
    link = root / "base" / "link.txt"
    if not link.exists():
        link.symlink_to(secret)
    for path in ("/../secret.txt", "/base/../../secret.txt", "/%2e%2e/secret.txt", "/base%2f..%2f..%2fsecret.txt",
                 "/base/link.txt", "/base/.hidden", "/base", "/", "/base/missing.json", "//etc/passwd",
                 f"/{secret}"):
        status, _, body = request(srv, "GET", path)
        assert (status, body) == (404, b""), path
    for method in ("PUT", "POST", "DELETE"):
        status, headers, _ = request(srv, method, "/base/config.json")
        assert (status, headers["Allow"]) == (405, "GET, HEAD"), method
    assert (root / "base" / "config.json").stat().st_size > 0


def test_only_loopback_unless_a_host_is_asked_for(family):
    root, _ = family
    with pytest.raises(StorageError, match="0.0.0.0 is not a loopback address"):
        make_server(root, port=0, host="0.0.0.0")
    srv = make_server(root, port=0, host="::1") if _has_ipv6() else make_server(root, port=0, host="localhost")
    try:
        assert server_url(srv).startswith(("http://[::1]:", "http://127.0.0.1:"))
    finally:
        srv.server_close()


def _has_ipv6() -> bool:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_bad_input_is_one_error_line(family, tmp_path):
    root, _ = family
    taken = make_server(root, port=0)
    port = taken.server_address[1]
    try:
        cases = {(str(tmp_path / "missing"),): f"error: {tmp_path / 'missing'}: no such directory",
                 (str(root / "base" / "config.json"),): f"error: {root / 'base' / 'config.json'} is not a directory",
                 (str(root), "--port", "70000"): "error: port 70000 is not in 0..65535",
                 (str(root), "--port", str(port)): f"error: cannot listen on 127.0.0.1:{port}: "}
        for args, want in cases.items():
            res = run_cli_proc(["serve", *args], timeout=30)
            assert res.returncode == 2 and res.stdout == "", (args, res)
            assert res.stderr.startswith(want) and res.stderr.count("\n") == 1, (args, res.stderr)
    finally:
        taken.server_close()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_server_started_with_sigint_ignored_still_stops(tmp_path, stop):
    """A background job of a script (or a child of a process that ignores SIGINT) starts with SIGINT ignored,
    which Python keeps: the server sets its own handlers, so Ctrl-C and SIGTERM end it."""
    (tmp_path / "a.txt").write_text("a")
    proc = subprocess.Popen(cli_cmd() + ["serve", str(tmp_path), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().startswith("serving ")
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "Traceback" not in err
