"""The catalog's Gram statistics (table ``gram``, written by ANALYZE, analyze/gram.py): per base tensor
||base||^2, <base, delta_e> and <delta_e, delta_f> for experts analyzed together. All SQL for them is here."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog


def set_key(ids) -> str:
    """The key of a set of experts analyzed together (ramplus_tl's counts depend on the whole set)."""
    return ",".join(sorted(ids))


def sce_row_keys(topk: float, key: str) -> dict[str, str]:
    """The ``a`` column of each of sce's top-k rows (analyze/sce.py) for this select_topk and expert set."""
    tag = f"{float(topk)!r}:{key}"
    return {"sums": f"~sce:{tag}", "thr": f"~scethr:{tag}", "cut": f"~scecut:{tag}", "rank": f"~scerank:{tag}"}


def replace_gram(catalog: Catalog, jobs) -> None:
    """Store the Gram rows of these ANALYZE jobs, dropping every stored row that involves one of their
    experts first (its delta changed or was re-analyzed; pairs with experts outside this run are gone
    until they are analyzed together again). The caller holds the transaction."""
    ids = sorted({job.expert_id for job in jobs})
    if not ids:
        return
    marks = ",".join("?" * len(ids))
    for job in jobs:
        base_id = job.base["id"]
        catalog.conn.execute(f"DELETE FROM gram WHERE base_id = ? AND (a IN ({marks}) OR b IN ({marks}))",
                             [base_id, *ids, *ids])
    rows = {}
    for job in jobs:
        for tensor, trows in getattr(job, "gram", {}).items():
            for a, b, value in trows:
                rows[(job.base["id"], tensor, a, b)] = value
    catalog.conn.executemany("INSERT OR REPLACE INTO gram (base_id, tensor, a, b, value) VALUES (?, ?, ?, ?, ?)",
                             [(*k, v) for k, v in rows.items()])


def load_gram(catalog: Catalog, base_id: str, expert_ids: list[str]) -> dict[str, dict[tuple[str, str], float]]:
    """tensor -> {(a, b): value} for the base and these experts ('' is the base; a <= b)."""
    wanted = set(expert_ids) | {""}
    out: dict[str, dict[tuple[str, str], float]] = {}
    marks = ",".join("?" * len(wanted))
    cur = catalog.conn.execute(f"SELECT tensor, a, b, value FROM gram WHERE base_id = ? AND a IN ({marks}) "
                               f"AND b IN ({marks})", [base_id, *wanted, *wanted])
    for tensor, a, b, value in cur:
        out.setdefault(tensor, {})[(a, b)] = value
    return out


def load_set_counts(catalog: Catalog, base_id: str, key: str) -> dict[str, dict[str, tuple[float, float]]]:
    """tensor -> {expert: (shared, unique)} entry counts stored for the expert set ``key`` (ramplus_tl)."""
    out: dict[str, dict[str, list[float]]] = {}
    cur = catalog.conn.execute("SELECT tensor, a, b, value FROM gram WHERE base_id = ? AND a IN (?, ?)",
                               [base_id, f"~shared:{key}", f"~unique:{key}"])
    for tensor, a, b, value in cur:
        out.setdefault(tensor, {}).setdefault(b, [0.0, 0.0])[0 if a.startswith("~shared") else 1] = value
    return {t: {e: tuple(v) for e, v in per.items()} for t, per in out.items()}


def load_arcee_thresholds(catalog: Catalog, base_id: str, expert_id: str) -> dict[str, float]:
    """tensor -> arcee_fusion's importance threshold of this expert (analyze/gram.py, rows ("~arcee", expert))."""
    cur = catalog.conn.execute("SELECT tensor, value FROM gram WHERE base_id = ? AND a = '~arcee' AND b = ?",
                               [base_id, expert_id])
    return dict(cur.fetchall())


def load_sce_selection(catalog: Catalog, base_id: str, keys: dict[str, str]) -> dict[str, dict[str, dict]]:
    """tensor -> {kind: {expert: value}} of sce's top-k rows (analyze/sce.py ``row_keys``: kinds ``sums``,
    ``thr``, ``cut``, ``rank``) for one select_topk and expert set."""
    kind_of = {a: kind for kind, a in keys.items()}
    marks = ",".join("?" * len(kind_of))
    cur = catalog.conn.execute(f"SELECT tensor, a, b, value FROM gram WHERE base_id = ? AND a IN ({marks})",
                               [base_id, *kind_of])
    out: dict[str, dict[str, dict]] = {}
    for tensor, a, b, value in cur:
        out.setdefault(tensor, {}).setdefault(kind_of[a], {})[b] = value
    return out
