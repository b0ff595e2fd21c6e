"""Stored evaluation results: a model's score on a held-out text (or task suite), keyed by the model's
fingerprint and a ``dataset`` key -- the file's sha256, and for a perplexity also the settings that change it
(``sha256:...;window=256;max_tokens=8192``) -- so that a result is reused until any of them changes."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog, now


def evaluation(catalog: Catalog, model_id: str, fingerprint: str, dataset: str, metric: str) -> dict | None:
    rows = catalog.query("SELECT * FROM evaluations WHERE model_id = ? AND fingerprint = ? AND dataset = ? "
                         "AND metric = ?", [model_id, fingerprint, dataset, metric])
    return rows[0] if rows else None


def record_evaluation(catalog: Catalog, model_id: str, fingerprint: str, dataset: str, dataset_name: str,
                      metric: str, value: float, tokens: int) -> None:
    with catalog.transaction():
        catalog.conn.execute(
            "INSERT OR REPLACE INTO evaluations (model_id, fingerprint, dataset, dataset_name, metric, value, tokens, "
            "evaluated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [model_id, fingerprint, dataset, dataset_name, metric, float(value), int(tokens), now()])


def evaluations(catalog: Catalog, model_ids: list[str] | None = None) -> list[dict]:
    """Stored results (only those of the models' current fingerprints), newest first."""
    rows = catalog.query("SELECT e.* FROM evaluations e JOIN models m ON m.id = e.model_id AND "
                         "m.fingerprint = e.fingerprint ORDER BY e.evaluated_at DESC, e.model_id")
    return [r for r in rows if model_ids is None or r["model_id"] in model_ids]


def insert_evaluate_run(catalog: Catalog, model_ids: list[str]) -> int:
    cur = catalog.conn.execute(
        "INSERT INTO runs (kind, model_id, status, started_at, updated_at) VALUES ('evaluate', ?, 'queued', ?, ?)",
        [",".join(model_ids), now(), now()])
    return int(cur.lastrowid)
