"""Compact deltas in the catalog: the ``compacts`` row of an expert (its compact file beside the catalog, the
codec, group size, grid and fingerprint it was made for) and one ``compact_blocks`` row per (tensor, block)
(offset in the file, entries, the exact error norm of each level).

A compact file is written under a temporary name, renamed into place inside the transaction that stores its
rows, and removed only by :func:`prune_files` (inside a write transaction, so it never races an ANALYZE that
is storing): a crash leaves either the old rows and file or the new ones, plus at most an unreferenced file
that the next prune (ANALYZE, delete, register, doctor) removes.
"""

from __future__ import annotations

import os
from pathlib import Path

from mergepipe.catalog.db import Catalog, now
from mergepipe.storage.procs import pid_alive

TMP_PREFIX = ".tmp-"


def compact_dir(catalog: Catalog) -> Path:
    """The folder of this catalog's compact files: ``<catalog file without suffix>.compacts`` beside it."""
    path = Path(catalog.path)
    return path.with_name(path.stem + ".compacts")


def tmp_path(catalog: Catalog, model_id: str) -> Path:
    """A fresh temporary file name for a compact being written by this process."""
    folder = compact_dir(catalog)
    folder.mkdir(exist_ok=True)
    return folder / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}.mpc"


def final_name(model_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)[:80]
    return f"{safe}-{os.urandom(6).hex()}.mpc"


def replace_compact(catalog: Catalog, row: dict, blocks: list[dict]) -> None:
    """Store an expert's compact row and block rows (inside the caller's transaction), replacing any old ones."""
    delete_rows(catalog, row["model_id"])
    catalog.db["compacts"].insert({**row, "created_at": now()})
    catalog.db["compact_blocks"].insert_all(blocks, batch_size=2000)


def delete_rows(catalog: Catalog, model_id: str) -> None:
    """Forget an expert's compacts (inside the caller's transaction; the file goes at the next prune)."""
    for table in ("compacts", "compact_blocks"):
        catalog.conn.execute(f"DELETE FROM {table} WHERE model_id = ?", [model_id])


def default_codec(catalog: Catalog) -> tuple[str, int] | None:
    """(codec, group size) the last `analyze --compact` used: what a first merge's analysis stores too."""
    rows = dict(catalog.conn.execute(
        "SELECT key, value FROM meta WHERE key IN ('compact_codec', 'compact_group')").fetchall())
    if "compact_codec" not in rows:
        return None
    return rows["compact_codec"], int(rows["compact_group"])


def set_default_codec(catalog: Catalog, codec: str, group: int) -> None:
    """Inside the caller's transaction."""
    catalog.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             [("compact_codec", codec), ("compact_group", str(group))])


def compact_row(catalog: Catalog, model_id: str) -> dict | None:
    rows = catalog.query("SELECT * FROM compacts WHERE model_id = ?", [model_id])
    return rows[0] if rows else None


def current_compact(catalog: Catalog, model_id: str, fingerprint: str, block_bytes: int) -> dict | None:
    """The expert's compact row when it was made for this fingerprint and grid (else None: stale, never used)."""
    row = compact_row(catalog, model_id)
    if row is None or row["fingerprint"] != fingerprint or row["block_bytes"] != block_bytes:
        return None
    return row


def current_compacts(catalog: Catalog, experts: list[dict], block_bytes: int) -> dict[str, dict]:
    """``current_compact`` of each expert ({id, fingerprint}) that has one, in one query."""
    if not experts:
        return {}
    fingerprints = {e["id"]: e["fingerprint"] for e in experts}
    rows = catalog.query(f"SELECT * FROM compacts WHERE model_id IN ({','.join('?' * len(fingerprints))})",
                         list(fingerprints))
    return {r["model_id"]: r for r in rows
            if r["fingerprint"] == fingerprints[r["model_id"]] and r["block_bytes"] == block_bytes}


def compact_blocks(catalog: Catalog, model_id: str):
    """Cursor of (tensor, block, offset, n, err1, err2, err4) of an expert's compact blocks."""
    return catalog.conn.execute("SELECT tensor, block, offset, n, err1, err2, err4 FROM compact_blocks "
                                "WHERE model_id = ?", [model_id])


