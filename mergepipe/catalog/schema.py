"""The catalog's tables (SCHEMA, created if missing) and the migrations between schema versions."""

from __future__ import annotations

SCHEMA_VERSION = 13

# ANALYZE's per-tensor Gram statistics (catalog/gram.py): per (base, tensor, a) one row holding a's values
# against every stored b: ``b`` the b ids (a JSON list, sorted), ``value`` their float64 values packed
# little-endian (NaN: no value), one per b. a = b = '' is ||base||^2, a = '' <base, delta_b>, else
# <delta_a, delta_b> (a <= b), for the experts analyzed together; '~'-prefixed a: other per-expert statistics
# (ramplus_tl's counts, arcee_fusion's thresholds, sce's top k). v13: K + 1 rows a tensor, not K^2 / 2.
GRAM_COLUMNS = """base_id TEXT NOT NULL, tensor TEXT NOT NULL, a TEXT NOT NULL, b TEXT NOT NULL, value BLOB NOT NULL,
        PRIMARY KEY (base_id, tensor, a)"""
GRAM_TABLE = f"""CREATE TABLE IF NOT EXISTS gram (
        {GRAM_COLUMNS}) WITHOUT ROWID"""
# v6 to v12: one row per (base, tensor, a, b); WITHOUT ROWID from v12 on (the rows live in their primary key's
# b-tree, not also in a copy of it)
GRAM_V12_COLUMNS = """base_id TEXT NOT NULL, tensor TEXT NOT NULL, a TEXT NOT NULL, b TEXT NOT NULL, value REAL,
        PRIMARY KEY (base_id, tensor, a, b)"""


def _pack_gram(conn) -> None:
    """v13: the v12 Gram table's rows packed, one row per (base, tensor, a) (catalog/gram_pack.py)."""
    from mergepipe.catalog.gram_pack import migrate_packed
    migrate_packed(conn, GRAM_COLUMNS)


# a merge sweep (v9): its config and state, and one row per point (settings, snapshot, bytes, time, quality)
SWEEP_TABLES = [
    """CREATE TABLE IF NOT EXISTS sweeps (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, config TEXT NOT NULL, executor TEXT NOT NULL,
        status TEXT NOT NULL, points INTEGER NOT NULL, started_at TEXT, finished_at TEXT)""",
    """CREATE TABLE IF NOT EXISTS sweep_points (
        sweep_id TEXT NOT NULL, point INTEGER NOT NULL, settings TEXT NOT NULL, status TEXT NOT NULL,
        plan_id TEXT, snapshot_id TEXT, model_id TEXT, expert_read INTEGER, budget_bytes INTEGER,
        full_expert_bytes INTEGER, error_bound REAL, seconds REAL, metric TEXT, quality REAL, error TEXT,
        PRIMARY KEY (sweep_id, point))""",
]

# named, versioned merge recipes and the snapshots each run published (v8, issue 17); the watcher's state:
# the checkpoints it has seen, by folder and fingerprint
RECIPE_TABLES = [
    """CREATE TABLE IF NOT EXISTS recipes (
        name TEXT NOT NULL, version INTEGER NOT NULL, json TEXT NOT NULL, created_at TEXT,
        PRIMARY KEY (name, version))""",
    """CREATE TABLE IF NOT EXISTS recipe_snapshots (
        name TEXT NOT NULL, version INTEGER NOT NULL, snapshot_id TEXT NOT NULL, mode TEXT NOT NULL,
        created_at TEXT, PRIMARY KEY (name, snapshot_id))""",
    """CREATE TABLE IF NOT EXISTS watch_seen (
        path TEXT PRIMARY KEY, model_id TEXT NOT NULL, fingerprint TEXT NOT NULL, status TEXT NOT NULL,
        updated_at TEXT)""",
]

# compact deltas (v10, issue 27): one compact file per expert beside the catalog (storage/compact.py), keyed
# by the expert's fingerprint and the grid, and per block its entries and the exact error norm of each level
# a recipe search (v11): its space and settings, one row per trial (parameters, state, best score) and one
# per merge a trial ran (its fidelity: budget, score, bound, bytes, seconds)
SEARCH_TABLES = [
    """CREATE TABLE IF NOT EXISTS searches (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, source TEXT NOT NULL, settings TEXT NOT NULL,
        status TEXT NOT NULL, pid INTEGER, started_at TEXT, finished_at TEXT, report TEXT)""",
    """CREATE TABLE IF NOT EXISTS search_trials (
        search_id TEXT NOT NULL, number INTEGER NOT NULL, params TEXT NOT NULL, status TEXT NOT NULL,
        fidelity TEXT, score REAL, expert_read INTEGER, seconds REAL, error TEXT, holdout REAL,
        snapshot_id TEXT, started_at TEXT, finished_at TEXT,
        PRIMARY KEY (search_id, number))""",
    """CREATE TABLE IF NOT EXISTS search_steps (
        search_id TEXT NOT NULL, number INTEGER NOT NULL, step INTEGER NOT NULL, budget TEXT NOT NULL,
        plan_id TEXT, score REAL, error_bound REAL, expert_read INTEGER, full_expert_bytes INTEGER,
        seconds REAL, PRIMARY KEY (search_id, number, step))""",
]

