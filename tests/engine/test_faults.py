"""Faults of the disk and the catalog file end in exactly one `error:` line (exit 2), publish nothing and
leave the catalog as it was: a full disk (ENOSPC: a real tiny tmpfs when root may mount one, else an
injected OSError, asserting the same things), EIO and EROFS at the output write and at the publishing
rename, a catalog that fills its disk during ANALYZE, and a read-only catalog.

Every command runs the real CLI in a subprocess (`python -c PATCH; main(argv)`), so the assertions are
about what a user sees: the exit status and the whole of stderr."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register

from merge_helpers import REPO_ROOT, STAGING_MARK, copy_catalog, dump_db, rows, shared_family

MERGE = ["merge", "--base", "base", "--experts", "e1", "e2", "--op", "ties", "--density", "0.3",
         "--budget", "60%"]

RUN = textwrap.dedent("""
    import sys
    from mergepipe.cli.app import main
    sys.exit(main(sys.argv[1:]))
""")

# Injected faults: the Nth positioned write of the output, or the publishing rename, raises OSError(errno).
WRITE_FAULT = textwrap.dedent("""
    import errno, os
    _real = os.pwrite
    _n = [0]
    def pwrite(fd, data, offset):
        _n[0] += 1
        if _n[0] >= {nth}:
            raise OSError(errno.{name}, os.strerror(errno.{name}))
        return _real(fd, data, offset)
    os.pwrite = pwrite
""")
RENAME_FAULT = textwrap.dedent("""
    import errno, os
    _real = os.rename
    def rename(a, b):
        if ".mergepipe-staging-" in str(a):
            raise OSError(errno.{name}, os.strerror(errno.{name}), str(a), None, str(b))
        return _real(a, b)
    os.rename = rename
""")


def run_mergepipe(args, patch: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", patch + RUN, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def can_mount() -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    probe = Path(f"/tmp/mergepipe-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                          capture_output=True).returncode != 0:
            return False
        subprocess.run(["umount", str(probe)], check=True)
        return True
    finally:
        probe.rmdir()


MOUNT = can_mount()


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only); unmounted however the test ends."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


def one_error_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in p.stderr
    print(lines[0])
    return lines[0]


def assert_nothing_published(db: Path, parent: Path, out: Path, before: dict) -> None:
    """No output, no staging directory, the catalog as it was (the txn row, committed first so that a
    crash can be cleaned up, is rolled back: 'aborted'; writing it bumps the change counter), and nothing
    left for `recover`."""
    assert not out.exists()
    assert not [p for p in parent.iterdir() if STAGING_MARK in p.name]

    def content(dump):
        return {t: [r for r in v if t != "meta" or r[0] != "change_counter"] for t, v in dump.items() if t != "txns"}
    assert content(dump_db(db)) == content(before)
    new_txns = [t for t in rows(db, "SELECT * FROM txns") if t["out"] == str(out)]
    assert [t["status"] for t in new_txns] == ["aborted"]
    cat = Catalog(db)
    try:
        from mergepipe.engine.txn import recovery_findings
        assert recovery_findings(cat) == []
    finally:
        cat.close()


def planned(tiny, tmp_path) -> tuple[Path, dict]:
    """A private catalog with the merge's plan already stored (so that only the merge itself runs)."""
    db = copy_catalog(tiny, tmp_path / "c.sqlite")
    p = run_mergepipe(["--db", db, "plan", *MERGE[1:]])
    assert p.returncode == 0, p.stderr
    return db, dump_db(db)


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_disk_full_during_merge(tiny, tmp_path, how):
    """ENOSPC while writing the output shards: a real full tmpfs (root), or an injected OSError (and the
    fallback for the tmpfs case when not root): the same assertions either way."""
    db, before = planned(tiny, tmp_path)
    if how == "tmpfs" and MOUNT:
        ctx, patch = tmpfs(tmp_path / "small-disk", "128k"), ""  # the output is ~430 KB
    else:
        (tmp_path / "small-disk").mkdir()
        ctx, patch = contextlib.nullcontext(tmp_path / "small-disk"), WRITE_FAULT.format(nth=5, name="ENOSPC")
    with ctx as parent:
        out = parent / "merged"
        p = run_mergepipe(["--db", db, *MERGE, "--out", out], patch)
        line = one_error_line(p, "no space left on device", "(ENOSPC)", "nothing was published", str(parent))
        assert line.startswith("error: writing ")
        assert_nothing_published(db, parent, out, before)


