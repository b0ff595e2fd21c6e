"""Which local files may be read and written: allowed roots and regular files only.

When ``$MERGEPIPE_ALLOWED_ROOTS`` is set (``os.pathsep``-separated folders), every file MergePipe
reads (checkpoint shards, shard indexes, config.json, adapter configs, merge configs) and every output
it writes must resolve -- symbolic links followed -- inside one of them; unset, any path is allowed
(the command line acts for its user). Only regular files are opened: a FIFO, device or socket named
like a checkpoint is refused instead of blocking a reader forever. Files are opened ``O_NONBLOCK`` and
checked with ``fstat`` after opening, so a file swapped for a FIFO after the check cannot hang a read.
Error messages name paths, never file contents.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mergepipe.errors import StorageError

ROOTS_ENV = "MERGEPIPE_ALLOWED_ROOTS"


def expand_path(uri: str | os.PathLike) -> Path:
    """``uri`` with ``~`` expanded; a ``~user`` that does not exist is a StorageError (pathlib raises
    RuntimeError)."""
    try:
        return Path(uri).expanduser()
    except RuntimeError:
        raise StorageError(f"{uri}: cannot expand '~' (no such user or no home directory)") from None


def allowed_roots(env=None) -> list[Path] | None:
    """The resolved allowed folders from ``$MERGEPIPE_ALLOWED_ROOTS``; None when it is unset or empty."""
    raw = (os.environ if env is None else env).get(ROOTS_ENV, "")
    items = [p for p in raw.split(os.pathsep) if p.strip()]
    if not items:
        return None
    out: list[Path] = []
    for p in items:
        r = expand_path(p).resolve()
        if r not in out:
            out.append(r)
    return out


def inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def check_allowed(path: str | os.PathLike, roots: list[Path] | None = None) -> Path:
    """``path`` resolved (symlinks followed); refused when roots are set and it lies outside them."""
    roots = allowed_roots() if roots is None else roots
    resolved = expand_path(path).resolve()
    if roots and not inside(resolved, roots):
        shown = f"{path} (a link to {resolved})" if expand_path(path).absolute() != resolved else str(resolved)
        raise StorageError(f"{shown} is outside the allowed folders ({', '.join(map(str, roots))}); "
                           f"add its folder to {ROOTS_ENV} to allow it")
    return resolved


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file at ``path`` (inside the allowed roots when set)."""
    check_allowed(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"{path}: cannot open ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StorageError(f"{path}: is {_kind(mode)}, not a regular file")
    return fd


def read_regular(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """All bytes of a small regular file (refused past ``limit`` bytes)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise StorageError(f"{path}: {size} bytes is larger than the {limit}-byte limit for this file")
        chunks, done = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
            if limit is not None and done > limit:
                raise StorageError(f"{path}: larger than the {limit}-byte limit for this file")
        return b"".join(chunks)
    except OSError as exc:
        raise StorageError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def check_output(path: str | os.PathLike) -> Path:
    """An output folder to be created: inside the allowed roots when set (its parent resolved)."""
    p = expand_path(path).absolute()
    check_allowed(p.parent)
    return p
