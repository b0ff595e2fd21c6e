"""Three-way plans: each candidate (expert, tensor, block) is read exactly, taken from the compact tier at 1, 2
or 4 bits per entry, or omitted.

Every option of a candidate has a cost (bytes read: 0, the compact record's prefix, the exact bytes) and a
residual, the candidate's term in the error bound (|c_i| times: ||delta|| omitted, the level's stored error
norm, 0 exact). Options that cost more without lowering the residual are dropped and the rest cut to their
lower convex hull, so a candidate's upgrades (omit -> 1 bit -> ... -> exact) have falling gains per byte. The
greedy walks all upgrades of all candidates by gain per byte (times the strategy's factor), highest first,
taking each that still fits and whose predecessor was taken: the same shape as the exact-only greedy, which
it equals when no candidate has a compact. Budget-sound by construction: exact + compact bytes <= budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mergepipe.catalog import compacts
from mergepipe.errors import PlanError
from mergepipe.planner.candidates import Candidates
from mergepipe.planner.plan import compact_ranges
from mergepipe.storage.codecs import codec

OMIT, EXACT = 0, 8  # tier codes; a compact tier's code is its bits per entry (1, 2, 4)
TIER_NAMES = {OMIT: "omitted", 1: "1 bit", 2: "2 bits", 4: "4 bits", EXACT: "exact"}


@dataclass
class Tiers:
    """The upgrade segments of every candidate and the greedy order over them."""

    cands: Candidates
    coef: np.ndarray  # |c_i| of each candidate (its expert's coefficient on its tensor)
    factor: np.ndarray  # the strategy's factor on each candidate's gains (1 for norm)
    entries: np.ndarray  # entries of each candidate's compact record (0: none)
    errors: dict  # level -> error norm of each candidate's compact at that level (NaN: none)
    group: np.ndarray  # group size of each candidate's compact (0: none)
    levels: tuple[int, ...]
    offsets: np.ndarray = None  # offset of each candidate's compact record in its expert's file
    seg: dict = field(default=None)

    def __post_init__(self):
        c = self.cands
        self.compact_bytes = {lv: _level_bytes(self.entries, self.group, lv) for lv in self.levels}
        cost, res, code = self._options()
        stack, size = _lower_hulls(cost, res)
        cand, pos = np.nonzero(np.arange(cost.shape[1])[None, :] < size[:, None])
        keep = pos >= 1
        cand, pos = cand[keep], pos[keep]
        j0, j1 = stack[cand, pos - 1], stack[cand, pos]
        r0, r1 = res[cand, j0], res[cand, j1]
        self.seg = {"cand": cand, "pos": pos, "from": code[cand, j0], "to": code[cand, j1], "residual": r1,
                    "gain": (r0 - r1) * self.factor[cand], "cost": (cost[cand, j1] - cost[cand, j0]).astype(np.int64)}
        s = self.seg
        cost = s["cost"] + np.where(s["to"] == EXACT, c.setup[s["cand"]] / np.maximum(self._group_counts(), 1), 0)
        ratio = np.where(cost > 0, s["gain"] / np.maximum(cost, 1), np.inf)
        cand = s["cand"]
        self.order = np.lexsort((s["pos"], c.block[cand], c.tensor[cand], c.expert[cand], -ratio))
        self.cum_cost = np.cumsum(s["cost"][self.order])

    def _options(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cost, residual, tier code) of every candidate's options, [candidates, options], sorted by cost; an
        option a candidate lacks costs inf."""
        c = self.cands
        n = len(c.nbytes)
        cols_cost = [np.zeros(n)]
        cols_res = [c.bound_term.astype(np.float64)]
        cols_code = [np.full(n, OMIT)]
        usable = (self.entries > 0) & (c.setup == 0)
        for lv in self.levels:
            err = self.errors[lv]
            ok = usable & np.isfinite(err)
            cols_cost.append(np.where(ok, self.compact_bytes[lv], np.inf))
            cols_res.append(np.where(ok, self.coef * np.nan_to_num(err), np.inf))
            cols_code.append(np.full(n, lv))
        cols_cost.append(c.nbytes.astype(np.float64))
        cols_res.append(np.zeros(n))
        cols_code.append(np.full(n, EXACT))
        cost, res, code = (np.column_stack(x) for x in (cols_cost, cols_res, cols_code))
        order = np.argsort(cost, axis=1, kind="stable")  # omit first (cost 0), then the levels, exact
        return (np.take_along_axis(cost, order, 1), np.take_along_axis(res, order, 1),
                np.take_along_axis(code, order, 1))

    def _group_counts(self) -> np.ndarray:
        c = self.cands
        _, inverse, counts = np.unique(c.group, return_inverse=True, return_counts=True)
        return counts[inverse][self.seg["cand"]]

    @property
    def has_setup(self) -> bool:
        return bool(self.cands.setup.any())

    def select(self, budget_bytes: int) -> np.ndarray:
        """The tier of every candidate (OMIT, 1, 2, 4, EXACT) under ``budget_bytes`` (exact + compact bytes)."""
        c, s = self.cands, self.seg
        tier = np.zeros(len(c.nbytes), dtype=np.int64)
        used = 0
        paid: set = set()
        k = 0
        if not self.has_setup:  # the longest prefix that fits, at once (chains stay in order: falling gains)
            k = int(np.searchsorted(self.cum_cost, budget_bytes, side="right"))
            taken = self.order[:k]
            np.maximum.at(tier, s["cand"][taken], s["to"][taken])
            used = int(self.cum_cost[k - 1]) if k else 0
        rest = self.order[k:]
        rest = rest[s["cost"][rest] <= budget_bytes - used]  # the others can never fit
        for j in rest:
            i = int(s["cand"][j])
            if tier[i] != s["from"][j]:
                continue
            extra = int(s["cost"][j])
            if s["to"][j] == EXACT and c.setup[i] and c.group[i] not in paid:
                extra += int(c.setup[i])
            if used + extra <= budget_bytes:
                tier[i] = s["to"][j]
                used += extra
                if s["to"][j] == EXACT and c.setup[i]:
                    paid.add(c.group[i])
        return tier

    def residual(self, tier: np.ndarray) -> np.ndarray:
        """Each candidate's term in the bound under ``tier``."""
        c = self.cands
        out = c.bound_term.astype(np.float64).copy()
        out[tier == EXACT] = 0.0
        for lv in self.levels:
            at = tier == lv
            out[at] = self.coef[at] * self.errors[lv][at]
        return out

    def compact_read(self, tier: np.ndarray) -> np.ndarray:
        """Compact bytes each candidate reads under ``tier``."""
        out = np.zeros(len(tier), dtype=np.int64)
        for lv in self.levels:
            at = tier == lv
            out[at] = self.compact_bytes[lv][at]
        return out

    def prefix_residual(self, k: int) -> np.ndarray:
        """Residuals after the first ``k`` upgrades of the greedy order."""
        s = self.seg
        out = self.cands.bound_term.astype(np.float64).copy()
        taken = self.order[:k]
        np.minimum.at(out, s["cand"][taken], s["residual"][taken])
        return out

    def frontier(self, points: int = 101) -> list[tuple[int, float]]:
        """(budget bytes, additive bound) along the greedy order, for the budget-bound curve."""
        if len(self.order) == 0:
            return [(0, 0.0)]
        out = []
        for k in np.unique(np.linspace(0, len(self.order), points).astype(int)):
            out.append((int(self.cum_cost[k - 1]) if k else 0, float(self.prefix_residual(int(k)).sum())))
        return out

    @property
    def full_bytes(self) -> int:
        return self.cands.full_bytes


