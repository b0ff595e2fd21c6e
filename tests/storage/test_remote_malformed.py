"""Malformed HTTP answers are one `error:` line, never a traceback (issue 28), against a real server on
127.0.0.1 (tests/remote_helpers.py's RangeServer serving a real checkpoint, made to misbehave one way at a
time): a Content-Length that is not a number on a ranged probe (answered 200 or 206), a bad Content-Length
on the HEAD that follows a 416, a Content-Range with a 5,000-digit size, and a redirect to ``file://`` (or
another scheme). Registering refuses in one line with the catalog byte-identical; a merge reading the model
when the server turns bad publishes nothing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.family import make_family
from mergepipe.storage import remote

from merge_helpers import STAGING_MARK, cli_cmd, run_cli
from remote_helpers import RangeServer

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
HUGE = "9" * 5000


class Malformed(RangeServer):
    """A RangeServer whose answers to weight files (``*.safetensors``) go wrong in way ``mode``:

    * ``length-200``: a ranged GET answered 200 (Range ignored) with ``Content-Length: <length>``;
    * ``length-206``: the right 206 and Content-Range, with ``Content-Length: <length>``;
    * ``416-head``: every ranged GET answered 416, the HEAD that follows with ``Content-Length: <length>``;
    * ``huge-range``: a 206 whose Content-Range gives a 5,000-digit file size;
    * ``redirect``: every GET answered 302 to ``location``."""

    def __init__(self, root: Path):
        self.mode: str | None = None
        self.length = "abc"
        self.location = "file:///etc/passwd"
        super().__init__(root)
        self.httpd.handle_error = lambda request, client_address: None  # a refused answer drops its connection

    def _handler(self):
        base = super()._handler()
        server = self

        class Handler(base):
            def serve(self, body: bool):
                mode = server.mode if self.path.endswith(".safetensors") else None
                m = _RANGE.match((self.headers.get("Range") or "").strip())
                if mode == "redirect":
                    return self.raw(302, {"Location": server.location, "Content-Length": "0"})
                if mode == "416-head":
                    if m:
                        return self.raw(416, {"Content-Length": "0"})
                    return self.raw(200, {"Content-Length": server.length, "Connection": "close"})
                if mode in ("length-200", "length-206", "huge-range") and m:
                    return self.bad_range(mode, int(m[1]), int(m[2]) + 1)
                return super().serve(body)

            def bad_range(self, mode: str, start: int, end: int):
                found = server.resolve(self.path.split("?")[0])
                data = found[1].read_bytes()
                if mode == "length-200":
                    return self.raw(200, {"Content-Length": server.length, "Connection": "close"}, data)
                end = min(end, len(data))
                size = HUGE if mode == "huge-range" else str(len(data))
                length = server.length if mode == "length-206" else str(end - start)
                return self.raw(206, {"Content-Length": length, "Content-Range": f"bytes {start}-{end - 1}/{size}",
                                      "Connection": "close"}, data[start:end])

            def raw(self, status: int, headers: dict, body: bytes = b""):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command == "GET" and body:
                    try:
                        self.wfile.write(body)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                self.close_connection = headers.get("Connection") == "close"

        return Handler


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-malformed")
    fam = make_family(root / "org", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=9)
    return root, fam


@pytest.fixture(autouse=True)
def fresh_remote_state(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    monkeypatch.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)
    remote._HEADER_CACHE.clear()  # every test probes its server afresh


def url_of(server, root: Path, p) -> str:
    return server.files_url(str(Path(p).relative_to(root)))


def one_error_line(res) -> str:
    lines = res.stderr.splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    return lines[0]


CASES = [
    ("length-200", dict(length="abc"), "the server sent an invalid Content-Length 'abc' (HTTP 200)"),
    ("length-200", dict(length="-1"), "the server sent an invalid Content-Length '-1' (HTTP 200)"),
    ("length-206", dict(length="abc"), "the server sent an invalid Content-Length 'abc' (HTTP 206)"),
    ("416-head", dict(length="abc"), "the server sent an invalid Content-Length 'abc' (HTTP 200)"),
    ("416-head", dict(length=HUGE), "the server sent an invalid Content-Length '" + "9" * 76),
    ("huge-range", {}, "the server's Content-Range gives no file size"),
    ("redirect", dict(location="file:///etc/passwd"), "the server redirected to a location MergePipe does not read"),
    ("redirect", dict(location="file://localhost/etc/passwd"), "the server redirected to a location"),
    ("redirect", dict(location="ftp://127.0.0.1/model.safetensors"), "the server redirected to a location"),
]


@pytest.mark.parametrize("mode,settings,message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_registering_from_a_malformed_server_is_one_error_line(family, tmp_path, mode, settings, message):
    root, fam = family
    db = tmp_path / "c.sqlite"
    cat = Catalog(db)
    register(cat, "base", str(fam["base"]))
    cat.close()
    before = db.read_bytes()
    with Malformed(root) as server:
        server.mode = mode
        for k, v in settings.items():
            setattr(server, k, v)
        url = url_of(server, root, fam["experts"][0])
        res = run_cli(["register", "--db", db, "--model-id", "r1", "--uri", url, "--base", "base"])
    line = one_error_line(res)
    assert line.startswith(f"error: {server.url}/files/") and ".safetensors: " in line, line
    assert message in line, line
    assert len(line) < 400
    assert db.read_bytes() == before


def test_the_real_cli_refuses_a_redirect_to_a_local_file_in_one_line(family, tmp_path):
    root, fam = family
    db = tmp_path / "c.sqlite"
    with Malformed(root) as server:
        server.mode = "redirect"
        url = url_of(server, root, fam["experts"][0])
        res = subprocess.run(cli_cmd() + ["--db", str(db), "register", "--model-id", "r1", "--uri", url],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MERGEPIPE_REMOTE_BACKOFF": "0.01"})
    line = one_error_line(res)
    assert "redirected to a location MergePipe does not read" in line and "root:" not in res.stderr


@pytest.mark.parametrize("mode", ["length-200", "length-206", "416-head", "redirect"])
def test_a_merge_reading_a_model_whose_server_turns_malformed_publishes_nothing(family, tmp_path, mode):
    root, fam = family
    db = tmp_path / "c.sqlite"
    with Malformed(root) as server:
        cat = Catalog(db)
        register(cat, "base", str(fam["base"]))
        register(cat, "e1", str(fam["experts"][0]), base_id="base")
        register(cat, "r2", url_of(server, root, fam["experts"][1]), base_id="base")
        analyze(cat, block_bytes=16 << 10)
        cat.close()
        remote._HEADER_CACHE.clear()
        server.mode = mode
        before = db.read_bytes()
        res = run_cli(["merge", "--db", db, "--base", "base", "--experts", "e1", "r2", "--op", "task_arithmetic",
                       "--out", tmp_path / "out"])
    line = one_error_line(res)
    assert server.url in line, line
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if STAGING_MARK in p.name]
    assert db.read_bytes() == before
