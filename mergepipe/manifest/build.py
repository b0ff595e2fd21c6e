"""Manifests: the immutable record of a merge.

The manifest *core* holds everything that determines the output (inputs by fingerprint, plan digest,
operator, parameters, seed, grid, budget, estimated and realized bytes, touched blocks, output file
hashes, software, parents); its sha256 over canonical JSON is the manifest hash. Run facts that differ
between two executions of one plan (snapshot id, output path, model id, timestamps, timings) are kept
beside the core, outside the hash: the same plan twice gives the same manifest hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError, VerifyError
from mergepipe.catalog import snapshots

MANIFEST_NAME = "mergepipe_manifest.json"
MANIFEST_FORMAT = "mergepipe.manifest/1"


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def hash_core(core: dict) -> str:
    return "sha256:" + hashlib.sha256(canonical(core)).hexdigest()


@dataclass
class Manifest:
    core: dict
    run: dict

    @property
    def manifest_hash(self) -> str:
        return hash_core(self.core)

    @property
    def snapshot_id(self) -> str:
        return self.run["snapshot_id"]

    def to_dict(self) -> dict:
        return {"manifest_hash": self.manifest_hash, "core": self.core, "run": self.run}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        m = cls(d["core"], d["run"])
        if d.get("manifest_hash") and d["manifest_hash"] != m.manifest_hash:
            raise VerifyError(f"manifest hash {d['manifest_hash']} does not match its content ({m.manifest_hash})")
        return m

    def write(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(self.to_json())
        return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


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


def verify(catalog: Catalog | None, ref: str) -> dict:
    """Re-hash a snapshot's files against its manifest (and the catalog's manifest hash)."""
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
    result = {"snapshot_id": manifest.snapshot_id, "out": str(out), "manifest_hash": manifest.manifest_hash,
              "files_checked": checked, "ok": not problems, "problems": problems}
    return result