def _level_bytes(entries: np.ndarray, group: np.ndarray, level: int) -> np.ndarray:
    """storage/codecs.level_bytes of every candidate (0 where it has no compact)."""
    n = entries.astype(np.int64)
    ng = -(-n // np.maximum(group, 1))
    p = -(-n // 8)
    one = 2 * ng + p
    out = {1: one, 2: 2 * one, 4: 2 * one + 2 * p}[level]
    return np.where(n > 0, out, 0).astype(np.int64)


def _lower_hulls(cost: np.ndarray, res: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the option columns on the lower convex hull of (cost, residual), cost rising and residual falling
    (``cost`` sorted along each row, inf for options a row lacks; column 0 is omit, cost 0): (columns, count)."""
    n, m = cost.shape
    rows = np.arange(n)
    stack = np.zeros((n, m), dtype=np.int64)
    size = np.ones(n, dtype=np.int64)
    for j in range(1, m):
        cj, rj = cost[:, j], res[:, j]
        top = stack[rows, size - 1]
        push = np.isfinite(cj) & (rj < res[rows, top])  # costs more and lowers nothing: not on the hull
        size -= push & (cj == cost[rows, top])  # the same cost, a lower residual: replaces the top
        for _ in range(m):  # drop the top while the chord from the one below it to j passes below (or through) it
            deep = size >= 2
            a, b = stack[rows, np.maximum(size - 2, 0)], stack[rows, size - 1]
            c0, r0, c1, r1 = cost[rows, a], res[rows, a], cost[rows, b], res[rows, b]
            with np.errstate(invalid="ignore"):
                bad = push & deep & ((r0 - r1) * (cj - c0) <= (r0 - rj) * (c1 - c0))
            if not bad.any():
                break
            size -= bad
        stack[rows[push], size[push]] = j
        size += push
    return stack, size


def _lower_hull(options: list[tuple]) -> list[tuple]:
    """The options on the lower convex hull of (cost, residual), cost rising and residual falling."""
    kept: list[tuple] = []
    for o in options:
        if kept and o[1] >= kept[-1][1]:  # costs more, lowers nothing
            continue
        if kept and o[0] == kept[-1][0]:
            kept.pop()
        while len(kept) >= 2:
            (c0, r0, _), (c1, r1, _) = kept[-2], kept[-1]
            # drop the middle point when the chord from kept[-2] to o passes below (or through) it
            if (r0 - r1) * (o[0] - c0) <= (r0 - o[1]) * (c1 - c0):
                kept.pop()
            else:
                break
        kept.append(o)
    return kept


def tier_plan_inputs(ctx) -> tuple["Tiers | None", str | None, dict]:
    """(the Tiers of a plan context, a note on why its catalog's compacts are not used, the compact files of the
    experts that have them); (None, None, {}) when the request asks for no compact tier or none is stored."""
    mode = ctx.request.compact
    if mode == "off":
        return None, None, {}
    stored = compacts.current_compacts(ctx.catalog, [e for e in ctx.experts if not e.get("analyze")],
                                       ctx.block_bytes)
    files = {e["id"]: stored[e["id"]] for e in ctx.experts if e["id"] in stored}
    if not files:
        if mode != "auto" and not ctx.to_analyze:  # a first merge stores them on the way (compact_store)
            raise PlanError(f"--compact {mode}: none of the experts has compact deltas for this grid "
                            f"(run `mergepipe analyze --compact {mode}` first)")
        return None, (None if _not_applicable(ctx) else NO_COMPACTS), {}
    why = _not_applicable(ctx)
    if why:
        return None, f"compact tier not used: {why}; blocks are read exactly or omitted", {}
    levels = {}
    for eid, row in files.items():
        stored = codec(row["codec"])
        wanted = stored.levels if mode == "auto" else codec(mode).levels
        readable = tuple(lv for lv in wanted if lv <= stored.stored_level)
        if mode == "auto" and not ctx.op.additive and len(readable) > 1:
            readable = tuple(lv for lv in readable if lv not in SIGN_ONLY_HURTS) or readable
        if not readable:
            raise PlanError(f"--compact {mode}: the compacts of {eid} hold {stored.stored_level} bit(s) per entry "
                            f"({stored.value}); run `mergepipe analyze --compact {mode} --force {eid}`")
        levels[eid] = readable
    return _build_tiers(ctx, files, levels), None, files


NO_COMPACTS = ("no compact deltas stored for these experts, so the blocks the budget leaves out count as 0: "
               "`mergepipe analyze --compact` stores them in the same read, and a budgeted merge then takes those "
               "blocks from them (in the fidelity study, merges at 10 % were within 2 points of the full merge in 23 "
               "of 24 configurations with them, 1 of 24 without: docs/fidelity/tiered.md)")  # (variant, K, operator)


def compact_store(ctx) -> dict | None:
    """The compacts a first merge's analysis on the way stores: the codec the request names, or with auto the
    one the catalog's last `analyze --compact` used; None with off or when the catalog never stored any."""
    from mergepipe.storage.codecs import CODECS, DEFAULT_GROUP
    mode = ctx.request.compact
    if mode == "off":
        return None
    default = compacts.default_codec(ctx.catalog)
    if mode in CODECS:
        return {"codec": mode, "group": default[1] if default else DEFAULT_GROUP}
    return {"codec": default[0], "group": default[1]} if default else None


def _not_applicable(ctx) -> str | None:
    op = ctx.op
    if op.nonlinear or op.copies or op.joint:
        return f"{op.name} does not merge each expert's delta on its own"
    if ctx.base_member:
        return "a model soup averages the base in"
    if ctx.output_layout is not None:
        return "a `slices:` layout"
    if ctx.vocab is not None:
        return "re-ordered embedding rows"
    if ctx.to_analyze:
        return "a first merge reads every expert block"
    if ctx.strategy not in TIER_STRATEGIES:
        return f"the {ctx.strategy} strategy orders blocks without a gain per byte"
    return None


TIER_STRATEGIES = ("norm", "conflict", "kept")
# Levels `auto` does not read for operators that trim, drop or elect signs per entry: in the fidelity study
# (docs/fidelity/tiered.md, full fine-tunes, K = 8) 1 bit per entry (every entry the group's mean magnitude)
# cost TIES 11.7-17.6 points and dare_ties 2.3-9.2 at 5-25 %, where 2 and 4 bits stayed within 1 point
# (the trim then acts on group means). An explicit codec (--compact progressive, sign1) reads what it names.
SIGN_ONLY_HURTS = (1,)


def _build_tiers(ctx, files: dict, levels: dict) -> Tiers:
    cands = ctx.candidates
    names = [t["name"] for t in ctx.tensors]
    n_c = len(cands.nbytes)
    entries = np.zeros(n_c, dtype=np.int64)
    all_levels = tuple(sorted({lv for lvs in levels.values() for lv in lvs}))
    errors = {lv: np.full(n_c, np.nan) for lv in all_levels}
    groups = np.zeros(n_c, dtype=np.int64)
    offsets = np.zeros(n_c, dtype=np.int64)
    for ei, e in enumerate(ctx.experts):
        if e["id"] not in files:
            continue
        idx = np.nonzero(cands.expert == ei)[0]
        if not len(idx):
            continue
        stored = {(t, b): (off, n, e1, e2, e4) for t, b, off, n, e1, e2, e4 in
                  compacts.compact_blocks(ctx.catalog, e["id"])}
        for i in idx:
            row = stored.get((names[cands.tensor[i]], int(cands.block[i])))
            if row is None:
                continue
            offsets[i], entries[i] = row[0], row[1]
            groups[i] = files[e["id"]]["group_size"]
            for lv in levels[e["id"]]:
                err = row[2 + (1, 2, 4).index(lv)]
                errors[lv][i] = np.nan if err is None else err
    coef = np.abs(ctx.coef_matrix)[cands.expert, cands.tensor] if n_c else np.zeros(0)
    factor = np.divide(cands.score, cands.bound_term, out=np.ones(n_c), where=cands.bound_term > 0)
    return Tiers(cands, coef, factor, entries, errors, groups, all_levels, offsets=offsets)


def tier_summary(ctx, tier: np.ndarray) -> dict:
    """What a three-way plan records: ``core`` (in the digest: per expert its codec, group size and the blocks
    read at each level; None when no block is), ``bytes`` and ``by_expert`` (compact bytes), ``files`` (outside
    the digest: each expert's compact file and the offsets of the records the plan reads) and ``tiers`` (blocks
    and bytes per tier)."""
    tiers, cands = ctx.tiers, ctx.candidates
    names = [t["name"] for t in ctx.tensors]
    read = tiers.compact_read(tier)
    core, files, by_expert = {}, {}, {e["id"]: 0 for e in ctx.experts}
    for i in np.nonzero((tier != OMIT) & (tier != EXACT))[0]:
        e = ctx.experts[cands.expert[i]]
        row = ctx.compact_rows[e["id"]]
        name, block = names[cands.tensor[i]], int(cands.block[i])
        entry = core.setdefault(e["id"], {"codec": row["codec"], "group": row["group_size"], "bits": {}})
        entry["bits"].setdefault(str(int(tier[i])), {}).setdefault(name, []).append(block)
        f = files.setdefault(e["id"], {"path": str(compacts.compact_dir(ctx.catalog) / row["file"]),
                                       "sha256": row["sha256"], "nbytes": row["nbytes"], "blocks": {}})
        f["blocks"].setdefault(name, []).append([block, int(tiers.offsets[i]), int(tiers.entries[i])])
        by_expert[e["id"]] += int(read[i])
    for entry in core.values():
        entry["bits"] = {lv: {t: compact_ranges(bs) for t, bs in sorted(ts.items())}
                         for lv, ts in sorted(entry["bits"].items())}
    for f in files.values():
        f["blocks"] = {t: sorted(bs) for t, bs in sorted(f["blocks"].items())}
    exact = tier == EXACT
    compact = (tier != OMIT) & ~exact
    summary = {
        "exact": {"blocks": int(exact.sum()), "bytes": int(cands.bytes_of(np.nonzero(exact)[0]).sum())},
        "compact": {"blocks": int(compact.sum()), "bytes": int(read.sum()),
                    "by_bits": {str(lv): int((tier == lv).sum()) for lv in tiers.levels}},
        "omitted": {"blocks": int((tier == OMIT).sum()), "bytes": int(cands.nbytes[tier == OMIT].sum())},
    }
    reads = [(f["path"], by_expert[eid], sum(len(bs) for bs in f["blocks"].values())) for eid, f in files.items()]
    return {"core": {"experts": dict(sorted(core.items())), "mode": ctx.request.compact} if core else None,
            "bytes": int(read.sum()),
            "by_expert": by_expert, "files": dict(sorted(files.items())), "tiers": summary, "reads": reads}
