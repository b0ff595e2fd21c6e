"""Commands that do no tensor work start fast (issue 13): `plan` and `explain` (of a plan and of a
snapshot) import no torch; the operator declarations and the planner are torch-free at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mergepipe
from merge_helpers import copy_catalog, probe_cli, shared_family

REPO = Path(mergepipe.__file__).resolve().parents[1]


def probe(*args, cwd: Path) -> tuple[int, str, bool]:
    """(exit code, stdout, whether torch got imported) of one CLI command in a fresh interpreter."""
    rc, out, heavy = probe_cli(*args, cwd=cwd, modules=("torch",))
    return rc, out, heavy == ["torch"]


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


def test_plan_and_explain_import_no_torch(fam, tmp_path):
    db = copy_catalog(fam, tmp_path / "c.sqlite")
    experts = ["e1", "e2"]
    rc, out, torch = probe("--db", db, "--json", "plan", "--base", "base", "--experts", *experts, "--op", "ties",
                           "--density", "0.3", "--budget", "50%", cwd=tmp_path)
    assert rc == 0 and not torch, out
    plan_id = json.loads(out)["plan_id"]
    for args in (["explain", plan_id], ["--json", "explain", plan_id], ["explain", plan_id, "--as-mergekit"],
                 ["plan", "--base", "base", "--experts", *experts, "--op", "linear", "--target-bound", "0.1"]):
        rc, out, torch = probe("--db", db, *args, cwd=tmp_path)
        assert rc == 0 and not torch, (args, out)
        assert plan_id in out or args[0] == "plan"
    # a snapshot: merged in this process (tensor work), explained in a fresh one without torch
    from mergepipe.api import Catalog, merge
    cat = Catalog(db)
    _, sid, _ = merge(cat, "base", experts, tmp_path / "out", operator="linear", budget="50%")
    cat.close()
    rc, out, torch = probe("--db", db, "explain", sid, cwd=tmp_path)
    assert rc == 0 and not torch and out.startswith(f"SNAPSHOT {sid}"), out


def test_operator_declarations_and_planner_import_no_torch():
    code = ("import sys, mergepipe.ops.core, mergepipe.planner.context, mergepipe.planner.request, "
            "mergepipe.config.resolve, mergepipe.cli.app; mergepipe.cli.app.build_parser(); "
            "print('torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
