"""The catalog's Gram statistics (table ``gram``, written by ANALYZE, analyze/gram.py): per base tensor
||base||^2, <base, delta_e> and <delta_e, delta_f> for experts analyzed together. All SQL for them is here.

Stored packed (schema v13): one row per (base, tensor, a) holding the pairs (a, b) of that a, ``b`` the b ids (a
JSON list, sorted) and ``value`` their float64 values (little-endian, NaN where no value: what SQLite stored as
NULL). Each (a, b) pair is what one row of the v12 table was, its value bit for bit (-0.0 stored as 0.0, NaN as
no value, as SQLite stored them); the readers give what the v12 ones gave."""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from mergepipe.catalog.gram_pack import _ids, pack, unpack

if TYPE_CHECKING:
    from mergepipe.catalog.db import Catalog


def set_key(ids) -> str:
    """The key of a set of experts analyzed together (ramplus_tl's counts depend on the whole set)."""
    return ",".join(sorted(ids))


def sce_row_keys(topk: float, key: str) -> dict[str, str]:
    """The ``a`` column of each of sce's top-k rows (analyze/sce.py) for this select_topk and expert set."""
    tag = f"{float(topk)!r}:{key}"
    return {"sums": f"~sce:{tag}", "thr": f"~scethr:{tag}", "cut": f"~scecut:{tag}", "rank": f"~scerank:{tag}"}


# --- reads ---------------------------------------------------------------------------------------------
def _select(catalog: Catalog, sql: str, args) -> list:
    return catalog.conn.execute(f"SELECT tensor, a, b, value FROM gram WHERE {sql}", args).fetchall()


def drop_gram(catalog: Catalog, base_id: str, ids) -> dict[tuple[str, str], dict]:
    """Drop every stored pair of this base that involves one of these experts (as a or as b); a row left with
    no pair is deleted. Returns the rows kept, {(tensor, a): {b: value}}. The caller holds the transaction."""
    ids = sorted(set(ids))
    kept: dict[tuple[str, str], dict] = {}
    if not ids:
        return kept
    marks = ",".join("?" * len(ids))
    catalog.conn.execute(f"DELETE FROM gram WHERE base_id = ? AND a IN ({marks})", [base_id, *ids])
    drop, changed, gone = set(ids), [], []
    for tensor, a, b, value in _select(catalog, "base_id = ?", [base_id]):
        if drop.isdisjoint(_ids(b)):
            kept[(tensor, a)] = None  # unchanged: read again only if new pairs join it
            continue
        entries = {k: v for k, v in unpack(b, value).items() if k not in drop}
        if entries:
            kept[(tensor, a)] = entries
            changed.append((*pack(entries), base_id, tensor, a))
        else:
            gone.append((base_id, tensor, a))
    catalog.conn.executemany("UPDATE gram SET b = ?, value = ? WHERE base_id = ? AND tensor = ? AND a = ?", changed)
    catalog.conn.executemany("DELETE FROM gram WHERE base_id = ? AND tensor = ? AND a = ?", gone)
    return kept


def replace_gram(catalog: Catalog, jobs) -> None:
    """Store the Gram rows of these ANALYZE jobs, dropping every stored pair that involves one of their
    experts first (its delta changed or was re-analyzed; pairs with experts outside this run are gone
    until they are analyzed together again). A pair stored twice keeps the last value. The caller holds
    the transaction."""
    ids = sorted({job.expert_id for job in jobs})
    if not ids:
        return
    new: dict[str, dict[tuple[str, str], dict]] = {}
    # the experts of one pass share each tensor's list of rows: a list stored again right after itself changes
    # nothing (K times fewer steps at K experts)
    last: dict[tuple[str, str], list] = {}
    for job in jobs:
        per = new.setdefault(job.base["id"], {})
        for tensor, trows in getattr(job, "gram", {}).items():
            if last.get((job.base["id"], tensor)) is trows:
                continue
            last[(job.base["id"], tensor)] = trows
            for a, b, value in trows:
                per.setdefault((tensor, a), {})[b] = value
    for base_id, per in new.items():
        kept = drop_gram(catalog, base_id, ids)
        rows = []
        for (tensor, a), entries in per.items():
            if (tensor, a) in kept:  # a row that keeps pairs with experts outside this run: merged
                old = kept[(tensor, a)]
                if old is None:
                    old = unpack(*catalog.conn.execute("SELECT b, value FROM gram WHERE base_id = ? AND tensor = ? "
                                                       "AND a = ?", [base_id, tensor, a]).fetchone())
                entries = {**old, **entries}
            rows.append((base_id, tensor, a, *pack(entries)))
        catalog.conn.executemany("INSERT OR REPLACE INTO gram (base_id, tensor, a, b, value) VALUES (?, ?, ?, ?, ?)",
                                 rows)