@pytest.mark.parametrize("name,text", [("EIO", "input/output error"), ("EROFS", "read-only file system")])
@pytest.mark.parametrize("where", ["write", "rename"])
def test_io_faults_during_merge(tiny, tmp_path, name, text, where):
    db, before = planned(tiny, tmp_path)
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "merged"
    patch = (WRITE_FAULT.format(nth=3, name=name) if where == "write" else RENAME_FAULT.format(name=name))
    p = run_mergepipe(["--db", db, *MERGE, "--out", out], patch)
    line = one_error_line(p, text, f"({name})", "nothing was published")
    assert line.startswith("error: writing " if where == "write" else "error: publishing ")
    if where == "rename":
        assert str(out) in line
    assert_nothing_published(db, parent, out, before)


FSYNC_FAULT = textwrap.dedent("""
    import errno, os
    _real = os.fsync
    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return _real(fd)
    os.fsync = fsync
""")


def test_io_error_at_fsync(tiny, tmp_path):
    """EIO from fsync (a write the disk could not complete): the same one line, nothing published."""
    db, before = planned(tiny, tmp_path)
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "merged"
    p = run_mergepipe(["--db", db, *MERGE, "--out", out], FSYNC_FAULT)
    line = one_error_line(p, "input/output error (EIO)", "nothing was published")
    assert line.startswith("error: flushing (fsync) ") and ".safetensors" in line
    assert_nothing_published(db, parent, out, before)


def fill(disk: Path, leave: int) -> None:
    """Fill the filesystem at ``disk`` until about ``leave`` bytes are free."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    if free > leave:
        with open(disk / "filler", "wb") as fh:
            fh.write(b"\0" * (free - leave))


@pytest.mark.skipif(not MOUNT, reason="needs root to mount a tmpfs (root ignores permission bits)")
def test_output_on_read_only_filesystem(tiny, tmp_path):
    """--out on a read-only filesystem (a real EROFS): refused before anything is staged or stored."""
    db = copy_catalog(tiny, tmp_path / "c.sqlite")
    before = dump_db(db)
    with tmpfs(tmp_path / "rodisk", "1m") as disk:
        remount_ro(disk)
        p = run_mergepipe(["--db", db, *MERGE, "--out", disk / "merged"])
        one_error_line(p, f"{disk}: cannot write there (read-only directory or filesystem)")
        assert not (disk / "merged").exists() and not list(disk.iterdir())
    assert dump_db(db) == before


def registered_catalog(tiny, db: Path) -> Path:
    cat = Catalog(db)
    try:
        register(cat, "base", str(tiny.base))
        for i, e in enumerate(tiny.experts[:2], start=1):
            register(cat, f"e{i}", str(e), base_id="base")
        cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        cat.close()
    return db


@pytest.mark.skipif(not MOUNT, reason="needs root to mount a tmpfs (the catalog must fill a real disk)")
def test_catalog_disk_full_during_analyze(tiny, tmp_path):
    """The catalog's disk fills while ANALYZE stores its statistics: one line, and no statistics at all."""
    src = registered_catalog(tiny, tmp_path / "src.sqlite")
    size = src.stat().st_size
    with tmpfs(tmp_path / "catdisk", f"{(size // 1024) + 96}k") as disk:
        db = disk / "c.sqlite"
        shutil.copyfile(src, db)
        before = dump_db(db)
        p = run_mergepipe(["--db", db, "analyze", "--block-bytes", 4096])
        line = one_error_line(p, str(db), "database or disk is full", "SQLITE_FULL")
        assert "free space" in line
        assert dump_db(db) == before
        assert not rows(db, "SELECT 1 FROM analyses")


