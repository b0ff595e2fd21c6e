"""Reproducing a published snapshot (``mergepipe reproduce DIR|hf://org/name[@rev]``).

Reads the snapshot's card and manifest (from a folder, or from the Hub at the commit the revision names),
resolves every input (a model of the catalog with the recorded fingerprint, else the recorded URI: the Hub
repo id and revision, or the path), registers them in a private temporary catalog, analyzes them on the
manifest's grid, re-runs the card's mergekit recipe (the same operator, parameters, budget, strategy and
seed) into a temporary folder with the published shard layout, and compares every output file's sha256
with the manifest's. On a difference it names the first differing tensor (in file order, reading the
published tensors by range requests) and why: an input whose fingerprint changed since the merge, another
plan, or another software version. Nothing stored changes: the user's catalog is only read.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError

README = "README.md"
MAX_SMALL = 64 << 20  # a manifest or a card read whole
_CARD_HASH = re.compile(r"manifest hash: `(sha256:[0-9a-f]{64})`")


@dataclass
class Published:
    """A published snapshot: its manifest, its card's text, where its files are read (a folder or
    ``hf://repo@commit``) and how the user named it."""

    manifest: object
    card: str | None
    location: str
    shown: str
    folder: Path  # a folder holding its manifest (the snapshot's own, or a temporary copy)


def _from_hub(source: str, tmp: Path) -> Published:
    from mergepipe.manifest.build import MANIFEST_NAME
    from mergepipe.manifest.verify import parse_manifest
    from mergepipe.storage.hub_publish import read_file, resolve_commit
    from mergepipe.storage.uris import parse_hf
    ref = parse_hf(source)
    commit = resolve_commit(ref.repo, ref.revision)
    raw = read_file(ref.repo, commit, MANIFEST_NAME, MAX_SMALL)
    if raw is None:
        raise MergePipeError(f"{source}: no {MANIFEST_NAME} at commit {commit[:12]} (not a MergePipe snapshot)")
    manifest = parse_manifest(raw.decode("utf-8", "replace"), f"{source}/{MANIFEST_NAME}")
    (tmp / MANIFEST_NAME).write_bytes(raw)
    card = read_file(ref.repo, commit, README, MAX_SMALL)
    return Published(manifest, card.decode("utf-8", "replace") if card is not None else None,
                     f"hf://{ref.repo}@{commit}", f"{source} (commit {commit[:12]})", tmp)


def open_published(source: str, tmp: Path) -> Published:
    """The snapshot at ``source``: a snapshot folder or ``hf://org/name[@revision]``."""
    from mergepipe.manifest.verify import load_manifest
    if str(source).lower().startswith("hf://"):
        return _from_hub(str(source), tmp)
    folder = Path(source)
    if not folder.is_dir():
        raise MergePipeError(f"{source}: not a snapshot folder or hf://org/name[@revision]")
    card = folder / README
    return Published(load_manifest(None, str(folder)), card.read_text("utf-8", "replace") if card.is_file() else None,
                     str(folder), str(folder), folder)


def _resolve_inputs(catalog: Catalog | None, core: dict) -> list[dict]:
    """Each input: {id, role, recorded uri and fingerprint, uri to read now, how it was found}."""
    known = {}
    if catalog is not None:
        for row in catalog.models():
            known.setdefault(row["fingerprint"], row["uri"])
    out = []
    for role, inp in [("base", core["inputs"]["base"]), *(("expert", e) for e in core["inputs"]["experts"])]:
        found = known.get(inp["fingerprint"])
        uri, how = (found, "found in the catalog by fingerprint") if found else _recorded(inp["uri"])
        out.append({"id": inp["id"], "role": role, "recorded_uri": inp["uri"], "fingerprint": inp["fingerprint"],
                    "kind": inp.get("kind", "full"), "uri": uri, "found": how})
    return out


def _recorded(uri: str) -> tuple[str, str]:
    """Where a recorded input is read now: its URI, or, for a folder of another machine's Hugging Face cache,
    its repo at the recorded commit on the Hub."""
    from mergepipe.storage.hub_ids import hub_origin
    from mergepipe.storage.registry import scheme_of
    origin = hub_origin(uri) if scheme_of(uri) is None and not Path(uri).exists() else None
    if origin is not None:
        return origin.uri(), "from the Hub at the recorded commit (the cached folder is not here)"
    return uri, "as recorded"


