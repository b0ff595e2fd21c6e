"""Stored statistics: per-block and per-tensor delta statistics, analyses and grids.

ANALYZE writes them (:func:`replace_analyses`); the planner and the dashboard read them.
Functions that return a cursor leave it to the caller to iterate (rows come as tuples).
"""

from __future__ import annotations

from mergepipe.catalog.db import Catalog, now
from mergepipe.catalog.packed import packed_row, unpack
from mergepipe.errors import CatalogError


def replace_analyses(catalog: Catalog, jobs, seconds: dict | None = None) -> None:
    """Replace the statistics of these experts (and their base's grid); the caller holds the transaction.

    ``jobs`` are ANALYZE jobs: ``base``, ``expert``, ``expert_id``, ``block_bytes``, ``grid_seen``,
    ``n_blocks``, ``results`` and ``record(seconds)`` (the analyses row).

    Compare-and-set: statistics are stored only if what they were computed from is still what the
    catalog holds -- the expert's and the base's fingerprints, and the base's grid as it was when the
    job started (or already the job's own): a concurrent ANALYZE that re-gridded the base, or a
    re-registration, makes this one store nothing and say so."""
    for job in jobs:
        _check_still_current(catalog, job)
    for job in jobs:
        if catalog.grid_block_bytes(job.base["id"]) != job.block_bytes:
            catalog.db["grids"].upsert(
                {"base_id": job.base["id"], "block_bytes": job.block_bytes, "n_blocks": job.n_blocks,
                 "created_at": now()}, pk="base_id")
        for table in ("blocks", "tensor_stats"):
            catalog.conn.execute(f"DELETE FROM {table} WHERE model_id = ?", [job.expert_id])
        catalog.db["blocks"].insert_all((r for rows, _ in job.results.values() for r in rows), batch_size=2000)
        catalog.db["tensor_stats"].insert_all((packed_row(s) for _, s in job.results.values()), batch_size=2000)
        catalog.db["analyses"].upsert(job.record((seconds or {}).get(job.expert_id)), pk="model_id")


def _check_still_current(catalog: Catalog, job) -> None:
    for model in (job.expert, job.base):
        row = catalog.conn.execute("SELECT fingerprint FROM models WHERE id = ?", [model["id"]]).fetchone()
        if row is None or row[0] != model["fingerprint"]:
            raise CatalogError(f"{model['id']} was re-registered or removed while {job.expert_id} was being "
                               f"analyzed; nothing was stored (run analyze again)")
    grid = catalog.grid_block_bytes(job.base["id"])
    if grid not in (None, job.block_bytes, job.grid_seen):
        raise CatalogError(f"the block grid of {job.base['id']} changed to {grid} bytes while {job.expert_id} was "
                           f"being analyzed with {job.block_bytes}-byte blocks (another analyze stored it); nothing "
                           f"was stored (run analyze again)")


# --- planner reads (cursors of tuples, changed tensors/blocks only) ---------------------------------
def changed_tensor_thresholds(catalog: Catalog, model_id: str):
    """(tensor, thresholds JSON, topk JSON or None, delta_l1, delta_max_abs, numel) of the tensors an
    expert changed."""
    return [(t, unpack(thr), unpack(topk), *rest) for t, thr, topk, *rest in catalog.conn.execute(
        "SELECT tensor, thresholds, topk, delta_l1, delta_max_abs, numel FROM tensor_stats "
        "WHERE model_id = ? AND delta_nnz > 0", [model_id]).fetchall()]


def fixed_bytes_by_tensor(catalog: Catalog, model_id: str) -> dict[str, int]:
    """tensor -> bytes that must be read whatever the budget (tensors with fixed_bytes > 0)."""
    return dict(catalog.conn.execute(
        "SELECT tensor, fixed_bytes FROM tensor_stats WHERE model_id = ? AND fixed_bytes > 0", [model_id]))


def changed_block_stats(catalog: Catalog, model_id: str) -> list[tuple]:
    """(tensor, block, nbytes, delta_l2, delta_max_abs) of the blocks an expert changed."""
    return catalog.conn.execute(
        "SELECT tensor, block, nbytes, delta_l2, delta_max_abs FROM blocks WHERE model_id = ? AND delta_nnz > 0",
        [model_id]).fetchall()


