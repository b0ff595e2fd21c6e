"""`merge --extend` checks its parent snapshot's files against the sha256 in the parent's manifest while it
reads them (issue 28): a value changed in place, with the file's size and mtime restored, is refused in one
`error:` line naming the file, and nothing is published."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest

from merge_helpers import STAGING_MARK, copy_catalog, manifest_of, rows, run_cli_proc, shared_family
from mergepipe.storage.registry import open_checkpoint


@pytest.fixture
def snap(tmp_path_factory, tmp_path):
    db = copy_catalog(shared_family(tmp_path_factory, "tiny-fp32"), tmp_path / "c.sqlite")
    r = run_cli_proc(["--db", db, "merge", "--base", "base", "--experts", "e1", "e2", "--op", "task_arithmetic",
                      "--out", tmp_path / "a"])
    assert r.returncode == 0, r.stderr
    return db


def tamper_one_value(snapshot: Path) -> tuple[str, float, float]:
    """Add 1 to one fp32 value of a tensor in place, keeping the file's size and mtime; (file, old, new)."""
    ck = open_checkpoint(str(snapshot))
    info = max((t for t in ck.tensors.values() if t.dtype == "F32"), key=lambda t: t.nbytes)
    path = snapshot / info.file
    st = path.stat()
    offset = info.offset + (info.nbytes // 8) * 4
    with open(path, "r+b") as fh:
        fh.seek(offset)
        (old,) = struct.unpack("<f", fh.read(4))
        fh.seek(offset)
        fh.write(struct.pack("<f", old + 1.0))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    return info.file, old, old + 1.0


def test_extend_refuses_a_parent_changed_in_place_with_its_mtime_restored(snap, tmp_path):
    fname, _, _ = tamper_one_value(tmp_path / "a")
    tampered = (tmp_path / "a" / fname).read_bytes()
    r = run_cli_proc(["--db", snap, "merge", "--extend", "a", "--add", "e3", "--out", tmp_path / "b"])
    sid = manifest_of(tmp_path / "a")["run"]["snapshot_id"]
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == (f"error: snapshot {sid}: {fname} does not match the sha256 in its manifest (changed since "
                        f"it was published); nothing was published (`mergepipe verify {sid}`)\n")
    assert not (tmp_path / "b").exists() and not [p for p in tmp_path.iterdir() if STAGING_MARK in p.name]
    assert [x["model_id"] for x in rows(snap, "SELECT model_id FROM snapshots")] == ["a"]
    assert rows(snap, "SELECT id FROM models WHERE id = 'b'") == []
    assert (tmp_path / "a" / fname).read_bytes() == tampered  # the parent's files are left as they are


def test_an_untouched_parent_extends_and_the_child_verifies(snap, tmp_path):
    r = run_cli_proc(["--db", snap, "merge", "--extend", "a", "--add", "e3", "--out", tmp_path / "b"])
    assert r.returncode == 0, r.stderr
    v = run_cli_proc(["--db", snap, "verify", "b"])
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.parametrize("order", ["in order", "reversed", "overflow"])
def test_file_hash_takes_ranges_in_any_order(tmp_path, monkeypatch, order):
    """The hash of a file fed its ranges in order, reversed (held back, then drained) or past the hold-back
    limit (hashed from storage): always the file's sha256; the header and gaps are read, nothing else."""
    from mergepipe.engine import extend as engine_extend
    from mergepipe.engine.extend import _FileHash
    data = os.urandom(300_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    if order == "overflow":
        monkeypatch.setattr(engine_extend, "PENDING_BYTES", 50_000)
    reads = []

    def read(offset, n):
        reads.append((offset, n))
        return data[offset:offset + n]
    fh = _FileHash(len(data), 1000, read)
    chunks = [(o, data[o:o + 40_000]) for o in range(1000, 250_000, 40_000)]  # the tail is never fed
    for o, c in (reversed(chunks) if order != "in order" else chunks):
        fh.feed(o, memoryview(c))
    assert fh.hexdigest() == hashlib.sha256(data).hexdigest()
    fed_end = chunks[-1][0] + len(chunks[-1][1])
    if order == "overflow":
        assert sum(n for _, n in reads) == 1000 + len(data)  # the header, then the whole file again
    else:
        assert reads == [(0, 1000), (fed_end, len(data) - fed_end)]
