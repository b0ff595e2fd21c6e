"""Publishing a snapshot to the Hugging Face Hub (``mergepipe publish``): its files checked against its
manifest, a Hub model card (manifest/hub_card.py), one commit of what changed (storage/hub_publish.py),
then every committed file re-hashed by range requests against the manifest."""

from __future__ import annotations

import hashlib
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError, VerifyError

README = "README.md"


def _snapshot_folder(catalog: Catalog | None, ref: str, manifest) -> Path:
    from mergepipe.storage.publish import is_remote
    folder = Path(ref) if Path(ref).is_dir() else Path(manifest.run["out"])
    if is_remote(manifest.run["out"]) and not Path(ref).is_dir():
        raise MergePipeError(f"{manifest.snapshot_id} lives at {manifest.run['out']}: publish to the Hub from a "
                             "local snapshot folder")
    if not folder.is_dir():
        raise MergePipeError(f"{manifest.snapshot_id}: its folder {folder} is gone; nothing to publish")
    return folder


def _inputs_on_hub(core: dict) -> tuple[list[str], list[str]]:
    """(the inputs' Hub repo ids, the ids of inputs read from elsewhere)."""
    from mergepipe.storage.hub_publish import hub_repo_of
    repos, missing = [], []
    for inp in [core["inputs"]["base"], *core["inputs"]["experts"]]:
        found = hub_repo_of(inp["uri"])
        if found:
            repos.append(found[0])
        else:
            missing.append(inp["id"])
    return repos, missing


def hub_card_text(catalog: Catalog | None, ref: str, target: str) -> str:
    """The README.md a snapshot is published to ``target`` (hf://org/name[@branch]) with."""
    from mergepipe.manifest.verify import load_manifest
    from mergepipe.storage.hub_publish import parse_target
    return _card(catalog, ref, load_manifest(catalog, ref), parse_target(target))


def _card(catalog: Catalog | None, ref: str, manifest, tgt) -> str:
    from mergepipe.catalog.evaluations import evaluations
    from mergepipe.config.export import export_mergekit
    from mergepipe.manifest.hub_card import hub_card
    core = manifest.core
    repos, missing = _inputs_on_hub(core)
    model_id = manifest.run.get("model_id")
    evals = evaluations(catalog, [model_id]) if catalog is not None and model_id else []
    return hub_card(core, manifest.manifest_hash, name=tgt.repo, repo_ids=repos, missing=missing,
                    evaluations=sorted(evals, key=lambda e: (e["metric"], e.get("dataset_name") or "")),
                    recipe_yaml=export_mergekit(catalog, ref),
                    reproduce_uri=tgt.uri)


def _upload_files(folder: Path, manifest, card: bytes) -> list:
    from mergepipe.manifest.build import MANIFEST_NAME
    from mergepipe.storage.hub_publish import UploadFile
    files = [UploadFile(name, info["sha256"].split(":", 1)[1], int(info.get("bytes") or (folder / name).stat().st_size),
                        path=folder / name)
             for name, info in sorted(manifest.core["outputs"].items()) if name != README]
    raw = (folder / MANIFEST_NAME).read_bytes()
    files.append(UploadFile(MANIFEST_NAME, hashlib.sha256(raw).hexdigest(), len(raw), data=raw))
    files.append(UploadFile(README, hashlib.sha256(card).hexdigest(), len(card), data=card))
    return files


def verify_published(repo: str, commit: str, expected: dict[str, str], progress=None) -> list[str]:
    """Re-hash every file of ``expected`` (name -> sha256 hex) at ``repo``@``commit`` by range requests;
    the problems found (empty: all match)."""
    from mergepipe.storage.hub_publish import range_sha256
    problems = []
    for i, (name, sha) in enumerate(sorted(expected.items())):
        if progress:
            progress("verify", i, len(expected))
        got = range_sha256(repo, commit, name)
        if got is None:
            problems.append(f"{name}: missing")
        elif got[0] != f"sha256:{sha}":
            problems.append(f"{name}: sha256 {got[0][:23]}... != {sha[:16]}...")
    if progress:
        progress("verify", len(expected), len(expected))
    return problems


def publish_to_hub(catalog: Catalog | None, ref: str, target: str, private: bool = False, create_pr: bool = False,
                   progress=None) -> dict:
    """Publish snapshot ``ref`` (id, model id or folder) to ``target`` (``hf://org/name[@branch]``): one commit of
    the files that differ from the branch's (or a pull request, ``create_pr``), then every file re-hashed by range
    requests. ``progress(stage, done, total)``: stages check, compare, upload, verify. Returns {uri, repo, branch,
    commit, pr_url, uploaded, unchanged, deleted, uploaded_bytes, verified, snapshot_id, manifest_hash}."""
    from mergepipe.manifest.verify import load_manifest, verify
    from mergepipe.storage.hub_publish import parse_target, publish_files
    tgt = parse_target(target)
    manifest = load_manifest(catalog, ref)
    folder = _snapshot_folder(catalog, ref, manifest)
    if progress:
        progress("check", 0, 1)
    checked = verify(catalog, str(folder) if catalog is None else ref, check_inputs=False)
    if not checked["ok"]:
        raise VerifyError(f"{manifest.snapshot_id} does not match its manifest, not published: "
                          + "; ".join(checked["problems"]))
    card = _card(catalog, ref, manifest, tgt).encode()
    files = _upload_files(folder, manifest, card)
    core = manifest.core
    n = len(core["inputs"]["experts"])
    result = publish_files(files, tgt, message=f"MergePipe snapshot {manifest.snapshot_id}",
                           description=f"{core['operator']} merge of {n} expert{'s' if n != 1 else ''}, budget "
                                       f"{core['budget']['spec']}, manifest {manifest.manifest_hash}",
                           private=private, create_pr=create_pr, progress=progress)
    problems = verify_published(tgt.repo, result["commit"], {f.name: f.sha256 for f in files}, progress)
    if problems:
        raise VerifyError(f"{tgt.uri} at commit {result['commit'][:12]}: published, but the files read back differ: "
                          + "; ".join(problems))
    return {**result, "uri": tgt.uri, "repo": tgt.repo, "branch": tgt.branch, "verified": len(files),
            "snapshot_id": manifest.snapshot_id, "manifest_hash": manifest.manifest_hash}
