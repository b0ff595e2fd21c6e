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
from mergepipe.manifest.card import CARD_NAME
from mergepipe.manifest.hub_card import is_hub_card_of
from mergepipe.storage.publish import is_remote, object_sha256, read_object

MAX_MANIFEST_BYTES = 256 << 20


def load_manifest(catalog: Catalog | None, ref: str) -> Manifest:
    """A manifest by snapshot id, model id or output directory."""
    path = Path(ref)
    if path.is_dir():
        mpath = path / MANIFEST_NAME
        if not mpath.exists():
            raise MergePipeError(f"{path}: no {MANIFEST_NAME} (not a MergePipe snapshot)")
        return read_manifest(mpath)
    if catalog is None:
        raise MergePipeError(f"{ref}: not a directory")
    text = snapshots.manifest_json(catalog, ref)
    if text is None:
        raise MergePipeError(f"unknown snapshot {ref!r} (not a snapshot id, merged model id or snapshot directory)")
    return parse_manifest(text, f"the catalog's manifest of {ref}")


# --- reading a manifest: every fault is one VerifyError naming the file and the field ---------------------
MAX_DEPTH = 64
# The fields readers use (verify, explain, export), and their JSON types.
_RUN_FIELDS = {"snapshot_id": str, "model_id": str, "out": str}
_CORE_FIELDS = {"plan_id": str, "outputs": dict, "inputs": dict, "budget": dict, "estimated": dict, "realized": dict}
_BYTE_FIELDS = ("base_read", "expert_read", "output_write")
_TYPE_NAMES = {str: "a string", dict: "an object", list: "a list", int: "an integer"}


class _DuplicateKey(Exception):
    pass


def _unique_object(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey()
    return obj


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for t in (str, dict, list, int):
        if isinstance(value, t):
            return _TYPE_NAMES[t]
    return "a number" if isinstance(value, float) else type(value).__name__


def _too_deep(value) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _output_name_ok(name: str) -> bool:
    """An output file named relative to the snapshot directory, never outside it."""
    if not name or "\x00" in name or name.startswith("/") or "\\" in name:
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def read_manifest(path: Path) -> Manifest:
    """A manifest file (``mergepipe_manifest.json``), checked."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise VerifyError(f"{path}: unreadable manifest ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise VerifyError(f"{path}: unreadable manifest (not UTF-8 text)") from None
    return parse_manifest(text, str(path))


def _check_inputs_fields(inputs, bad) -> None:
    """``core.inputs``: a base and a list of experts, each with string id, uri and fingerprint."""
    if not isinstance(inputs, dict) or not isinstance(inputs.get("experts"), list):
        raise bad("`core.inputs` is not an object with a `base` and a list of `experts`")
    for where, model in [("base", inputs.get("base")), *(("experts", e) for e in inputs["experts"])]:
        if not isinstance(model, dict) or not all(isinstance(model.get(k), str) for k in ("id", "uri", "fingerprint")):
            raise bad(f"`core.inputs.{where}` has an entry without string `id`, `uri` and `fingerprint`")


def parse_manifest(text: str, source: str) -> Manifest:
    """A manifest from its JSON text; ``source`` names it in errors (which never quote its content)."""
    def bad(why: str) -> VerifyError:
        return VerifyError(f"{source}: unreadable manifest ({why})")

    try:
        d = json.loads(text, object_pairs_hook=_unique_object)
    except _DuplicateKey:
        raise bad("a key appears twice in one object") from None
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise bad("nested too deeply") from None
    except ValueError:
        raise bad("holds a number too large to read") from None
    if not isinstance(d, dict):
        raise bad(f"not a JSON object but {_kind(d)}")
    if _too_deep(d):
        raise bad(f"nested more than {MAX_DEPTH} levels deep")
    for key in ("core", "run"):
        if not isinstance(d.get(key), dict):
            raise bad(f"`{key}` is {'missing' if key not in d else _kind(d[key])}, not an object")
    if "manifest_hash" in d and not isinstance(d["manifest_hash"], str):
        raise bad(f"`manifest_hash` is {_kind(d['manifest_hash'])}, not a string")
    for part, fields in (("run", _RUN_FIELDS), ("core", _CORE_FIELDS)):
        for key, typ in fields.items():
            value = d[part].get(key)
            if not isinstance(value, typ):
                raise bad(f"`{part}.{key}` is {'missing' if key not in d[part] else _kind(value)}, "
                          f"not {_TYPE_NAMES[typ]}")
    for part in ("estimated", "realized"):
        for key in _BYTE_FIELDS:
            value = d["core"][part].get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(f"`core.{part}.{key}` is {'missing' if key not in d['core'][part] else _kind(value)}, "
                          f"not an integer")
    _check_inputs_fields(d["core"].get("inputs"), bad)
    for name, info in d["core"]["outputs"].items():
        if not _output_name_ok(name):
            raise bad("`core.outputs` names a file outside the snapshot directory")
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
            raise bad(f"`core.outputs` entry {ascii(name[:60])} has no sha256 string")
    try:
        return Manifest.from_dict(d)
    except (TypeError, ValueError, RecursionError):  # a value json.dumps refuses when hashing
        raise bad("its content cannot be hashed") from None


def verify(catalog: Catalog | None, ref: str, check_inputs: bool = True) -> dict:
    """Re-hash a snapshot's files against its manifest (and the catalog's manifest hash), and check
    that its inputs' files are still those it was merged from (their fingerprints; ``check_inputs``)."""
    manifest = load_manifest(catalog, ref)
    if is_remote(manifest.run["out"]) and not Path(ref).is_dir():
        problems, checked = _remote_files(manifest)
        out = manifest.run["out"]
    else:
        out = Path(ref) if Path(ref).is_dir() else Path(manifest.run["out"])
        problems, checked = _local_files(manifest, out)
    if catalog is not None:
        recorded = snapshots.snapshot_manifest_hash(catalog, manifest.snapshot_id)
        if recorded is not None and recorded != manifest.manifest_hash:
            problems.append(f"catalog records manifest hash {recorded}")
    inputs = manifest.core["inputs"]
    changed = [] if not check_inputs else \
        [why for why in map(input_change, [inputs["base"], *inputs["experts"]]) if why]
    problems += [f"input {why} since the merge (the snapshot cannot be reproduced from it)" for why in changed]
    if check_inputs and catalog is not None:
        problems += _compact_changes(catalog, manifest.core.get("compact_inputs") or {})
    result = {"snapshot_id": manifest.snapshot_id, "out": str(out), "manifest_hash": manifest.manifest_hash,
              "files_checked": checked, "inputs_checked": len(inputs["experts"]) + 1 if check_inputs else 0,
              "ok": not problems, "problems": problems}
    return result