def _register(cat: Catalog, inputs: list[dict]) -> list[dict]:
    """Register the inputs in the private catalog; those whose fingerprint differs from the recorded one."""
    from mergepipe.catalog.models import register
    base = inputs[0]
    register(cat, base["id"], base["uri"])
    for e in inputs[1:]:
        register(cat, e["id"], e["uri"], base_id=base["id"], kind=e["kind"])
    changed = []
    for inp in inputs:
        now = cat.model(inp["id"])["fingerprint"]
        if now != inp["fingerprint"]:  # read from elsewhere (another storage): fingerprints do not compare
            changed.append({**inp, "now": now, "moved": inp["uri"] != inp["recorded_uri"]})
    return changed


def _recipe(pub: Published, inputs: list[dict]) -> str:
    """The card's mergekit YAML (else the manifest's export), each input named by its id."""
    import yaml

    from mergepipe.config.export import export_mergekit
    from mergepipe.config.yaml_loader import load_yaml
    from mergepipe.manifest.hub_card import recipe_from_card
    text = (recipe_from_card(pub.card) if pub.card else None) or export_mergekit(None, str(pub.folder))
    names = {i["recorded_uri"]: i["id"] for i in inputs}

    def swap(v):
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return names.get(v, v) if isinstance(v, str) else v
    return yaml.safe_dump(swap(load_yaml(text)), sort_keys=False)


def _densities(core: dict) -> tuple:
    from mergepipe.analyze.stats import DEFAULT_DENSITIES
    extra = set()
    for e in core["inputs"]["experts"]:
        d = (e.get("settings") or {}).get("density", e.get("density"))
        if isinstance(d, (int, float)) and 0 < d <= 1:
            extra.add(float(d))
    return tuple(sorted(set(DEFAULT_DENSITIES) | extra))


def shard_bytes_of(ckpt) -> int | None:
    """The largest shard's tensor bytes: the output shard size that cuts the tensors the same way (None for one
    file: the default)."""
    per_file: dict[str, int] = {}
    for t in ckpt.tensors.values():
        per_file[t.file] = per_file.get(t.file, 0) + t.nbytes
    return max(per_file.values()) if len(per_file) > 1 else None


def _rerun(cat: Catalog, pub: Published, inputs: list[dict], work: Path, published_ckpt, progress):
    """The recipe merged again in the private catalog ``cat``: its manifest."""
    from mergepipe.analyze.runner import analyze
    from mergepipe.api.configs import merge_config
    from mergepipe.config.parse import parse_config
    core = pub.manifest.core
    if progress:
        progress("analyze", 0, 1)
    analyze(cat, block_bytes=core["grid"]["block_bytes"], densities=_densities(core))
    if progress:
        progress("merge", 0, 1)
    cfg = parse_config(_recipe(pub, inputs), source="the published recipe")
    _, _, manifest = merge_config(cat, cfg, work / "out", model_id=pub.manifest.run.get("model_id") or "reproduced",
                                  out_shard_bytes=shard_bytes_of(published_ckpt))
    return manifest


def reproduce(catalog: Catalog | None, source: str, progress=None, work_dir=None) -> dict:
    """Re-run a published snapshot's recipe and compare (see the module docstring). Returns {ok, source,
    manifest_hash, reproduced_manifest_hash, files_compared, inputs, changed_inputs, first_difference (None or
    {tensor, file, why} or {file, why}), message}."""
    from mergepipe.storage.registry import open_checkpoint
    with tempfile.TemporaryDirectory(prefix="mergepipe-reproduce-", dir=work_dir) as tmp:
        work = Path(tmp)
        pub = open_published(source, work)
        core = pub.manifest.core
        card_hash = _CARD_HASH.search(pub.card or "")
        if card_hash and card_hash[1] != pub.manifest.manifest_hash:
            raise MergePipeError(f"{pub.shown}: its card names manifest {card_hash[1]}, its manifest is "
                                 f"{pub.manifest.manifest_hash}; the repository holds files of two snapshots")
        if progress:
            progress("inputs", 0, 1)
        inputs = _resolve_inputs(catalog, core)
        published = open_checkpoint(pub.location)
        private = Catalog(work / "reproduce.sqlite")
        try:
            changed = _register(private, inputs)
            new = _rerun(private, pub, inputs, work, published, progress)
        finally:
            private.close()
        if progress:
            progress("compare", 0, 1)
        diff = _first_difference(core, new.core, published, work / "out", changed)
    return _result(pub, new, inputs, changed, diff)


