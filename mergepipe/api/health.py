"""doctor: a catalog checked without changing anything (the file, what recover would do, the registered
models' files and the stored compacts)."""

from __future__ import annotations

from pathlib import Path

from mergepipe.catalog.db import Catalog, integrity_findings
from mergepipe.catalog.models import check_unchanged
from mergepipe.engine.txn import recovery_findings
from mergepipe.errors import CatalogError, MergePipeError


def doctor(db_path) -> dict:
    """Check a catalog without changing anything: the file (``PRAGMA integrity_check``,
    ``foreign_key_check``, schema version), what `recover` would do (uncommitted transactions, runs whose
    process died, stale staging directories), and that every registered model's files still exist and
    are unchanged. Returns ``{"catalog", "findings": [line, ...], "checked": {...}, "healthy"}``; a
    missing catalog is a CatalogError. The model and transaction checks need a readable catalog: they
    are skipped (``checked`` says so) when the file itself has findings."""
    path = Path(db_path)
    if not path.is_file():
        raise CatalogError(f"{path}: no catalog here (run `mergepipe init-db --db {path}`)")
    findings = integrity_findings(path)
    checked = {"file": True, "transactions": False, "models": 0}
    if not findings:
        catalog = Catalog(path, create=False, check=False, read_only=True)
        try:
            findings += recovery_findings(catalog)
            checked["transactions"] = True
            for row in catalog.models():
                try:
                    check_unchanged(row)
                except (MergePipeError, OSError) as exc:
                    findings.append(f"model {row['id']}: {_model_finding(row, exc, path)}")
                checked["models"] += 1
            from mergepipe.catalog.compacts import compact_findings
            compact_notes, checked["compacts"] = compact_findings(catalog)
            findings += compact_notes
        finally:
            catalog.close()
    return {"catalog": str(path), "findings": findings, "checked": checked, "healthy": not findings}


def _model_finding(row: dict, exc: BaseException, db: Path) -> str:
    """Doctor's line for a model whose files changed or went missing. A published snapshot is never
    re-registered (that would accept corrupted output as the snapshot): the advice is to verify it against
    its manifest, then delete it and merge again, or restore its files."""
    text = str(exc)
    if not row.get("snapshot_id"):
        return text
    import re
    text = re.sub(r";?\s*re-register it with --replace", "", text).rstrip("; ")
    return (f"{text}; it is snapshot {row['snapshot_id']}: run `mergepipe verify --db {db} {row['id']}` to see "
            f"which files differ, then `mergepipe delete --db {db} {row['id']}` and merge again (or restore its "
            "files)")