COMPACT_TABLES = [
    """CREATE TABLE IF NOT EXISTS compacts (
        model_id TEXT PRIMARY KEY, base_id TEXT NOT NULL, fingerprint TEXT NOT NULL, block_bytes INTEGER NOT NULL,
        codec TEXT NOT NULL, group_size INTEGER NOT NULL, file TEXT NOT NULL, nbytes INTEGER NOT NULL,
        sha256 TEXT NOT NULL, expert_bytes INTEGER NOT NULL, n_blocks INTEGER NOT NULL, created_at TEXT)""",
    """CREATE TABLE IF NOT EXISTS compact_blocks (
        model_id TEXT NOT NULL, tensor TEXT NOT NULL, block INTEGER NOT NULL, offset INTEGER NOT NULL,
        n INTEGER NOT NULL, err1 REAL, err2 REAL, err4 REAL, PRIMARY KEY (model_id, tensor, block))""",
]

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)""",
    """CREATE TABLE IF NOT EXISTS models (
        id TEXT PRIMARY KEY, uri TEXT NOT NULL, kind TEXT NOT NULL, base_id TEXT,
        fingerprint TEXT NOT NULL, content_hash TEXT, architecture TEXT, dtype TEXT,
        params INTEGER, bytes INTEGER, n_tensors INTEGER, config TEXT, registered_at TEXT,
        snapshot_id TEXT, file_stats TEXT)""",
    """CREATE TABLE IF NOT EXISTS tensors (
        model_id TEXT NOT NULL, name TEXT NOT NULL, idx INTEGER, shape TEXT, dtype TEXT, file TEXT,
        offset INTEGER, nbytes INTEGER, PRIMARY KEY (model_id, name))""",
    """CREATE TABLE IF NOT EXISTS grids (
        base_id TEXT PRIMARY KEY, block_bytes INTEGER NOT NULL, n_blocks INTEGER, created_at TEXT)""",
    """CREATE TABLE IF NOT EXISTS analyses (
        model_id TEXT PRIMARY KEY, base_id TEXT NOT NULL, fingerprint TEXT, base_fingerprint TEXT,
        block_bytes INTEGER, sketch_size INTEGER, densities TEXT, n_blocks INTEGER,
        bytes_read INTEGER, seconds REAL, analyzed_at TEXT)""",
    """CREATE TABLE IF NOT EXISTS blocks (
        model_id TEXT NOT NULL, tensor TEXT NOT NULL, block INTEGER NOT NULL,
        row_start INTEGER, row_end INTEGER, offset INTEGER, nbytes INTEGER,
        delta_l2 REAL, delta_l1 REAL, delta_max_abs REAL, delta_nnz INTEGER, sketch BLOB,
        nonfinite INTEGER DEFAULT 0, base_nonfinite INTEGER DEFAULT 0,
        PRIMARY KEY (model_id, tensor, block))""",
    """CREATE TABLE IF NOT EXISTS tensor_stats (
        model_id TEXT NOT NULL, tensor TEXT NOT NULL, numel INTEGER, delta_l2 REAL, delta_l1 REAL,
        delta_max_abs REAL, delta_nnz INTEGER, thresholds TEXT, fixed_bytes INTEGER DEFAULT 0,
        nonfinite INTEGER DEFAULT 0, base_nonfinite INTEGER DEFAULT 0, topk TEXT,
        PRIMARY KEY (model_id, tensor))""",
    """CREATE TABLE IF NOT EXISTS plans (
        id TEXT PRIMARY KEY, created_at TEXT, base_id TEXT, operator TEXT, budget_bytes INTEGER,
        full_expert_bytes INTEGER, expert_read_bytes INTEGER, error_bound REAL, json TEXT)""",
    """CREATE TABLE IF NOT EXISTS snapshots (
        id TEXT PRIMARY KEY, model_id TEXT, plan_id TEXT, out TEXT, manifest_hash TEXT,
        created_at TEXT)""",
    """CREATE TABLE IF NOT EXISTS manifests (
        snapshot_id TEXT PRIMARY KEY, manifest_hash TEXT, json TEXT)""",
    """CREATE TABLE IF NOT EXISTS lineage (
        child_id TEXT NOT NULL, parent_id TEXT NOT NULL, role TEXT, weight REAL,
        PRIMARY KEY (child_id, parent_id))""",
    """CREATE TABLE IF NOT EXISTS runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT DEFAULT 'merge', plan_id TEXT, out TEXT,
        model_id TEXT, status TEXT,
        pid INTEGER, log_path TEXT, started_at TEXT, updated_at TEXT, finished_at TEXT,
        blocks_done INTEGER DEFAULT 0, blocks_total INTEGER DEFAULT 0,
        expert_bytes_done INTEGER DEFAULT 0, expert_bytes_planned INTEGER DEFAULT 0,
        snapshot_id TEXT, error TEXT)""",
    """CREATE TABLE IF NOT EXISTS txns (
        id TEXT PRIMARY KEY, staging TEXT, out TEXT, status TEXT, pid INTEGER, started_at TEXT,
        finished_at TEXT)""",
    GRAM_TABLE,
    # tags (a JSON list) and a note per snapshot (v7)
    """CREATE TABLE IF NOT EXISTS snapshot_labels (
        snapshot_id TEXT PRIMARY KEY, tags TEXT NOT NULL DEFAULT '[]', note TEXT NOT NULL DEFAULT '',
        updated_at TEXT)""",
    # evaluation results by model fingerprint and dataset sha256 (v7)
    """CREATE TABLE IF NOT EXISTS evaluations (
        model_id TEXT NOT NULL, fingerprint TEXT NOT NULL, dataset TEXT NOT NULL, dataset_name TEXT,
        metric TEXT NOT NULL, value REAL, tokens INTEGER, evaluated_at TEXT,
        PRIMARY KEY (model_id, fingerprint, dataset, metric))""",
    *RECIPE_TABLES,
    """CREATE INDEX IF NOT EXISTS blocks_model ON blocks (model_id)""",
    """CREATE INDEX IF NOT EXISTS models_base ON models (base_id)""",
    *SWEEP_TABLES,
    *COMPACT_TABLES,
    *SEARCH_TABLES,
]

# Ordered migrations: version -> statements taking the schema from version-1 to version.
# A callable step is called with the connection (db.py), inside the migration's transaction.
MIGRATIONS: dict[int, list] = {
    2: ["ALTER TABLE models ADD COLUMN file_stats TEXT"],  # (name, size, mtime) of the files, for cheap change checks
    # bytes read once per tensor when any of its blocks is read (a LoRA adapter's A matrix)
    3: ["ALTER TABLE tensor_stats ADD COLUMN fixed_bytes INTEGER DEFAULT 0"],
    # non-finite (NaN/Inf) delta entries per block and tensor, and how many of them the base holds;
    # statistics stored before v4 count as finite (the engine still refuses a non-finite output)
    4: [f"ALTER TABLE {t} ADD COLUMN {c} INTEGER DEFAULT 0" for t in ("blocks", "tensor_stats")
        for c in ("nonfinite", "base_nonfinite")],
    # per density of the thresholds grid: [entries above the threshold, entries equal to it, L1 of exactly
    # k top entries] (TIES' per-tensor L1 rescale; the exact-k count of tied entries). NULL before v5:
    # a merge that needs it analyzes the expert again on the way.
    5: ["ALTER TABLE tensor_stats ADD COLUMN topk TEXT"],
    # per-tensor norms and pairwise dot products for the interpolation methods (slerp, model_stock, ...);
    # catalogs from before v6 have none: re-analyze the experts of such a merge together (--force)
    6: [GRAM_TABLE],
    # tags and a note per snapshot, kept apart from the snapshot rows (written by the user, not the engine)
    7: ["""CREATE TABLE IF NOT EXISTS snapshot_labels (
        snapshot_id TEXT PRIMARY KEY, tags TEXT NOT NULL DEFAULT '[]', note TEXT NOT NULL DEFAULT '',
        updated_at TEXT)""",
        # and evaluation results (perplexity on a held-out text), reused while model and text are unchanged
        """CREATE TABLE IF NOT EXISTS evaluations (
        model_id TEXT NOT NULL, fingerprint TEXT NOT NULL, dataset TEXT NOT NULL, dataset_name TEXT,
        metric TEXT NOT NULL, value REAL, tokens INTEGER, evaluated_at TEXT,
        PRIMARY KEY (model_id, fingerprint, dataset, metric))"""],
    8: list(RECIPE_TABLES),  # recipes and the watcher (issue 17)
    9: SWEEP_TABLES,  # merge sweeps and their points (issue 20)
    10: COMPACT_TABLES,  # compact deltas
    11: SEARCH_TABLES,  # recipe searches, their trials and each trial's merges
    # smaller statistics: the Gram table rebuilt WITHOUT ROWID; from v12 on tensor_stats' thresholds and topk
    # JSON are stored zlib-compressed (catalog/packed.py; rows stored earlier stay plain text and read as such)
    12: [f"CREATE TABLE gram_v12 ({GRAM_V12_COLUMNS}) WITHOUT ROWID",
         "INSERT INTO gram_v12 (base_id, tensor, a, b, value) SELECT base_id, tensor, a, b, value FROM gram",
         "DROP TABLE gram",
         "ALTER TABLE gram_v12 RENAME TO gram"],
    # the Gram table packed: one row per (base, tensor, a) with a's values against every b (K + 1 rows a tensor
    # instead of K^2 / 2: planning at K = 64 reads 65 rows a tensor); the values bit for bit those stored before
    13: [_pack_gram],
}