def _differing_files(old: dict, new: dict) -> list[str]:
    names = sorted((set(old) | set(new)) - {README})
    return [n for n in names if (old.get(n) or {}).get("sha256") != (new.get(n) or {}).get("sha256")]


def _first_difference(old: dict, new: dict, published, out: Path, changed: list[dict]) -> dict | None:
    from mergepipe.storage.registry import open_checkpoint
    files = _differing_files(old["outputs"], new["outputs"])
    if not files:
        return None
    weights = [f for f in files if f.endswith(".safetensors")]
    if not weights:
        return {"file": files[0], "tensor": None, "why": _why(old, new, changed, None)}
    mine = open_checkpoint(out)
    order = sorted(published.tensors.values(), key=lambda t: (t.file, t.offset))
    with published.reader() as theirs, mine.reader() as ours:
        for t in order:
            if t.file not in weights:
                continue
            m = mine.tensors.get(t.name)
            if m is None or (m.dtype, m.shape) != (t.dtype, t.shape) or \
                    _digest(ours, m) != _digest(theirs, t):
                return {"file": t.file, "tensor": t.name, "why": _why(old, new, changed, t.name)}
    extra = sorted(set(mine.tensors) - set(published.tensors))
    return {"file": weights[0], "tensor": extra[0] if extra else None, "why": _why(old, new, changed, None)}


def _digest(reader, t) -> str:
    h = hashlib.sha256()
    step = 16 << 20
    for start in range(0, t.nbytes, step):
        h.update(reader.read(t.file, t.offset + start, min(step, t.nbytes - start)))
    return h.hexdigest()


def _why(old: dict, new: dict, changed: list[dict], tensor: str | None) -> str:
    same_place = [c for c in changed if not c["moved"]]
    if same_place:
        touching = [c for c in same_place if c["role"] == "base" or tensor is None
                    or tensor in (old.get("touched") or {}).get(c["id"], {})] or same_place
        return "; ".join(f"input {c['id']} changed since the merge ({c['uri']}: fingerprint {c['fingerprint'][:19]}... "
                         f"is now {c['now'][:19]}...)" for c in touching)
    if old.get("software") != new.get("software"):
        was = ", ".join(f"{k} {v}" for k, v in sorted((old.get("software") or {}).items()))
        now = ", ".join(f"{k} {v}" for k, v in sorted((new.get("software") or {}).items()))
        return f"another version: merged with {was}, reproduced with {now}"
    if old.get("compact_inputs"):
        return "the merge read compact deltas (the compact tier), which a reproduction from the inputs does not have"
    if changed:
        where = ", ".join(f"{c['id']}: {c['uri']}" for c in changed)
        return f"inputs read from another place than the merge's ({where}): their content differs from what was merged"
    if old["plan_digest"] != new["plan_digest"]:
        return f"another plan: {new['plan_digest'][:19]}... (the merge's was {old['plan_digest'][:19]}...)"
    return "same inputs, plan and software: the output differs without a cause MergePipe can name"


def _result(pub: Published, new, inputs: list[dict], changed: list[dict], diff: dict | None) -> dict:
    old = pub.manifest.core
    if diff is None:
        n = len(set(old["outputs"]) - {README})
        msg = (f"reproduced bit for bit: {pub.shown} ({n} files, plan {old['plan_id']}, "
               f"manifest {pub.manifest.manifest_hash[:19]}...)")
    elif diff["tensor"]:
        msg = f"not reproduced: first differing tensor {diff['tensor']} (in {diff['file']}): {diff['why']}"
    else:
        msg = f"not reproduced: {diff['file']} differs: {diff['why']}"
    return {"ok": diff is None, "source": pub.shown, "manifest_hash": pub.manifest.manifest_hash,
            "reproduced_manifest_hash": new.manifest_hash, "files_compared": len(set(old["outputs"]) - {README}),
            "inputs": [{k: i[k] for k in ("id", "role", "uri", "found")} for i in inputs],
            "changed_inputs": [c["id"] for c in changed if not c["moved"]], "first_difference": diff, "message": msg}
