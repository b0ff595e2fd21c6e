"""EXPLAIN with 64 experts: the top 16 by bytes read and one line for the rest (their count, bytes, share and
blocks), ``--all`` / ``--experts-top N`` / ``--experts PATTERN`` on the command line; the plan and its digest are
the same whatever is listed."""

from __future__ import annotations

import re
import shutil

import pytest

from mergepipe import api
from mergepipe.catalog.db import Catalog
from mergepipe.planner.budget import human_bytes
from mergepipe.planner.explain_experts import DEFAULT_TOP

from many_experts_helpers import K, expert_ids, many_experts_catalog

pytestmark = pytest.mark.slow  # a 64-expert catalog built once per session

ROW = re.compile(r"^    (e\d+) +weight ")


@pytest.fixture(scope="module")
def k64(tmp_path_factory):
    db = tmp_path_factory.mktemp("explain-k64") / "c.sqlite"
    shutil.copy(many_experts_catalog(tmp_path_factory), db)
    cat = Catalog(db)
    plan = api.plan(cat, api.merge_request("base", expert_ids(), "ties", budget="10%", density=0.3))
    yield cat, plan
    cat.close()


def _rows(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := ROW.match(line))]


def test_default_lists_the_top_16_by_bytes_and_sums_the_rest(k64):
    cat, plan = k64
    text = api.explain(cat, plan.id)
    rows = _rows(text)
    assert len(rows) == DEFAULT_TOP == 16
    read = plan.estimated_by_expert
    by_bytes = sorted(expert_ids(), key=lambda e: (-read[e], expert_ids().index(e)))
    assert rows == by_bytes[:16]
    assert "  experts (top 16 of 64 by bytes read; --all lists every one)" in text.splitlines()
    rest = by_bytes[16:]
    more = [line for line in text.splitlines() if line.startswith("    … ")]
    total = sum(read.values())
    share = 100 * sum(read[e] for e in rest) / total
    assert more == [f"    … 48 more experts: read {human_bytes(sum(read[e] for e in rest))} ({share:.1f} % of the "
                    f"expert read), blocks {sum(plan.blocks_selected[e] for e in rest)}/"
                    f"{sum(plan.blocks_candidate[e] for e in rest)}"]


def test_all_and_top_n_and_pattern(k64):
    cat, plan = k64
    every = api.explain(cat, plan.id, experts_top=None)
    assert _rows(every) == expert_ids() and "more experts:" not in every and len(_rows(every)) == K
    assert len(_rows(api.explain(cat, plan.id, experts_top=5))) == 5
    ones = api.explain(cat, plan.id, experts="e1*")
    assert _rows(ones) == ["e1", *[f"e{i}" for i in range(10, 20)]]
    assert "  experts (11 of 64 match 'e1*')" in ones.splitlines()
    assert _rows(api.explain(cat, plan.id, experts_top=3, experts="e2?")) and "… 7 more experts" in api.explain(
        cat, plan.id, experts_top=3, experts="e2?")


def test_tensor_lines_name_listed_experts_and_count_the_others(k64):
    cat, plan = k64
    shown = set(_rows(api.explain(cat, plan.id)))
    for line in api.explain(cat, plan.id).split("  tensors")[1].splitlines()[1:]:
        names = set(re.findall(r" (e\d+)[:~]", line))
        assert names <= shown
        tensor = line.split()[0]
        others = sum(1 for e in expert_ids() if e not in shown and plan.access_for(e).get(tensor))
        assert (f"(+{others} more experts)" in line) == (others > 0)


def test_rendering_changes_no_plan(k64):
    cat, plan = k64
    before = plan.to_json()
    for kw in ({}, {"experts_top": None}, {"experts": "e3*"}):
        api.explain(cat, plan.id, **kw)
    again = api.plan(cat, api.merge_request("base", expert_ids(), "ties", budget="10%", density=0.3), save=False)
    assert again.digest == plan.digest and plan.to_json() == before


def test_cli_flags(k64, capsys):
    from mergepipe.cli import main
    cat, plan = k64
    assert main(["--db", str(cat.path), "explain", plan.id, "--all"]) in (0, None)
    assert len(_rows(capsys.readouterr().out)) == 64
    assert main(["--db", str(cat.path), "explain", plan.id, "--experts-top", "4", "--experts", "e?"]) in (0, None)
    out = capsys.readouterr().out
    assert len(_rows(out)) == 4 and "… 5 more experts" in out and "9 of 64 match 'e?'" in out