def changed_block_sketches(catalog: Catalog, model_id: str):
    """(tensor, block, delta_max_abs, sketch) of the blocks an expert changed."""
    return catalog.conn.execute(
        "SELECT tensor, block, delta_max_abs, sketch FROM blocks WHERE model_id = ? AND delta_nnz > 0", [model_id])


def changed_block_l2(catalog: Catalog, model_id: str):
    """(tensor, block, delta_l2) of the blocks an expert changed."""
    return catalog.conn.execute(
        "SELECT tensor, block, delta_l2 FROM blocks WHERE model_id = ? AND delta_nnz > 0", [model_id])


def changed_block_l1(catalog: Catalog, model_id: str):
    """(tensor, block, delta_l1) of the blocks an expert changed."""
    return catalog.conn.execute(
        "SELECT tensor, block, delta_l1 FROM blocks WHERE model_id = ? AND delta_nnz > 0", [model_id])


def changed_block_table(catalog: Catalog, model_ids: list[str]) -> list[tuple]:
    """(model_id, tensor, block, nbytes, delta_l2, delta_l1, delta_max_abs) of the blocks these experts changed,
    in one query (the planner's candidates for K experts at once)."""
    return catalog.conn.execute(
        f"SELECT model_id, tensor, block, nbytes, delta_l2, delta_l1, delta_max_abs FROM blocks "
        f"WHERE model_id IN ({_in(model_ids)}) AND delta_nnz > 0", list(model_ids)).fetchall()


def changed_block_sketch_table(catalog: Catalog, model_ids: list[str]):
    """(model_id, tensor, block, delta_l2, sketch) of the blocks these experts changed, in one query."""
    return catalog.conn.execute(
        f"SELECT model_id, tensor, block, delta_l2, sketch FROM blocks "
        f"WHERE model_id IN ({_in(model_ids)}) AND delta_nnz > 0", list(model_ids))


def fixed_bytes_table(catalog: Catalog, model_ids: list[str]) -> list[tuple]:
    """(model_id, tensor, fixed_bytes) of these experts' tensors with bytes read whatever the budget, in one query."""
    return catalog.conn.execute(
        f"SELECT model_id, tensor, fixed_bytes FROM tensor_stats WHERE model_id IN ({_in(model_ids)}) "
        f"AND fixed_bytes > 0", list(model_ids)).fetchall()


def changed_tensor_table(catalog: Catalog, model_ids: list[str], packed: bool = False) -> list[tuple]:
    """(model_id, tensor, thresholds JSON, topk JSON or None, delta_l1, delta_max_abs, numel)
    of the tensors these experts changed, in one query; ``packed``: the JSON columns as stored (v12: compressed)."""
    read = (lambda v: v) if packed else unpack  # packed: as stored (catalog/packed.members reads a part)
    return [(m, t, read(thr), read(topk), *rest) for m, t, thr, topk, *rest in catalog.conn.execute(
        f"SELECT model_id, tensor, thresholds, topk, delta_l1, delta_max_abs, numel "
        f"FROM tensor_stats "
        f"WHERE model_id IN ({_in(model_ids)}) AND delta_nnz > 0", list(model_ids)).fetchall()]


def shape_mismatches(catalog: Catalog, base_id: str, model_ids: list[str]) -> list[tuple]:
    """(model_id, tensor, shape JSON, the base's shape JSON) of these models' tensors whose shape is not the
    base's tensor of that name, in one query."""
    return catalog.conn.execute(
        f"SELECT t.model_id, t.name, t.shape, b.shape FROM tensors t JOIN tensors b ON b.model_id = ? "
        f"AND b.name = t.name WHERE t.model_id IN ({_in(model_ids)}) AND t.shape != b.shape ORDER BY t.idx",
        [base_id, *model_ids]).fetchall()


