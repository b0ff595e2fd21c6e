"""Paths the dashboard may read and write: the catalog, allowed roots, log and output folders."""

from __future__ import annotations

import os
from pathlib import Path

from mergepipe.errors import MergePipeError
from mergepipe.api import Catalog, ROOTS_ENV, env_allowed_roots as storage_roots


# --- paths -----------------------------------------------------------------------------------------
def db_path(env=None) -> Path:
    """The catalog the dashboard shows: $MERGEPIPE_DB (default ./mergepipe.sqlite), made absolute."""
    env = os.environ if env is None else env
    return Path(env.get("MERGEPIPE_DB") or "mergepipe.sqlite").expanduser().absolute()


def allowed_roots(db, env=None, cwd=None) -> list[Path]:
    """Folders the dashboard may read checkpoints from and write outputs into.

    ``$MERGEPIPE_ALLOWED_ROOTS`` (os.pathsep-separated) when set, else the working directory and the
    catalog's directory. Returned resolved (symlinks followed) and without duplicates. When the
    variable is unset in this process (the app started by hand), it is set to these defaults, so that
    the storage layer holds every file the app opens -- symlinks included -- to the same folders.
    """
    env = os.environ if env is None else env
    roots = storage_roots(env)
    if roots is None:
        roots = storage_roots({ROOTS_ENV: os.pathsep.join(
            [str(cwd or os.getcwd()), str(Path(db).expanduser().absolute().parent)])})
        env[ROOTS_ENV] = os.pathsep.join(map(str, roots))
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def _roots_text(roots: list[Path]) -> str:
    return ", ".join(str(r) for r in roots) or "none"


def check_path(path: str, roots: list[Path], must_exist: bool = True) -> Path:
    """A user-typed checkpoint path, resolved, refused unless it lies under an allowed root."""
    text = (path or "").strip()
    if not text:
        raise MergePipeError("enter a path")
    if "\x00" in text:
        raise MergePipeError("the path contains a NUL character")
    p = Path(text).expanduser()
    if not p.is_absolute():
        p = Path(os.getcwd()) / p
    resolved = p.resolve()
    if not _inside(resolved, roots):
        raise MergePipeError(f"{resolved} is outside the allowed folders ({_roots_text(roots)}); "
                             f"set MERGEPIPE_ALLOWED_ROOTS to allow it")
    if must_exist and not resolved.exists():
        raise MergePipeError(f"{resolved} does not exist")
    return resolved


def check_out_path(path: str, roots: list[Path]) -> Path:
    """A user-typed output directory: under an allowed root, not existing yet, parent creatable."""
    p = check_path(path, roots, must_exist=False)
    if p.exists() or p.is_symlink():
        raise MergePipeError(f"{p} already exists; published snapshots are never overwritten")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise MergePipeError(f"{parent} is not a directory")
    return p


def open_catalog(db) -> Catalog:
    """The catalog at ``db`` (the pages hold one per rerun or cached plan session and pass it to the views;
    they never query it themselves)."""
    return Catalog(str(db))


def log_dir(db) -> Path:
    """Where the dashboard's runs write their logs: next to the catalog."""
    p = Path(db).expanduser().absolute()
    return p.parent / f"{p.stem}-logs"


def default_out(db, plan_id: str, n: int) -> Path:
    p = Path(db).expanduser().absolute()
    short = plan_id.removeprefix("plan-")[:8]
    return p.parent / "merged" / f"merge-{short}-{n}"
