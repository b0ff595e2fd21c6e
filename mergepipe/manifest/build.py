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

from mergepipe.errors import VerifyError


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
        from mergepipe.storage.writers import write_text
        path = Path(directory) / MANIFEST_NAME
        write_text(path, self.to_json())
        return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