def load_gram(catalog: Catalog, base_id: str, expert_ids: list[str]) -> dict[str, dict[tuple[str, str], float]]:
    """tensor -> {(a, b): value} for the base and these experts ('' is the base; a <= b; None: no value)."""
    wanted = set(expert_ids) | {""}
    out: dict[str, dict[tuple[str, str], float]] = {}
    marks = ",".join("?" * len(wanted))
    for tensor, a, b, value in _select(catalog, f"base_id = ? AND a IN ({marks}) ORDER BY tensor, a",
                                       [base_id, *wanted]):
        for k, v in unpack(b, value).items():
            if k in wanted:
                out.setdefault(tensor, {})[(a, k)] = v
    return out


class _Pairs:
    """The stored pairs (a, b) among the base and these experts (``pos``: id -> row of the matrix), in the v12
    table's order (tensor, a, b): per pair its tensor (an index into ``tensors``), i = pos[a], j = pos[b] and
    value (NaN: none). One query and a few whole-array steps: no Python step per pair (K^2 a tensor)."""

    def __init__(self, catalog: Catalog, base_id: str, pos: dict[str, int]):
        marks = ",".join("?" * len(pos))
        rows = _select(catalog, f"base_id = ? AND a IN ({marks}) ORDER BY tensor, a", [base_id, *pos])
        self.names = list(dict.fromkeys(map(itemgetter(0), rows)))
        tensors = {t: x for x, t in enumerate(self.names)}
        cols = {b: np.array([pos.get(x, -1) for x in _ids(b)], dtype=np.int64) for b in set(map(itemgetter(2), rows))}
        js = list(map(cols.__getitem__, map(itemgetter(2), rows)))
        lens = np.fromiter(map(len, js), np.int64, len(js))
        j = np.concatenate(js) if js else np.zeros(0, np.int64)
        keep = j >= 0
        self.j = j[keep]
        self.k = np.repeat(np.fromiter(map(tensors.__getitem__, map(itemgetter(0), rows)), np.int64, len(rows)),
                           lens)[keep]
        self.i = np.repeat(np.fromiter(map(pos.__getitem__, map(itemgetter(1), rows)), np.int64, len(rows)), lens)[keep]
        self.v = np.frombuffer(b"".join(map(itemgetter(3), rows)), "<f8")[keep].astype(np.float64)
        self.n = len(pos)
        rank = {x: r for r, x in enumerate(sorted(pos))}
        self.rank = np.zeros(self.n, np.int64)  # each row's id's place in the ids' order (a > b: flipped)
        for x, p in pos.items():
            self.rank[p] = rank[x]

    def matrices(self, sel=None, unique: bool = False) -> dict:
        """tensor -> n x n float64 matrix, m[i, j] = m[j, i] = value pair by pair (the last one wins; NaN where
        none) of the pairs ``sel`` selects (all by default); only tensors with a selected pair. ``unique``: no two
        selected pairs fill the same cell (then filled as (i, j) of all, then (j, i) of all: the same matrix)."""
        k, i, j, v = (self.k, self.i, self.j, self.v) if sel is None else (self.k[sel], self.i[sel], self.j[sel],
                                                                           self.v[sel])
        n = self.n
        cell = k * (n * n)
        m = np.full(len(self.names) * n * n, np.nan)
        if unique:
            m[cell + i * n + j] = v
            m[cell + j * n + i] = v
        else:
            flat = np.empty(2 * len(v), np.int64)  # (i, j) then (j, i) of each pair, in the pairs' order
            flat[0::2] = cell + i * n + j
            flat[1::2] = cell + j * n + i
            m[flat] = np.repeat(v, 2)
        m = m.reshape(len(self.names), n, n)
        present = np.zeros(len(self.names), bool)
        present[k] = True
        return {t: m[x] for x, t in enumerate(self.names) if present[x]}

    def complete(self, sel) -> tuple[dict, np.ndarray]:
        """Per tensor with a pair in ``sel``: (its pairs with a value, its pairs, its pairs stored as a > b)."""
        k = self.k[sel]
        size = len(self.names)
        valued = np.bincount(k, weights=~np.isnan(self.v[sel]), minlength=size)
        count = np.bincount(k, minlength=size)
        flipped = np.bincount(k, weights=self.rank[self.i[sel]] > self.rank[self.j[sel]], minlength=size)
        return {t: (int(valued[x]), int(count[x]), int(flipped[x])) for x, t in enumerate(self.names) if count[x]}