def _compact_changes(catalog: Catalog, used: dict) -> list[str]:
    """The compact deltas a tiered merge read that the catalog no longer holds as they were."""
    from mergepipe.catalog.compacts import compact_dir, compact_row
    out = []
    for eid, was in sorted(used.items()):
        row = compact_row(catalog, eid)
        if row is None or row["sha256"] != was["sha256"]:
            out.append(f"input compact deltas of {eid} were re-made or removed since the merge (the snapshot cannot "
                       f"be reproduced from the catalog's compacts)")
        elif not (compact_dir(catalog) / row["file"]).is_file() or \
                (compact_dir(catalog) / row["file"]).stat().st_size != row["nbytes"]:
            out.append(f"input compact file of {eid} ({compact_dir(catalog) / row['file']}) is missing or changed size")
    return out


def _remote_files(manifest: Manifest) -> tuple[list[str], int]:
    """Re-hash a snapshot published to an s3:// prefix: the manifest object, then every output object
    read by range requests."""
    uri = manifest.run["out"]
    problems = []
    raw = read_object(uri, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if raw is None:
        problems.append(f"{MANIFEST_NAME} is missing (the snapshot at {uri} is not visible)")
    else:
        remote = parse_manifest(raw.decode("utf-8", "replace"), f"{uri}/{MANIFEST_NAME}")
        if remote.manifest_hash != manifest.manifest_hash:
            problems.append(f"{MANIFEST_NAME} at {uri} has hash {remote.manifest_hash}, catalog has {manifest.manifest_hash}")
    checked = 0
    for name, info in sorted(manifest.core["outputs"].items()):
        got = object_sha256(uri, name)
        if got is None:
            problems.append(f"{name}: missing")
            continue
        checked += 1
        if got[0] != info["sha256"]:
            problems.append(f"{name}: sha256 {got[0][:23]}... != manifest {info['sha256'][:23]}...")
    return problems, checked


def _local_files(manifest: Manifest, out: Path) -> tuple[list[str], int]:
    problems = []
    if not out.is_dir():
        raise VerifyError(f"{out}: snapshot directory is missing")
    disk = out / MANIFEST_NAME
    if disk.exists():
        on_disk = read_manifest(disk)
        if on_disk.manifest_hash != manifest.manifest_hash:
            problems.append(f"{MANIFEST_NAME} on disk has hash {on_disk.manifest_hash}, catalog has {manifest.manifest_hash}")
    else:
        problems.append(f"{MANIFEST_NAME} is missing")
    checked = 0
    for name, info in sorted(manifest.core["outputs"].items()):
        f = out / name
        if not f.exists():
            problems.append(f"{name}: missing")
            continue
        try:
            digest = file_sha256(f)
        except OSError as exc:
            problems.append(f"{name}: cannot read ({exc.strerror})")
            continue
        checked += 1
        if digest != info["sha256"] and not (name == CARD_NAME and is_hub_card_of(f, manifest.manifest_hash)):
            problems.append(f"{name}: sha256 {digest[:23]}... != manifest {info['sha256'][:23]}...")
    return problems, checked