def nonfinite_blocks_of(catalog: Catalog, model_ids: list[str]) -> dict[str, list[tuple]]:
    """(tensor, block, nonfinite, base_nonfinite) of the blocks whose delta holds NaN/Inf, in order, per model
    among these that has any, in one query."""
    out: dict[str, list[tuple]] = {}
    if not model_ids:
        return out
    for mid, *row in catalog.conn.execute(
            f"SELECT model_id, tensor, block, nonfinite, base_nonfinite FROM blocks WHERE model_id IN "
            f"({_in(model_ids)}) AND nonfinite > 0 ORDER BY model_id, tensor, block", list(model_ids)).fetchall():
        out.setdefault(mid, []).append(tuple(row))
    return out


def changed_tensors(catalog: Catalog, model_id: str) -> list[str]:
    """The tensors whose stored delta is not zero everywhere (non-zero or non-finite entries)."""
    return [r[0] for r in catalog.conn.execute(
        "SELECT tensor FROM tensor_stats WHERE model_id = ? AND (delta_nnz > 0 OR COALESCE(nonfinite, 0) > 0)",
        [model_id]).fetchall()]


def changed_tensors_of(catalog: Catalog, model_ids: list[str]) -> dict[str, set[str]]:
    """changed_tensors of several experts in one query: model id -> its tensors whose delta is not zero everywhere."""
    out: dict[str, set[str]] = {m: set() for m in model_ids}
    for mid, tensor in catalog.conn.execute(
            f"SELECT model_id, tensor FROM tensor_stats WHERE model_id IN ({_in(model_ids)}) "
            f"AND (delta_nnz > 0 OR COALESCE(nonfinite, 0) > 0)", list(model_ids)).fetchall():
        out[mid].add(tensor)
    return out


def analyzed_ids(catalog: Catalog, model_ids: list[str]) -> set[str]:
    """The ids among these whose statistics are current (Catalog.is_analyzed of each, in one query)."""
    return {r[0] for r in catalog.conn.execute(
        f"SELECT m.id FROM models m JOIN analyses a ON a.model_id = m.id JOIN models b ON b.id = m.base_id "
        f"LEFT JOIN grids g ON g.base_id = b.id WHERE m.id IN ({_in(model_ids)}) AND a.fingerprint = m.fingerprint "
        f"AND a.base_fingerprint = b.fingerprint AND a.block_bytes IS g.block_bytes", list(model_ids)).fetchall()}


def nonfinite_message(expert_id: str, base_id: str, rows) -> str:
    """The refusal of an expert whose delta holds NaN/Inf: which model holds them (the base when its own
    entries are non-finite), in which tensors (the first three named, with their counts and blocks)."""
    by_tensor: dict[str, list] = {}
    for tensor, block, n, nb in rows:
        by_tensor.setdefault(tensor, []).append((block, n, nb or 0))
    in_base = sum(nb for bs in by_tensor.values() for _, _, nb in bs)
    parts = []
    for tensor, bs in list(by_tensor.items())[:3]:
        n = sum(b[1] for b in bs)
        nb = sum(b[2] for b in bs)
        blocks = ",".join(str(b[0]) for b in bs[:8]) + (",..." if len(bs) > 8 else "")
        base_part = f", {nb} NaN/Inf in the base" if nb else ""
        parts.append(f"{tensor}: {n} (block{'s' if len(bs) > 1 else ''} {blocks}{base_part})")
    more = f" and {len(by_tensor) - 3} more tensors" if len(by_tensor) > 3 else ""
    total = sum(b[1] for bs in by_tensor.values() for b in bs)
    who = (f"base {base_id!r} holds non-finite values (NaN/Inf) under expert {expert_id!r}" if in_base
           else f"expert {expert_id!r} holds non-finite values (NaN/Inf)")
    return (f"{who}: {total} NaN/Inf delta entr{'y' if total == 1 else 'ies'}, by tensor: "
            f"{'; '.join(parts)}{more}; a merge would publish NaN/Inf, so it is refused "
            f"(fix or drop the checkpoint, then register and analyze it again)")


# --- dashboard reads ---------------------------------------------------------------------------------
def _in(seq) -> str:
    return ",".join("?" * len(seq))


def tensor_stats_rows(catalog: Catalog, experts: list[str]) -> list[dict]:
    return catalog.query(f"SELECT model_id, tensor, numel, delta_l2, delta_l1, delta_max_abs, delta_nnz FROM tensor_stats "
                         f"WHERE model_id IN ({_in(experts)})", list(experts))


