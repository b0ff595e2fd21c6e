"""Coalescing-aware planning (planner/coalesce.py): at a remote tier the plan prefers fewer, larger ranges.

Asserted on synthetic candidate tables: the rule keeps within the budget, only swaps blocks of the band
around the cut-off, and joins ranges. Against a real Range server on 127.0.0.1: a coalescing plan of
remote experts issues fewer requests (counted by the server) for at most the budget's bytes, and its merge
equals the local merge of the same access set bit for bit; EXPLAIN shows requests and estimated transfer
time before and after; local plans are unchanged; bad settings are refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mergepipe.api import merge, merge_request, plan
from mergepipe.catalog.db import Catalog
from mergepipe.errors import PlanError
from mergepipe.planner.candidates import Candidates
from mergepipe.planner.coalesce import coalesce
from mergepipe.research.family import make_family

from merge_helpers import dir_hashes, run_cli
from remote_helpers import RangeServer, family_catalog

BLOCK = 64 << 10


def table(scores, nbytes=100) -> Candidates:
    """One expert, one tensor, blocks 0..n-1 with the given scores and equal sizes."""
    n = len(scores)
    z = np.zeros(n, dtype=np.int64)
    score = np.array(scores, dtype=np.float64)
    return Candidates(z, z.copy(), np.arange(n, dtype=np.int64), np.full(n, nbytes, dtype=np.int64), score,
                      score.copy())


def runs(c: Candidates, chosen) -> int:
    blocks = sorted(int(c.block[i]) for i in chosen)
    return sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)


def test_band_blocks_next_to_chosen_ones_win_over_scattered_ones():
    # greedy takes 0, 2, 4 (score 10, 9.9, 9.8: 3 ranges); 1 and 3 score 9.5, inside the 10 % band
    c = table([10, 9.5, 9.9, 9.5, 9.8, 1, 1, 1])
    greedy = c.select(300)
    assert sorted(c.block[greedy].tolist()) == [0, 2, 4] and runs(c, greedy) == 3
    chosen = coalesce(c, greedy, 300, 0.10)
    assert sorted(c.block[chosen].tolist()) == [0, 1, 2] and runs(c, chosen) == 1
    assert c.nbytes[chosen].sum() <= 300


def test_blocks_outside_the_band_are_never_swapped():
    # 1 and 3 score 8.5: more than 10 % below the cut-off (9.8), so the greedy plan stays
    c = table([10, 8.5, 9.9, 8.5, 9.8, 1])
    greedy = c.select(300)
    assert sorted(coalesce(c, greedy, 300, 0.10).tolist()) == sorted(greedy.tolist())
    # a wider tolerance lets them in
    assert runs(c, coalesce(c, greedy, 300, 0.20)) == 1


def test_blocks_above_the_band_stay_and_the_budget_holds():
    rng = np.random.default_rng(3)
    scores = np.concatenate([rng.uniform(20, 30, 20), rng.uniform(9, 11, 200)])
    rng.shuffle(scores)
    c = Candidates(np.zeros(220, dtype=np.int64), np.zeros(220, dtype=np.int64), np.arange(220, dtype=np.int64),
                   rng.integers(50, 150, 220), scores, scores.copy())
    for budget in (1000, 5000, 12000):
        greedy = c.select(budget)
        chosen = coalesce(c, greedy, budget, 0.10)
        assert c.nbytes[chosen].sum() <= budget
        assert set(np.flatnonzero(c.ratio > 1.1 * c.ratio[c.order[np.searchsorted(c.cum_bytes, budget, "right") - 1]])) \
            <= set(chosen.tolist())
        assert runs(c, chosen) <= runs(c, greedy)


def test_bad_coalesce_settings_are_refused():
    with pytest.raises(PlanError, match="unknown coalesce mode 'always' \\(choose from auto, on, off\\)"):
        merge_request("base", ["e1"], "linear", coalesce="always")
    with pytest.raises(PlanError, match=r"the coalesce tolerance must be a number in \[0, 1\), not 1.5"):
        merge_request("base", ["e1"], "linear", coalesce_tolerance=1.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("coalesce")
    fam = make_family(root / "org", experts=2, size="small", dtype="bf16", shard_bytes=4 << 20, seed=5)
    with RangeServer(root) as server:
        yield server, fam


def catalog(path: Path, fam, uri) -> Catalog:
    return family_catalog(path, fam, uri, BLOCK)


def test_a_coalescing_plan_issues_fewer_requests_and_merges_like_the_local_plan(served, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF", "0.01")
    monkeypatch.delenv("MERGEPIPE_REMOTE_CACHE", raising=False)
    server, fam = served
    remote = catalog(tmp_path / "remote.sqlite", fam, lambda p: server.hub_url(f"org/{Path(p).name}"))
    local = catalog(tmp_path / "local.sqlite", fam, str)
    settings = dict(budget="10%", density=0.5)
    sent, outs, plans = {}, {}, {}
    for mode in ("off", "auto"):
        server.reset()
        out = tmp_path / f"out-{mode}"
        plans[mode], _, _ = merge(remote, "base", ["e1", "e2"], out, "linear", coalesce=mode, **settings)
        sent[mode] = (sum(server.total_requests(f"org/{Path(e).name}/") for e in fam["experts"]),
                      sum(server.total_bytes(f"org/{Path(e).name}/") for e in fam["experts"]))
        outs[mode] = dir_hashes(out, "*.safetensors")
    off, on = plans["off"], plans["auto"]
    assert "coalesce" not in off.data and on["coalesce"]["blocks_swapped"] > 0
    assert on["access"] != off["access"]
    assert on["estimate"]["expert_read"] <= on["budget"]["bytes"]
    assert on["estimate"]["expert_read"] >= 0.99 * off["estimate"]["expert_read"]
    assert sent["auto"][0] < sent["off"][0]  # fewer requests, counted by the server
    probes = 8 * 8 * sum(len(list(Path(e).glob("*.safetensors"))) for e in fam["experts"])
    for mode, p in plans.items():
        planned = p["estimate"]["expert_read"]
        assert planned <= sent[mode][1] <= planned + probes + planned // 100
    # EXPLAIN: requests and estimated transfer time before and after
    before, after = on["coalesce"]["before"], on["coalesce"]["after"]
    assert before == off["transfer"] and after == on["transfer"]
    req = lambda t: t["tiers"]["http"]["requests"]  # noqa: E731
    assert req(after) < req(before) and after["seconds"] < before["seconds"]
    line = next(x for x in on.explain().splitlines() if x.startswith("  coalesce"))
    assert line.startswith(f"  coalesce   {req(before)} -> {req(after)} requests, ~{before['seconds']:.2f} s -> "
                           f"~{after['seconds']:.2f} s estimated")
    # the same rule on local disk (forced on) gives the same access set, merged bit for bit alike
    lplan, _, _ = merge(local, "base", ["e1", "e2"], tmp_path / "local-on", "linear", coalesce="on", **settings)
    assert lplan["access"] == on["access"]
    assert dir_hashes(tmp_path / "local-on", "*.safetensors") == outs["auto"]
    # a local plan coalesces only when asked: auto keeps the greedy plan
    auto = plan(local, merge_request("base", ["e1", "e2"], "linear", **settings), save=False)
    assert auto["access"] == off["access"] and "coalesce" not in auto.data
    remote.close()
    local.close()


def test_coalesce_flags_on_the_command_line(served, tmp_path):
    _, fam = served
    db = tmp_path / "c.sqlite"
    catalog(db, fam, str).close()
    res = run_cli(["plan", "--db", db, "--base", "base", "--experts", "e1", "e2", "--op", "linear",
                   "--budget", "10%", "--coalesce", "on", "--coalesce-tolerance", "0.25"])
    assert res.returncode == 0, res.stderr
    assert "  coalesce   " in res.stdout and "(within 25% of the cut-off score per byte)" in res.stdout
    res = run_cli(["plan", "--db", db, "--base", "base", "--experts", "e1", "--coalesce-tolerance", "2"])
    assert res.returncode != 0
    assert res.stderr.strip() == "error: the coalesce tolerance must be a number in [0, 1), not 2.0"
