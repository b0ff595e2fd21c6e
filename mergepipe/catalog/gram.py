"""The catalog's Gram statistics (table ``gram``, written by ANALYZE, analyze/gram.py): per base tensor
||base||^2, <base, delta_e> and <delta_e, delta_f> for experts analyzed together. All SQL for them is here."""

from __future__ import annotations

from operator import itemgetter

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
    for tensor, a, b, value in cur.fetchall():
        out.setdefault(tensor, {})[(a, b)] = value
    return out


def load_gram_matrices(catalog: Catalog, base_id: str, expert_ids: list[str]) -> dict:
    """tensor -> its (K+1) x (K+1) float64 matrix of the rows ``load_gram`` returns (the base first, then
    ``expert_ids`` in order; NaN where no row is stored), filled as ``m[i, j] = m[j, i] = value`` row by row.
    One query and a few whole-array steps: no Python step per row (K^2 rows per tensor)."""
    import numpy as np
    pos = {"": 0, **{e: i + 1 for i, e in enumerate(expert_ids)}}
    complete = _complete_matrices(catalog, base_id, pos) if len(pos) == len(expert_ids) + 1 else None
    if complete is not None:
        return complete
    marks = ",".join("?" * len(pos))
    rows = catalog.conn.execute(f"SELECT tensor, a, b, value FROM gram WHERE base_id = ? AND a IN ({marks}) "
                                f"AND b IN ({marks})", [base_id, *pos, *pos]).fetchall()
    if not rows:
        return {}
    column = [list(map(itemgetter(c), rows)) for c in range(4)]  # tensor, a, b, value
    names = {t: k for k, t in enumerate(dict.fromkeys(column[0]))}
    n, count = len(pos), len(rows)
    cell = np.fromiter(map(names.__getitem__, column[0]), np.int64, count) * (n * n)
    i = np.fromiter(map(pos.__getitem__, column[1]), np.int64, count)
    j = np.fromiter(map(pos.__getitem__, column[2]), np.int64, count)
    flat = np.empty(2 * count, np.int64)  # (i, j) then (j, i) of each row, in the rows' order: the last one wins
    flat[0::2] = cell + i * n + j
    flat[1::2] = cell + j * n + i
    m = np.full(len(names) * n * n, np.nan)
    m[flat] = np.repeat(np.array(column[3], dtype=np.float64), 2)  # NULL: NaN
    m = m.reshape(len(names), n, n)
    return {t: m[k] for t, k in names.items()}


def load_set_counts(catalog: Catalog, base_id: str, key: str) -> dict[str, dict[str, tuple[float, float]]]:
    """tensor -> {expert: (shared, unique)} entry counts stored for the expert set ``key`` (ramplus_tl)."""
    out: dict[str, dict[str, list[float]]] = {}
    cur = catalog.conn.execute("SELECT tensor, a, b, value FROM gram WHERE base_id = ? AND a IN (?, ?)",
                               [base_id, f"~shared:{key}", f"~unique:{key}"])
    for tensor, a, b, value in cur.fetchall():
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
    for tensor, a, b, value in cur.fetchall():
        out.setdefault(tensor, {}).setdefault(kind_of[a], {})[b] = value
    return out


def _complete_matrices(catalog: Catalog, base_id: str, pos: dict[str, int]) -> dict | None:
    """``load_gram_matrices`` where every tensor holds every pair of the base and these experts, each once, a <= b,
    none NULL (counted in SQL first): then only the values are read, in primary-key order (tensor, a, b), each
    tensor's n (n + 1) / 2 values the pairs a <= b of the sorted ids (SQLite's BINARY order is the UTF-8 bytes',
    which is Python's order of str). None where some tensor does not (the caller reads every row's keys)."""
    import numpy as np
    marks = ",".join("?" * len(pos))
    where = f"FROM gram WHERE base_id = ? AND a IN ({marks}) AND b IN ({marks})"
    n = len(pos)
    pairs = n * (n + 1) // 2
    counts = catalog.conn.execute(f"SELECT tensor, COUNT(value), COUNT(*), SUM(a > b) {where} GROUP BY tensor "
                                  "ORDER BY tensor", [base_id, *pos, *pos]).fetchall()
    if not counts or any(c != pairs or rows != pairs or flipped for _, c, rows, flipped in counts):
        return None
    values = catalog.conn.execute(f"SELECT value {where} ORDER BY tensor, a, b", [base_id, *pos, *pos]).fetchall()
    if len(values) != len(counts) * pairs:  # written in between: read the keys
        return None
    ids = sorted(pos)
    i = np.array([pos[ids[x]] for x in range(n) for _ in range(x, n)])
    j = np.array([pos[ids[y]] for x in range(n) for y in range(x, n)])
    v = np.fromiter(map(itemgetter(0), values), np.float64, len(values)).reshape(len(counts), pairs)
    m = np.full((len(counts), n, n), np.nan)
    m[:, i, j] = v
    m[:, j, i] = v
    return {t: m[k] for k, (t, *_) in enumerate(counts)}


def load_gram_diagonal(catalog: Catalog, base_id: str, expert_ids: list[str]) -> tuple[dict, set]:
    """For methods that use only ||base||^2, <base, delta_i> and ||delta_i||^2: the matrices of
    ``load_gram_matrices`` with only those rows read (NaN between two experts), and the tensors on which every
    pair of these experts is stored (a non-NULL value for each a <= b, counted in SQL; none stored as a > b).
    K + 1 rows a tensor read instead of K^2."""
    import numpy as np
    pos = {"": 0, **{e: i + 1 for i, e in enumerate(expert_ids)}}
    experts = [e for e in pos if e]
    marks, emarks = ",".join("?" * len(pos)), ",".join("?" * len(experts))
    pairs = len(experts) * (len(experts) + 1) // 2
    complete = {t for t, count, flipped in catalog.conn.execute(
        f"SELECT tensor, COUNT(value), SUM(a > b) FROM gram WHERE base_id = ? AND a IN ({emarks}) "
        f"AND b IN ({emarks}) GROUP BY tensor", [base_id, *experts, *experts]).fetchall()
        if count == pairs and not flipped}
    rows = catalog.conn.execute(f"SELECT tensor, a, b, value FROM gram WHERE base_id = ? AND (a = '' OR a = b) "
                                f"AND a IN ({marks}) AND b IN ({marks})", [base_id, *pos, *pos]).fetchall()
    n = len(pos)
    out: dict = {}
    for tensor, a, b, value in rows:
        m = out.get(tensor)
        if m is None:
            m = out[tensor] = np.full((n, n), np.nan)
        m[pos[a], pos[b]] = m[pos[b], pos[a]] = value
    return out, complete
