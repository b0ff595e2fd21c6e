"""An expert identical to its base, or changing only tensors the merge gives it weight 0, is merged
with a warning (issue 14): stored in the plan's ``warnings`` (outside the digest), shown by EXPLAIN,
`plan` (text and --json) and `merge` (a `warning:` line on stderr)."""

from __future__ import annotations

import json

from mergepipe.analyze.runner import analyze
from mergepipe.planner.context import Planner

from merge_helpers import run_cli
from numeric_helpers import BLOCK, TENSOR, copy_model, registered, scale_tensor, small_family


def family_with_copies(tmp_path):
    """e1 a real expert; same = a copy of the base; one = the base with TENSOR changed only."""
    fam = small_family(tmp_path / "fam", "bf16", experts=1)
    same = copy_model(fam["base"], tmp_path / "fam" / "same")
    one = copy_model(fam["base"], tmp_path / "fam" / "one")
    scale_tensor(one, TENSOR, 1.5)
    fam = dict(fam, experts=[*fam["experts"], str(same), str(one)])
    db = tmp_path / "c.sqlite"
    cat = registered(db, fam, ids={2: "same", 3: "one"})
    analyze(cat, block_bytes=BLOCK)
    return cat, db


def test_zero_delta_expert_is_warned_in_plan_explain_and_cli(tmp_path):
    cat, db = family_with_copies(tmp_path)
    plan = Planner(cat).plan("base", ["e1", "same"], "ties", density=0.3, save=False)
    warning = ("expert 'same' has a zero delta everywhere: it is identical to its base 'base' and changes "
               "nothing in this merge")
    assert plan.data["warnings"] == [warning]
    assert f"  warning    {warning}" in plan.explain()
    # outside the digest: the plan of the same request without the warning key has the same id
    healthy = Planner(cat).plan("base", ["e1"], "ties", density=0.3, save=False)
    assert "warnings" not in healthy.data
    cat.close()

    r = run_cli(["--db", db, "plan", "--base", "base", "--experts", "e1", "same", "--op", "ties", "--density", "0.3"])
    assert r.returncode == 0 and f"warning    {warning}" in r.stdout
    r = run_cli(["--db", db, "plan", "--base", "base", "--experts", "e1", "same", "--json"])
    assert r.returncode == 0 and json.loads(r.stdout)["warnings"] == [warning]
    r = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "same", "--out", tmp_path / "m"])
    assert r.returncode == 0, r.stderr
    assert f"warning: {warning}" in r.stderr.splitlines()
    r = run_cli(["--db", db, "explain", "m"])
    assert warning in r.stdout  # stored with the plan


def test_expert_zero_in_every_weighted_tensor_is_warned(tmp_path):
    cat, _ = family_with_copies(tmp_path)
    # 'one' changes TENSOR only; a filter gives that tensor weight 0
    experts = ["e1", {"model": "one", "weight": [{"filter": "mlp.down_proj", "value": 0.0}, {"value": 1.0}]}]
    plan = Planner(cat).plan("base", experts, "task_arithmetic", save=False)
    assert plan.data["warnings"] == ["expert 'one' has a zero delta in every tensor this merge gives it a non-zero "
                                     "weight: it changes nothing in this merge"]
    # weighted on its tensor: no warning
    plan = Planner(cat).plan("base", ["e1", "one"], "task_arithmetic", save=False)
    assert "warnings" not in plan.data
    cat.close()
