"""Registering checkpoints: read headers and config only, fingerprint, check an expert against its base.

Nothing here imports torch: a registration costs the headers' bytes and a few milliseconds of JSON.
``register_many`` registers a batch of experts in one transaction, parsing their base once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from mergepipe.catalog.db import Catalog, now
from mergepipe.catalog.mismatch import OTHER_VOCAB, mismatch_error
from mergepipe.catalog.vocab_names import VOCAB_TENSOR_SUFFIXES, is_vocab_tensor  # noqa: F401 (re-exported)
from mergepipe.errors import CatalogError, MergePipeError
from mergepipe.storage.lora import base_mismatches
from mergepipe.storage.registry import canonical_uri, open_adapter, open_checkpoint, scheme_of, storage_for
from mergepipe.storage.hub_ids import exists_locally, parse_hub_id, resolve_text
from mergepipe.storage.uris import remote_model_name
from mergepipe.storage.views import split_view
from mergepipe.storage.dtypes import dtype_label
from mergepipe.storage.safetensors import FLOAT_DTYPES, Checkpoint
from mergepipe.storage.tokenizer_files import has_tokenizer

KINDS = ("full", "delta", "lora")


def open_files(kind: str, uri: str) -> Checkpoint:
    """The files a model of this kind is read from (a LoRA adapter's weights, else the checkpoint)."""
    return open_adapter(uri).checkpoint if kind == "lora" else open_checkpoint(uri)


def current_fingerprint(row: dict) -> str:
    """Fingerprint of the files a registered model points at, as they are now."""
    return open_files(row["kind"], row["uri"]).fingerprint()


def file_stats(uri: str) -> str | None:
    """The storage's cheap change stamp of a checkpoint's files (local: names, sizes, mtimes); a layer view's
    are its checkpoint's (storage/views.py)."""
    uri = split_view(uri)[0]
    return storage_for(uri).stamp(uri)


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


def input_change(inp: dict) -> str | None:
    """Why a merge input (a plan's ``{id, uri, fingerprint, kind}``) is no longer what was planned, or None.

    Re-parses the headers and re-fingerprints the files as they are now (no stamp shortcut)."""
    try:
        now_fp = open_files(inp.get("kind", "full"), inp["uri"]).fingerprint()
    except MergePipeError as exc:
        return f"{inp['id']} ({inp['uri']}) is no longer readable: {exc}"
    if now_fp != inp["fingerprint"]:
        return f"{inp['id']} ({inp['uri']}) changed: its files were rewritten"
    return None


def check_content_hash(row: dict) -> int:
    """Re-hash a model registered with a content hash (every byte of its files); returns the bytes
    hashed, 0 when none was registered."""
    if not row.get("content_hash"):
        return 0
    ckpt = open_files(row["kind"], row["uri"])
    if content_hash(ckpt) != row["content_hash"]:
        raise CatalogError(f"the content of {row['id']!r} ({row['uri']}) no longer matches the hash registered "
                           f"with --content-hash; re-register it with --replace")
    return sum(ckpt.file_sizes.values())


def content_hash(ckpt: Checkpoint) -> str:
    """sha256 over every byte of every file (opt-in: reads the whole checkpoint)."""
    h = hashlib.sha256()
    with ckpt.reader(sequential=True) as reader:
        for fname in ckpt.file_sizes:
            size = ckpt.storage.size(ckpt, fname)
            for offset in range(0, size, 16 << 20):
                h.update(reader.read(fname, offset, min(16 << 20, size - offset)))
    return "sha256:" + h.hexdigest()


def layout_mismatches(base: Checkpoint, expert: Checkpoint, limit: int | None = 20, any_float: bool = False,
                      vocab_rows: bool = False) -> list[str]:
    """Differences in tensor names, shapes and dtypes between an expert and its base.

    ``any_float``: a float tensor may have another float dtype (a delta checkpoint); ``vocab_rows``: an
    embedding or output tensor may have another number of rows (another vocabulary, with its own
    tokenizer: merged by re-ordering its rows to one tokenizer, ``tokenizer_source``)."""
    problems = []
    for name in sorted(set(base.tensors) - set(expert.tensors)):
        problems.append(f"missing tensor {name}")
    for name in sorted(set(expert.tensors) - set(base.tensors)):
        problems.append(f"extra tensor {name}")
    for name in sorted(set(base.tensors) & set(expert.tensors)):
        b, e = base.tensors[name], expert.tensors[name]
        other_rows = len(b.shape) == 2 and b.shape[1:] == e.shape[1:] and is_vocab_tensor(name)
        if b.shape != e.shape and not (vocab_rows and other_rows):
            hint = " " + OTHER_VOCAB if other_rows else ""
            problems.append(f"{name}: shape {list(e.shape)} != base {list(b.shape)}{hint}")
        if b.dtype != e.dtype and not (any_float and {b.dtype, e.dtype} <= FLOAT_DTYPES):
            problems.append(f"{name}: dtype {e.dtype} != base {b.dtype}")
    if limit is not None and len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems


def _architecture(kind: str, config: dict) -> str | None:
    """A short description for the catalog, from config.json (checked by the storage layer when read:
    ``architectures`` a list of names, ``model_type`` a name) or adapter_config.json. Values of any
    other shape are left out rather than trusted."""
    if not isinstance(config, dict):
        return None
    if kind == "lora":
        targets = config.get("target_modules")
        if isinstance(targets, list):
            targets = ",".join(sorted(t for t in targets if isinstance(t, str)))
        elif not isinstance(targets, str):
            targets = None
        r, alpha = (v if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e15 else None
                    for v in (config.get("r"), config.get("lora_alpha")))
        return f"LoRA r={r} alpha={alpha}" + (f" on {targets}" if targets else "")
    archs = config.get("architectures")
    if isinstance(archs, str):
        archs = [archs]
    joined = ",".join(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else ""
    model_type = config.get("model_type")
    return joined or (model_type if isinstance(model_type, str) else None)


@dataclass
class Checked:
    """One checkpoint, parsed and checked, ready to be written (or already registered as it is)."""

    model_id: str
    uri: str
    kind: str
    base_id: str | None
    ckpt: Checkpoint
    fingerprint: str
    existing: bool  # another registration of this id is replaced
    unchanged: bool = False
    old_content_hash: str | None = None

    def result(self) -> dict:
        if self.unchanged:
            return {"model_id": self.model_id, "status": "unchanged", "fingerprint": self.fingerprint}
        return {"model_id": self.model_id, "status": "replaced" if self.existing else "registered",
                "fingerprint": self.fingerprint, "bytes": self.ckpt.nbytes, "n_tensors": len(self.ckpt.tensors)}


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
    return register_many(catalog, [(model_id, uri)], base_id=base_id, kind=kind,
                         with_content_hash=with_content_hash, replace=replace, snapshot_id=snapshot_id)[0]


def register_many(
    catalog: Catalog,
    items,
    base_id: str | None = None,
    kind: str = "full",
    with_content_hash: bool = False,
    replace: bool = False,
    snapshot_id: str | None = None,
) -> list[dict]:
    """Register checkpoints, given as (model_id, uri) pairs, in one catalog transaction.

    All or nothing: every checkpoint is parsed and checked (against ``base_id``, whose headers are
    parsed once for the whole batch) before anything is written, so any error leaves the catalog
    as it was. Returns one result per item, as :func:`register` does. A Hub repo id that is no local path
    (``org/name[@rev]``) is registered from its cached snapshot, else ``hf://org/name@<commit>`` (hub_ids.py)."""
    items = [(model_id, resolve_text(str(uri))) for model_id, uri in items]
    _check_request(items, base_id, kind)
    base_ckpt = _open_base(catalog, base_id)
    checked = [_check_one(catalog, model_id, uri, kind, base_id, base_ckpt, replace) for model_id, uri in items]
    to_write = [c for c in checked if not c.unchanged]
    # --content-hash on an unchanged registration adds the hash and keeps its statistics
    to_hash = [c for c in checked if c.unchanged and with_content_hash and not c.old_content_hash]
    if to_write or to_hash:
        rows = {c.model_id: _model_row(c, with_content_hash, snapshot_id) for c in to_write}
        hashes = {c.model_id: content_hash(c.ckpt) for c in to_hash}
        with catalog.transaction():
            # The write lock is held from here on, but another process may have registered (or replaced)
            # one of these ids since the check: check again, so that a race ends as the sequential case
            # does (unchanged, or the ordinary "already registered" refusal), never in a UNIQUE violation.
            for c in checked:
                _compare_existing(catalog, c, replace)
            to_write = [c for c in checked if not c.unchanged]
            for c in to_write:
                row = rows.get(c.model_id) or _model_row(c, with_content_hash, snapshot_id)
                try:
                    _write(catalog, c, row)
                except sqlite3.IntegrityError as exc:  # not expected under the lock: still one clean line
                    if "models.id" not in str(exc):
                        raise
                    raise CatalogError(f"model id {c.model_id!r} is already registered (by another process "
                                       f"at the same time); run the command again") from None
            to_hash = [c for c in checked if c.unchanged and with_content_hash and not c.old_content_hash]
            catalog.conn.executemany("UPDATE models SET content_hash = ? WHERE id = ?",
                                     [(hashes.get(c.model_id) or content_hash(c.ckpt), c.model_id)
                                      for c in to_hash])
        if any(c.existing for c in to_write):  # a re-registered expert's compact deltas no longer apply
            from mergepipe.catalog.compacts import prune_files
            prune_files(catalog)
    return [c.result() for c in checked]


def named_by_path(uris) -> list[tuple[str, str]]:
    """(model_id, uri) pairs naming each checkpoint after its directory (or its file, less the suffix).

    Two checkpoints that would get the same name are refused."""
    items, seen = [], {}
    for uri in map(str, uris):
        hub = None if scheme_of(uri) is not None or exists_locally(uri) else parse_hub_id(uri)  # org/name
        if scheme_of(uri) is not None or hub is not None:
            model_id = hub.name if hub is not None else remote_model_name(uri)
            if model_id in seen:
                raise CatalogError(f"{seen[model_id]} and {uri} would both be named {model_id!r}; "
                                   f"register them one at a time with --model-id ID --uri URI")
            seen[model_id] = uri
            items.append((model_id, uri))
            continue
        # "x/", "x/." and "y/../x" are all named x; a symbolic link keeps its own name
        try:
            path = Path(os.path.abspath(Path(uri).expanduser()))
        except RuntimeError:  # ~user of no such user
            raise CatalogError(f"{uri}: cannot expand '~' (no such user or no home directory)") from None
        model_id = path.stem if path.is_file() else path.name
        if model_id in seen:
            raise CatalogError(f"{seen[model_id]} and {uri} would both be named {model_id!r}; "
                               f"register them one at a time with --model-id ID --uri PATH")
        seen[model_id] = uri
        items.append((model_id, uri))
    return items


def _check_request(items: list[tuple[str, str]], base_id: str | None, kind: str) -> None:
    if kind not in KINDS:
        raise CatalogError(f"unsupported kind {kind!r} (supported: {', '.join(KINDS)})")
    if kind in ("delta", "lora") and not base_id:
        raise CatalogError(f"a {kind} checkpoint needs --base")
    if not items:
        raise CatalogError("nothing to register (give at least one checkpoint)")
    seen = set()
    for model_id, _ in items:
        if not model_id or not model_id.strip():
            raise CatalogError("model id must not be empty")
        if model_id == base_id:
            raise CatalogError(f"{model_id!r}: a model cannot be its own base")
        if model_id in seen:
            raise CatalogError(f"model id {model_id!r} is given twice")
        seen.add(model_id)


def _open_base(catalog: Catalog, base_id: str | None) -> Checkpoint | None:
    if base_id is None:
        return None
    base_row = catalog.model(base_id)
    if base_row["kind"] != "full":
        raise CatalogError(f"base {base_id!r} is a {base_row['kind']} checkpoint; a base must be a full checkpoint")
    return open_checkpoint(base_row["uri"])


def _check_one(catalog: Catalog, model_id: str, uri: str, kind: str, base_id: str | None,
               base_ckpt: Checkpoint | None, replace: bool) -> Checked:
    """Parse one checkpoint and check it against its base and any registration of its id."""
    adapter = open_adapter(uri) if kind == "lora" else None
    ckpt = adapter.checkpoint if adapter else open_checkpoint(uri)
    if base_ckpt is not None:
        own, view = split_view(uri)
        if view is not None:  # a layer view holds some of the base's layers (storage/views.py)
            base_ckpt = dataclasses.replace(base_ckpt, tensors={n: t for n, t in base_ckpt.tensors.items()
                                                                if n in ckpt.tensors})
        problems = (base_mismatches(adapter, base_ckpt, limit=len(adapter.pairs)) if adapter
                    else layout_mismatches(base_ckpt, ckpt, limit=None, any_float=kind == "delta",
                                           vocab_rows=kind == "full" and has_tokenizer(Path(own))))
        if problems:
            raise mismatch_error(model_id, base_id, problems, base_ckpt, None if adapter else ckpt)
    checked = Checked(model_id, uri, kind, base_id, ckpt, ckpt.fingerprint(), existing=False)
    _compare_existing(catalog, checked, replace)
    return checked


def _compare_existing(catalog: Catalog, c: Checked, replace: bool) -> None:
    """Compare ``c`` with the id's current registration, if any (existing, unchanged, its content hash);
    refuse a different one unless replacing. Run at the check and again under the write lock."""
    existing = catalog.query("SELECT * FROM models WHERE id = ?", [c.model_id])
    c.existing = bool(existing)
    c.old_content_hash = existing[0]["content_hash"] if existing else None
    c.unchanged = bool(existing) and _same_registration(existing[0], c)
    if existing and not c.unchanged:
        _check_replaceable(existing[0], replace)


def _same_registration(old: dict, new: Checked) -> bool:
    return (
        old["fingerprint"] == new.fingerprint
        and old["base_id"] == new.base_id
        and old["kind"] == new.kind
        and canonical_uri(old["uri"]) == canonical_uri(new.uri)
    )


def _check_replaceable(old: dict, replace: bool) -> None:
    if not replace:
        raise CatalogError(
            f"model {old['id']!r} is already registered with different content or settings "
            f"(uri {old['uri']}); pass --replace to replace it"
        )
    if old["snapshot_id"]:
        raise CatalogError(f"model {old['id']!r} is a published snapshot and cannot be replaced")


def _model_row(c: Checked, with_content_hash: bool, snapshot_id: str | None) -> dict:
    ckpt = c.ckpt
    return {
        "id": c.model_id,
        "uri": canonical_uri(c.uri),
        "kind": c.kind,
        "base_id": c.base_id,
        "fingerprint": c.fingerprint,
        "content_hash": content_hash(ckpt) if with_content_hash else None,
        "architecture": _architecture(c.kind, ckpt.config),
        "dtype": dtype_label(t.dtype for t in ckpt.tensors.values()),  # e.g. "F32 (+I64 buffers)"
        "params": sum(math.prod(t.shape) for t in ckpt.tensors.values()),
        "bytes": ckpt.nbytes,
        "n_tensors": len(ckpt.tensors),
        "config": json.dumps(ckpt.config, sort_keys=True),
        "registered_at": now(),
        "snapshot_id": snapshot_id,
        "file_stats": file_stats(c.uri),
    }


def _tensor_rows(c: Checked) -> list[dict]:
    ordered = sorted(c.ckpt.tensors.values(), key=lambda t: (t.file, t.offset))
    return [
        {
            "model_id": c.model_id, "name": t.name, "idx": i, "shape": json.dumps(list(t.shape)),
            "dtype": t.dtype, "file": t.file, "offset": t.offset, "nbytes": t.nbytes,
        }
        for i, t in enumerate(ordered)
    ]


def _write(catalog: Catalog, c: Checked, row: dict) -> None:
    """Insert one model and its tensors (inside the caller's transaction), replacing its old rows."""
    if c.existing:
        for table in ("tensors", "blocks", "tensor_stats", "analyses", "compacts", "compact_blocks"):
            catalog.conn.execute(f"DELETE FROM {table} WHERE model_id = ?", [c.model_id])
        catalog.conn.execute("DELETE FROM models WHERE id = ?", [c.model_id])
    catalog.db["models"].insert(row)
    catalog.db["tensors"].insert_all(_tensor_rows(c), batch_size=1000)


# --- lookups the upper layers need -------------------------------------------------------------------
def model_ids(catalog: Catalog) -> set[str]:
    """Every registered model id."""
    return {r["id"] for r in catalog.query("SELECT id FROM models")}


def models_at(catalog: Catalog, uri: str) -> list[dict]:
    """The models registered from ``uri``, oldest first."""
    return catalog.query("SELECT * FROM models WHERE uri = ? ORDER BY registered_at, id", [uri])


def has_tensor(catalog: Catalog, model_id: str, name: str) -> bool:
    return bool(catalog.query("SELECT 1 FROM tensors WHERE model_id=? AND name=?", [model_id, name]))


def schema_version(catalog: Catalog) -> str:
    """The schema version recorded in the catalog's meta table."""
    return catalog.query('SELECT value FROM meta WHERE key=?', ['schema_version'])[0]['value']