def compact_rows(catalog: Catalog) -> list[dict]:
    return catalog.query("SELECT * FROM compacts ORDER BY model_id")


def prune_files(catalog: Catalog) -> list[str]:
    """Remove compact files no row references and temporary files of processes that are gone; returns their
    names. Runs inside a write transaction, so an ANALYZE storing its compact is never half seen."""
    folder = compact_dir(catalog)
    if not folder.is_dir() or catalog.read_only:
        return []
    removed = []
    with catalog.transaction(bump=False):
        used = {r[0] for r in catalog.conn.execute("SELECT file FROM compacts")}
        for path in sorted(folder.iterdir()):
            name = path.name
            if name.startswith(TMP_PREFIX):
                if _pid_alive(name[len(TMP_PREFIX):].split("-", 1)[0]):
                    continue
            elif name in used or not name.endswith(".mpc"):
                continue
            path.unlink(missing_ok=True)
            removed.append(name)
    return removed


def _pid_alive(text: str) -> bool:
    """Whether the process named in a temporary file's name is alive (ours included)."""
    try:
        pid = int(text)
    except ValueError:
        return False
    return pid == os.getpid() or pid_alive(pid)


def growth(catalog: Catalog, model_ids=None) -> tuple[int, int]:
    """(compact bytes, expert bytes) over these experts' current compact rows (default: all)."""
    rows = compact_rows(catalog)
    if model_ids is not None:
        rows = [r for r in rows if r["model_id"] in set(model_ids)]
    return sum(r["nbytes"] for r in rows), sum(r["expert_bytes"] for r in rows)


def check_compact_inputs(catalog: Catalog, plan) -> None:
    """The compact files a plan reads are still the catalog's current ones (same file and sha256, made for the
    plan's expert fingerprint and grid, the codec and group size it planned with)."""
    from mergepipe.errors import ExecutionError
    core = plan.compact or {}
    files = plan.compact_files
    fingerprints = {e["id"]: e["fingerprint"] for e in plan.experts}
    for eid, entry in (core.get("experts") or {}).items():
        row = current_compact(catalog, eid, fingerprints.get(eid, ""), plan.block_bytes)
        f = files.get(eid)
        if (row is None or f is None or row["sha256"] != f["sha256"] or row["codec"] != entry["codec"]
                or row["group_size"] != entry["group"] or Path(f["path"]).name != row["file"]):
            raise ExecutionError(f"the compact deltas of {eid} changed since plan {plan.id} was made "
                                 f"(re-analyzed, deleted or re-registered); plan again")
        if not Path(f["path"]).is_file():
            raise ExecutionError(f"compact file {f['path']} of {eid} is missing: run `mergepipe doctor` and "
                                 f"`mergepipe analyze --compact {row['codec']} --force {eid}`")


def compact_findings(catalog: Catalog) -> tuple[list[str], int]:
    """(findings, compacts checked) for `doctor`: each compact row's file exists with the recorded size and
    sha256, it was made for the expert's current fingerprint, and no compact file is left unreferenced."""
    import hashlib
    findings, checked = [], 0
    folder = compact_dir(catalog)
    fingerprints = {r[0]: r[1] for r in catalog.conn.execute("SELECT id, fingerprint FROM models")}
    for row in compact_rows(catalog):
        checked += 1
        path = folder / row["file"]
        where = f"compact deltas of {row['model_id']} ({path})"
        if not path.is_file():
            findings.append(f"{where}: the file is missing (run `mergepipe analyze --compact {row['codec']} --force "
                            f"{row['model_id']}`)")
            continue
        if path.stat().st_size != row["nbytes"]:
            findings.append(f"{where}: {path.stat().st_size} bytes, the catalog recorded {row['nbytes']}")
            continue
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        if h.hexdigest() != row["sha256"]:
            findings.append(f"{where}: sha256 differs from the catalog's (the file was changed): analyze again")
        if fingerprints.get(row["model_id"]) != row["fingerprint"]:
            findings.append(f"{where}: made for another version of the expert (stale; never used by a plan)")
    used = {r["file"] for r in compact_rows(catalog)}
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.name.endswith(".mpc") and path.name not in used and not path.name.startswith(TMP_PREFIX):
                findings.append(f"compact file {path} is referenced by no catalog row (the next analyze removes it)")
    return findings, checked