def block_stats_rows(catalog: Catalog, experts: list[str], tensors: list[str] | None = None) -> list[dict]:
    sql = (f"SELECT model_id, tensor, block, row_start, row_end, nbytes, delta_l2, delta_l1, delta_max_abs, delta_nnz "
           f"FROM blocks WHERE model_id IN ({_in(experts)})")
    params = list(experts)
    if tensors is not None:
        sql += f" AND tensor IN ({_in(tensors)})"
        params += list(tensors)
    return catalog.query(sql, params)


def sketch_rows(catalog: Catalog, experts: list[str], tensors: list[str]) -> list[dict]:
    return catalog.query(f"SELECT model_id, tensor, block, delta_max_abs, sketch FROM blocks "
                         f"WHERE model_id IN ({_in(experts)}) AND tensor IN ({_in(tensors)})", [*experts, *tensors])


def stats_version_row(catalog: Catalog) -> tuple:
    """What statistics depend on: models' fingerprints, analyses, grids, and plan and snapshot counts."""
    return catalog.conn.execute(
        """SELECT (SELECT group_concat(id || ':' || fingerprint, ',') FROM (SELECT * FROM models ORDER BY id)),
                  (SELECT group_concat(model_id || ':' || analyzed_at || ':' || block_bytes, ',')
                     FROM (SELECT * FROM analyses ORDER BY model_id)),
                  (SELECT group_concat(base_id || ':' || block_bytes, ',') FROM (SELECT * FROM grids ORDER BY base_id)),
                  (SELECT COUNT(*) FROM plans), (SELECT COUNT(*) FROM snapshots)""").fetchone()


# --- an expert far from its siblings (fine-tuned from another base?) ---------------------------------
OUTLIER_FACTOR = 100.0


def delta_rms_by_expert(catalog: Catalog, base_id: str) -> dict[str, float]:
    """Each analyzed expert of ``base_id``: its relative delta norm, the RMS of its delta over the tensors
    it changes (sqrt(sum ||delta||^2 / sum numel)), from the stored tensor statistics. Comparable across
    experts that change different numbers of tensors (a LoRA adapter, a full fine-tune)."""
    rows = catalog.query(
        "SELECT t.model_id AS id, SUM(t.delta_l2 * t.delta_l2) AS sq, "
        "SUM(CASE WHEN t.delta_nnz > 0 THEN t.numel ELSE 0 END) AS n "
        "FROM tensor_stats t JOIN analyses a ON a.model_id = t.model_id WHERE a.base_id = ? "
        "GROUP BY t.model_id ORDER BY t.model_id", [base_id])
    return {r["id"]: (float(r["sq"] or 0.0) / r["n"]) ** 0.5 if r["n"] else 0.0 for r in rows}


def outlier_experts(rms: dict[str, float], factor: float = OUTLIER_FACTOR) -> dict[str, float]:
    """expert -> ratio of its relative delta norm to the median of its siblings' (experts with at least
    one sibling with a non-zero delta), for those above ``factor``."""
    import statistics
    out = {}
    for e, v in rms.items():
        others = [w for o, w in rms.items() if o != e and w > 0]
        if not others or v <= 0:
            continue
        ratio = v / statistics.median(others)
        if ratio > factor:
            out[e] = ratio
    return out


def outlier_message(expert_id: str, base_id: str, ratio: float) -> str:
    return (f"expert {expert_id!r} has a delta {ratio:,.0f}x larger than the median of the other experts of "
            f"{base_id!r} (relative delta norm, from its stored statistics): was it fine-tuned from a different "
            f"base? A budgeted plan would spend most of its budget on it")


def outlier_warnings(catalog: Catalog, base_id: str, experts=None, factor: float = OUTLIER_FACTOR) -> list[str]:
    """Warnings for the experts of ``base_id`` (only ``experts`` when given) whose delta is far larger than
    their siblings'."""
    found = outlier_experts(delta_rms_by_expert(catalog, base_id), factor)
    keep = None if experts is None else set(experts)
    return [outlier_message(e, base_id, r) for e, r in found.items() if keep is None or e in keep]