def load_gram_matrices(catalog: Catalog, base_id: str, expert_ids: list[str]) -> dict:
    """tensor -> its (K+1) x (K+1) float64 matrix of the pairs ``load_gram`` returns (the base first, then
    ``expert_ids`` in order; NaN where no value is stored), filled as ``m[i, j] = m[j, i] = value`` pair by pair.
    One query and a few whole-array steps: no Python step per pair (K^2 a tensor)."""
    pos = {"": 0, **{e: i + 1 for i, e in enumerate(expert_ids)}}
    pairs = _Pairs(catalog, base_id, pos)
    complete = _complete_matrices(catalog, base_id, pos, pairs) if len(pos) == len(expert_ids) + 1 else None
    if complete is not None:
        return complete
    return pairs.matrices()


def load_set_counts(catalog: Catalog, base_id: str, key: str) -> dict[str, dict[str, tuple[float, float]]]:
    """tensor -> {expert: (shared, unique)} entry counts stored for the expert set ``key`` (ramplus_tl)."""
    out: dict[str, dict[str, list[float]]] = {}
    for tensor, a, b, value in _select(catalog, "base_id = ? AND a IN (?, ?)",
                                       [base_id, f"~shared:{key}", f"~unique:{key}"]):
        for e, v in unpack(b, value).items():
            out.setdefault(tensor, {}).setdefault(e, [0.0, 0.0])[0 if a.startswith("~shared") else 1] = v
    return {t: {e: tuple(v) for e, v in per.items()} for t, per in out.items()}


def load_arcee_thresholds(catalog: Catalog, base_id: str, expert_id: str) -> dict[str, float]:
    """tensor -> arcee_fusion's importance threshold of this expert (analyze/gram.py, rows ("~arcee", expert))."""
    out = {}
    for tensor, _, b, value in _select(catalog, "base_id = ? AND a = '~arcee'", [base_id]):
        per = unpack(b, value)
        if expert_id in per:
            out[tensor] = per[expert_id]
    return out


def load_sce_selection(catalog: Catalog, base_id: str, keys: dict[str, str]) -> dict[str, dict[str, dict]]:
    """tensor -> {kind: {expert: value}} of sce's top-k rows (analyze/sce.py ``row_keys``: kinds ``sums``,
    ``thr``, ``cut``, ``rank``) for one select_topk and expert set."""
    kind_of = {a: kind for kind, a in keys.items()}
    marks = ",".join("?" * len(kind_of))
    out: dict[str, dict[str, dict]] = {}
    for tensor, a, b, value in _select(catalog, f"base_id = ? AND a IN ({marks})", [base_id, *kind_of]):
        out.setdefault(tensor, {}).setdefault(kind_of[a], {}).update(unpack(b, value))
    return out


def _complete_matrices(catalog: Catalog, base_id: str, pos: dict[str, int], pairs: _Pairs | None = None) -> dict | None:
    """``load_gram_matrices`` where every tensor holds every pair of the base and these experts, each once, a <= b,
    none without a value; None where some tensor does not (the caller fills what is stored). ``pairs``: the
    pairs already read."""
    pairs = _Pairs(catalog, base_id, pos) if pairs is None else pairs
    n = len(pos)
    want = n * (n + 1) // 2
    counts = pairs.complete(slice(None))
    if not counts or any(c != want or rows != want or flipped for c, rows, flipped in counts.values()):
        return None
    return pairs.matrices(unique=True)  # each pair once: no cell filled twice


def load_gram_diagonal(catalog: Catalog, base_id: str, expert_ids: list[str]) -> tuple[dict, set]:
    """For methods that use only ||base||^2, <base, delta_i> and ||delta_i||^2: the matrices of
    ``load_gram_matrices`` with only those pairs filled (NaN between two experts), and the tensors on which every
    pair of these experts is stored (a value for each a <= b, counted; none stored as a > b)."""
    pos = {"": 0, **{e: i + 1 for i, e in enumerate(expert_ids)}}
    experts = len([e for e in pos if e])
    want = experts * (experts + 1) // 2
    pairs = _Pairs(catalog, base_id, pos)
    counts = pairs.complete((pairs.i > 0) & (pairs.j > 0))
    complete = {t for t, (c, _, flipped) in counts.items() if c == want and not flipped}
    # ('', b) and (e, e): no cell filled twice (a stored (b, '') is not read)
    return pairs.matrices((pairs.i == 0) | (pairs.i == pairs.j), unique=True), complete
