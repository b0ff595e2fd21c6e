"""Finding a snapshot's manifest (by snapshot id, merged model id or directory) and verifying a snapshot:
re-hash its files against the manifest, and the manifest against the catalog's record."""

from __future__ import annotations

import json
from pathlib import Path

from mergepipe.catalog import snapshots
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import input_change
from mergepipe.errors import MergePipeError, VerifyError
from mergepipe.manifest.build import MANIFEST_NAME, Manifest, file_sha256


def load_manifest(catalog: Catalog | None, ref: str) -> Manifest:
    """A manifest by snapshot id, model id or output directory."""
    path = Path(ref)
    if path.is_dir():
        mpath = path / MANIFEST_NAME
        if not mpath.exists():
            raise MergePipeError(f"{path}: no {MANIFEST_NAME} (not a MergePipe snapshot)")
        try:
            return Manifest.from_dict(json.loads(mpath.read_text()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise VerifyError(f"{mpath}: unreadable manifest ({exc})") from None
    if catalog is None:
        raise MergePipeError(f"{ref}: not a directory")
    text = snapshots.manifest_json(catalog, ref)
    if text is None:
        raise MergePipeError(f"unknown snapshot {ref!r} (not a snapshot id, merged model id or snapshot directory)")
    return Manifest.from_dict(json.loads(text))


def verify(catalog: Catalog | None, ref: str, check_inputs: bool = True) -> dict:
    """Re-hash a snapshot's files against its manifest (and the catalog's manifest hash), and check
    that its inputs' files are still those it was merged from (their fingerprints; ``check_inputs``)."""
    manifest = load_manifest(catalog, ref)
    out = Path(ref) if Path(ref).is_dir() else Path(manifest.run["out"])
    problems = []
    if not out.is_dir():
        raise VerifyError(f"{out}: snapshot directory is missing")
    disk = out / MANIFEST_NAME
    if disk.exists():
        on_disk = Manifest.from_dict(json.loads(disk.read_text()))
        if on_disk.manifest_hash != manifest.manifest_hash:
            problems.append(f"{MANIFEST_NAME} on disk has hash {on_disk.manifest_hash}, catalog has {manifest.manifest_hash}")
    else:
        problems.append(f"{MANIFEST_NAME} is missing")
    if catalog is not None:
        recorded = snapshots.snapshot_manifest_hash(catalog, manifest.snapshot_id)
        if recorded is not None and recorded != manifest.manifest_hash:
            problems.append(f"catalog records manifest hash {recorded}")
    checked = 0
    for name, info in sorted(manifest.core["outputs"].items()):
        f = out / name
        if not f.exists():
            problems.append(f"{name}: missing")
            continue
        digest = file_sha256(f)
        checked += 1
        if digest != info["sha256"]:
            problems.append(f"{name}: sha256 {digest[:23]}... != manifest {info['sha256'][:23]}...")
    inputs = manifest.core["inputs"]
    changed = [] if not check_inputs else \
        [why for why in map(input_change, [inputs["base"], *inputs["experts"]]) if why]
    problems += [f"input {why} since the merge (the snapshot cannot be reproduced from it)" for why in changed]
    result = {"snapshot_id": manifest.snapshot_id, "out": str(out), "manifest_hash": manifest.manifest_hash,
              "files_checked": checked, "inputs_checked": len(inputs["experts"]) + 1 if check_inputs else 0,
              "ok": not problems, "problems": problems}
    return result
