"""Registering checkpoints: read headers and config only, fingerprint, check an expert against its base."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from .catalog import Catalog, now
from .errors import CatalogError
from .lora import ADAPTER_CONFIG, base_mismatches, open_adapter
from .storage import FLOAT_DTYPES, Checkpoint, open_checkpoint

KINDS = ("full", "delta", "lora")


def open_files(kind: str, uri: str) -> Checkpoint:
    """The files a model of this kind is read from (a LoRA adapter's weights, else the checkpoint)."""
    return open_adapter(uri).checkpoint if kind == "lora" else open_checkpoint(uri)


def fingerprint(ckpt: Checkpoint) -> str:
    """sha256 over the tensor layout (names, dtypes, shapes, offsets), file sizes and mtimes.

    Reads no tensor bytes. Sibling fine-tunes share one layout, so the files' modification times are
    part of it: a rewritten expert gets a new fingerprint and is re-analyzed, never silently reused.
    """
    h = hashlib.sha256(ckpt.headers_digest_source())
    for f in ckpt.files:
        h.update(f"{f.name}:{f.stat().st_mtime_ns}".encode())
    adapter_config = ckpt.root / ADAPTER_CONFIG
    if ckpt.root.is_dir() and adapter_config.is_file():  # a LoRA's alpha and r change its delta
        h.update(adapter_config.read_bytes())
    return "sha256:" + h.hexdigest()


def current_fingerprint(row: dict) -> str:
    """Fingerprint of the files a registered model points at, as they are now."""
    return fingerprint(open_files(row["kind"], row["uri"]))


def file_stats(uri: str) -> str | None:
    """(name, size, mtime) of a checkpoint's weight and index files, from stat() alone."""
    root = Path(uri)
    try:
        files = [root] if root.is_file() else sorted(
            [*root.glob("*.safetensors"), *root.glob("*.safetensors.index.json"), *root.glob(ADAPTER_CONFIG)])
        return json.dumps([[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    except OSError:
        return None


def check_unchanged(row: dict) -> None:
    """Refuse to use a model whose files changed since it was registered.

    Files whose sizes and mtimes are as registered are unchanged (their headers cannot differ, and the
    fingerprint covers nothing else); otherwise the headers are parsed again and fingerprinted."""
    if row.get("file_stats") and file_stats(row["uri"]) == row["file_stats"]:
        return
    if current_fingerprint(row) != row["fingerprint"]:
        raise CatalogError(
            f"the files of {row['id']!r} ({row['uri']}) changed since registration; "
            f"re-register it with --replace"
        )


def content_hash(ckpt: Checkpoint) -> str:
    """sha256 over every byte of every file (opt-in: reads the whole checkpoint)."""
    h = hashlib.sha256()
    for f in ckpt.files:
        with open(f, "rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def layout_mismatches(base: Checkpoint, expert: Checkpoint, limit: int = 20, any_float: bool = False) -> list[str]:
    """Differences in tensor names, shapes and dtypes between an expert and its base.

    ``any_float``: a float tensor may have another float dtype (a delta checkpoint)."""
    problems = []
    for name in sorted(set(base.tensors) - set(expert.tensors)):
        problems.append(f"missing tensor {name}")
    for name in sorted(set(expert.tensors) - set(base.tensors)):
        problems.append(f"extra tensor {name}")
    for name in sorted(set(base.tensors) & set(expert.tensors)):
        b, e = base.tensors[name], expert.tensors[name]
        if b.shape != e.shape:
            problems.append(f"{name}: shape {list(e.shape)} != base {list(b.shape)}")
        if b.dtype != e.dtype and not (any_float and {b.dtype, e.dtype} <= FLOAT_DTYPES):
            problems.append(f"{name}: dtype {e.dtype} != base {b.dtype}")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems


def _architecture(kind: str, config: dict) -> str | None:
    if kind == "lora":
        targets = config.get("target_modules")
        targets = ",".join(sorted(targets)) if isinstance(targets, list) else targets
        return f"LoRA r={config.get('r')} alpha={config.get('lora_alpha')}" + (f" on {targets}" if targets else "")
    return ",".join(config.get("architectures", [])) or config.get("model_type")


def register(
    catalog: Catalog,
    model_id: str,
    uri: str,
    base_id: str | None = None,
    kind: str = "full",
    with_content_hash: bool = False,
    replace: bool = False,
    snapshot_id: str | None = None,
) -> dict:
    """Register a checkpoint; returns {'model_id', 'status': 'registered'|'unchanged'|'replaced', ...}."""
    if not model_id or not model_id.strip():
        raise CatalogError("model id must not be empty")
    if kind not in KINDS:
        raise CatalogError(f"unsupported kind {kind!r} (supported: {', '.join(KINDS)})")
    if kind in ("delta", "lora") and not base_id:
        raise CatalogError(f"a {kind} checkpoint needs --base")
    if kind == "lora":
        adapter = open_adapter(uri)
        ckpt = adapter.checkpoint
    else:
        ckpt = open_checkpoint(uri)
    fp = fingerprint(ckpt)
    if base_id is not None:
        if base_id == model_id:
            raise CatalogError("a model cannot be its own base")
        base_row = catalog.model(base_id)
        if base_row["kind"] != "full":
            raise CatalogError(f"base {base_id!r} is a {base_row['kind']} checkpoint; a base must be a full checkpoint")
        base_ckpt = open_checkpoint(base_row["uri"])
        problems = (base_mismatches(adapter, base_ckpt) if kind == "lora"
                    else layout_mismatches(base_ckpt, ckpt, any_float=kind == "delta"))
        if problems:
            raise CatalogError(
                f"{model_id} does not match base {base_id}: " + "; ".join(problems)
            )
    existing = catalog.query("SELECT * FROM models WHERE id = ?", [model_id])
    if existing:
        old = existing[0]
        same = (
            old["fingerprint"] == fp
            and old["base_id"] == base_id
            and old["kind"] == kind
            and str(Path(old["uri"]).resolve()) == str(Path(uri).resolve())
        )
        if same:
            return {"model_id": model_id, "status": "unchanged", "fingerprint": fp}
        if not replace:
            raise CatalogError(
                f"model {model_id!r} is already registered with different content or settings "
                f"(uri {old['uri']}); pass --replace to replace it"
            )
        if old["snapshot_id"]:
            raise CatalogError(f"model {model_id!r} is a published snapshot and cannot be replaced")
    dtypes = sorted({t.dtype for t in ckpt.tensors.values()})
    row = {
        "id": model_id,
        "uri": str(Path(uri).resolve()),
        "kind": kind,
        "base_id": base_id,
        "fingerprint": fp,
        "content_hash": content_hash(ckpt) if with_content_hash else None,
        "architecture": _architecture(kind, ckpt.config),
        "dtype": dtypes[0] if len(dtypes) == 1 else "mixed:" + ",".join(dtypes),
        "params": sum(math.prod(t.shape) for t in ckpt.tensors.values()),
        "bytes": ckpt.nbytes,
        "n_tensors": len(ckpt.tensors),
        "config": json.dumps(ckpt.config, sort_keys=True),
        "registered_at": now(),
        "snapshot_id": snapshot_id,
        "file_stats": file_stats(uri),
    }
    ordered = sorted(ckpt.tensors.values(), key=lambda t: (t.file, t.offset))
    tensor_rows = [
        {
            "model_id": model_id, "name": t.name, "idx": i, "shape": json.dumps(list(t.shape)),
            "dtype": t.dtype, "file": t.file, "offset": t.offset, "nbytes": t.nbytes,
        }
        for i, t in enumerate(ordered)
    ]
    with catalog.transaction():
        if existing:
            for table in ("tensors", "blocks", "tensor_stats", "analyses"):
                catalog.conn.execute(f"DELETE FROM {table} WHERE model_id = ?", [model_id])
            catalog.conn.execute("DELETE FROM models WHERE id = ?", [model_id])
        catalog.db["models"].insert(row)
        catalog.db["tensors"].insert_all(tensor_rows, batch_size=1000)
    status = "replaced" if existing else "registered"
    return {"model_id": model_id, "status": status, "fingerprint": fp, "bytes": ckpt.nbytes,
            "n_tensors": len(ckpt.tensors)}
