"""The watcher's scan (issue 17): find checkpoints under watched folders, notice new or changed ones by
fingerprint, register and analyze them for a recipe.

Each immediate sub-folder of a watched folder holding ``*.safetensors`` (or a PEFT adapter) is a
checkpoint; its folder name is its model id. A checkpoint is taken once its fingerprint is the same on
two scans in a row (a folder still being copied changes between scans) and, for a full checkpoint, its
sampled data is written (not zeros where the base holds data: a writer that preallocated its files and
stalled looks quiet too; config/watch_ready.py). A changed checkpoint is
registered again (replacing its row: the old statistics no longer match its fingerprint, so they are
never used) and analyzed again. The state -- which folder was seen with which fingerprint, and how far it
got -- lives in the catalog (``watch_seen``), so a watcher killed at any point starts where it was.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mergepipe.analyze.runner import analyze
from mergepipe.catalog import recipes as store
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import open_files, register
from mergepipe.config.watch_ready import unwritten
from mergepipe.errors import MergePipeError


def checkpoint_dirs(dirs) -> list[Path]:
    out = []
    for d in dirs:
        d = Path(d).expanduser()
        if not d.is_dir():
            raise MergePipeError(f"{d}: not a directory (watch takes folders that hold checkpoint folders)")
        out += sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and (any(p.glob("*.safetensors")) or (p / "adapter_config.json").exists()))
    return out


def _kind(path: Path) -> str:
    return "lora" if (path / "adapter_config.json").exists() else "full"


def _fingerprint(path: Path) -> str | None:
    """The checkpoint's fingerprint now; None while it cannot be read (still being written)."""
    try:
        return open_files(_kind(path), str(path)).fingerprint()
    except (MergePipeError, OSError, ValueError):
        return None


def scan(catalog: Catalog, dirs, base_id: str, log) -> list[str]:
    """One pass: register and analyze what is new or changed and stable; returns the model ids taken."""
    seen = store.watch_seen(catalog)
    taken = []
    for path in checkpoint_dirs(dirs):
        key = str(path.resolve())
        fp = _fingerprint(path)
        if fp is None:
            continue
        prev = seen.get(key)
        if prev and prev["fingerprint"] == fp and prev["status"] in ("analyzed", "failed", "skipped", "unwritten"):
            continue
        if not prev or prev["fingerprint"] != fp:  # first sight of this content: take it on the next scan
            store.set_watch_seen(catalog, key, path.name, fp, "pending")
            continue
        if _unwritten(catalog, path, key, fp, base_id, log):
            continue
        try:
            taken.append(_take(catalog, path, key, fp, base_id, log))
        except MergePipeError as exc:  # not retried until its files change
            log(f"warning: {path}: {exc}")
            store.set_watch_seen(catalog, key, path.name, fp, "failed")
    return [t for t in taken if t]


def _unwritten(catalog: Catalog, path: Path, key: str, fp: str, base_id: str, log) -> bool:
    """A full checkpoint whose sampled data is still zeros (a stalled writer that preallocated its files) waits,
    until its files change (config/watch_ready.py)."""
    if _kind(path) != "full":
        return False
    try:
        why = unwritten(path, catalog.model(base_id)["uri"])
    except (MergePipeError, OSError):
        return False  # registering it gives the one error
    if why:
        log(f"waiting: {path}: {why}; it is taken once its files change")
        store.set_watch_seen(catalog, key, path.name, fp, "unwritten")
    return why is not None


def _take(catalog: Catalog, path: Path, key: str, fp: str, base_id: str, log) -> str | None:
    model_id = path.name
    existing = catalog.model(model_id) if catalog.has_model(model_id) else None
    if existing and Path(existing["uri"]).resolve() != path.resolve():
        log(f"warning: skipping {path}: model id {model_id!r} is registered from {existing['uri']}")
        store.set_watch_seen(catalog, key, model_id, fp, "skipped")
        return None
    changed = existing is not None
    register(catalog, model_id, str(path), base_id=base_id, kind=_kind(path), replace=True)
    log(f"{'re-registered (changed)' if changed else 'registered'} {model_id} from {path}")
    analyze(catalog, [model_id])
    log(f"analyzed {model_id}")
    store.set_watch_seen(catalog, key, model_id, fp, "analyzed")
    return model_id


class WatchLock:
    """One watcher per catalog: an exclusive flock on ``<catalog>.watch.lock`` (the kernel releases it
    when the process dies, even by SIGKILL)."""

    def __init__(self, db_path):
        self.path = Path(f"{db_path}.watch.lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise MergePipeError(f"another `mergepipe watch` is running on this catalog ({self.path} is locked)") from None

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