@pytest.mark.skipif(not MOUNT, reason="needs root to mount a tmpfs (the catalog must fill a real disk)")
def test_catalog_disk_full_during_analyze_run(tiny, tmp_path):
    """An analyze run (the dashboard's, `--run-id`) whose catalog fills: the run is recorded as failed,
    with the reason, not left running; no statistics are stored."""
    src = registered_catalog(tiny, tmp_path / "src.sqlite")
    cat = Catalog(src)
    with cat.transaction():
        from mergepipe.catalog.runs import insert_analyze_run
        run_id = insert_analyze_run(cat, ["e1", "e2"])
    cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    cat.close()
    with tmpfs(tmp_path / "catdisk", f"{(src.stat().st_size // 1024) + 96}k") as disk:
        db = disk / "c.sqlite"
        shutil.copyfile(src, db)
        p = run_mergepipe(["--db", db, "analyze", "--run-id", run_id, "--block-bytes", 4096])
        one_error_line(p, "database or disk is full")
        (run,) = rows(db, "SELECT * FROM runs WHERE id = ?", [run_id])
        assert run["status"] == "failed" and "database or disk is full" in run["error"], run
        assert not rows(db, "SELECT 1 FROM analyses") and not rows(db, "SELECT 1 FROM blocks")


@pytest.mark.skipif(not MOUNT, reason="needs root to mount a tmpfs (the catalog must fill a real disk)")
def test_catalog_disk_full_during_register(tiny, tmp_path):
    """The catalog's disk fills while `register` writes: one line, nothing registered (one transaction)."""
    src = registered_catalog(tiny, tmp_path / "src.sqlite")
    with tmpfs(tmp_path / "catdisk", "2m") as disk:
        db = disk / "c.sqlite"
        shutil.copyfile(src, db)
        before = dump_db(db)
        fill(disk, 48 << 10)  # room for the WAL index (-shm, 32 KiB), not for the registration
        p = run_mergepipe(["--db", db, "register", "--base", "base", "--model-id", "e3", "--uri", tiny.experts[2]])
        one_error_line(p, f"catalog {db}: database or disk is full (SQLITE_FULL)")
        assert dump_db(db) == before
        p = run_mergepipe(["--db", db, "models", "--json"])  # reading needs no space
        assert p.returncode == 0 and '"e2"' in p.stdout, p.stderr


@pytest.mark.skipif(not MOUNT, reason="needs root to mount a tmpfs (root ignores permission bits)")
@pytest.mark.parametrize("command", [["register", "--base", "base", "{expert}"], ["analyze"], ["recover"],
                                     [*MERGE, "--out", "{out}"]])
def test_read_only_catalog(tiny, tmp_path, command):
    """A catalog on a read-only filesystem: commands that write say so at once; reading still works."""
    src = registered_catalog(tiny, tmp_path / "src.sqlite")
    with tmpfs(tmp_path / "rodisk", "4m") as disk:
        db = disk / "c.sqlite"
        shutil.copyfile(src, db)
        remount_ro(disk)
        args = [a.format(expert=tiny.experts[2], out=tmp_path / "merged") for a in command]
        p = run_mergepipe(["--db", db, *args])
        one_error_line(p, f"catalog {db} is read-only", "read-only filesystem", "writable copy")
        assert not (tmp_path / "merged").exists()
        p = run_mergepipe(["--db", db, "models", "--json"])
        assert p.returncode == 0, p.stderr
        assert "e2" in p.stdout


def test_read_only_catalog_by_permissions(tiny, tmp_path):
    """chmod 0444 file in a 0555 directory: root ignores the bits (and may write), anyone else gets the
    read-only error; either way no traceback."""
    src = registered_catalog(tiny, tmp_path / "src.sqlite")
    d = tmp_path / "locked"
    d.mkdir()
    db = d / "c.sqlite"
    shutil.copyfile(src, db)
    os.chmod(db, 0o444)
    os.chmod(d, 0o555)
    try:
        p = run_mergepipe(["--db", db, "recover"])
        if os.geteuid() == 0:
            assert p.returncode == 0, p.stderr
        else:
            one_error_line(p, f"catalog {db} is read-only", "the file is read-only")
    finally:
        os.chmod(d, 0o755)
        os.chmod(db, 0o644)
