"""A refused `merge --extend` of a non-additive snapshot (issue 28): the from-scratch command it offers is the
snapshot's recipe (operator, density, lambda, budget, seed) with the change applied, runnable as printed (the
test runs it through the real CLI), and the refusal says when the expert is already in the snapshot."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from merge_helpers import cli_cmd, copy_catalog, manifest_of, shared_family

SETTINGS = ["--op", "dare_ties", "--density", "0.2", "--lambda", "0.9", "--seed", "3", "--budget", "60%"]


@pytest.fixture
def snap(tmp_path_factory, tmp_path):
    """A catalog with snapshot `a` = dare_ties(e1, e2) at density 0.2, lambda 0.9, seed 3, budget 60 %."""
    db = copy_catalog(shared_family(tmp_path_factory, "tiny-fp32"), tmp_path / "c.sqlite")
    r = cli(db, tmp_path, "merge", "--base", "base", "--experts", "e1", "e2", "--weights", "1", "0.7",
            *SETTINGS, "--out", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    return db


def cli(db: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    """The real `mergepipe` executable, with the catalog given as the user's environment gives it."""
    env = dict(os.environ, MERGEPIPE_DB=str(db), PYTHONUNBUFFERED="1")
    return subprocess.run(cli_cmd() + [str(a) for a in args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=180)


def refused(db: Path, cwd: Path, *args) -> str:
    """The one error line of a refused command (exit 2, no traceback, catalog byte-identical)."""
    before = db.read_bytes()
    r = cli(db, cwd, *args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert db.read_bytes() == before
    return r.stderr[len("error: "):].rstrip("\n")


def run_offered(db: Path, cwd: Path, message: str, out: Path) -> dict:
    """Run the command the refusal offers, exactly as printed; the published manifest's core."""
    command = message.split("merge the new set from scratch instead: " if "new set" in message
                            else "merge the set from scratch instead: ")[1]
    argv = shlex.split(command)
    assert argv[:2] == ["mergepipe", "merge"] and argv[argv.index("--out") + 1] == str(out)
    r = cli(db, cwd, *argv[1:])
    assert r.returncode == 0, (command, r.stderr)
    assert r.stdout.startswith("published snap-")
    return manifest_of(out)["core"]


def settings_of(core: dict) -> dict:
    return {"operator": core["operator"], "params": core["params"], "seed": core["seed"],
            "budget": core["budget"]["spec"], "strategy": core["strategy"],
            "experts": [(e["id"], e["weight"], e["density"]) for e in core["inputs"]["experts"]]}


def test_offered_command_for_an_add_keeps_the_snapshots_settings_and_publishes(snap, tmp_path):
    message = refused(snap, tmp_path, "merge", "--extend", "a", "--add", "e3", "--weight", "0.5",
                      "--out", tmp_path / "b")
    assert message.startswith("snapshot a was merged with dare_ties, which is not additive")
    assert message.endswith("--experts e1 e2 e3 --op dare_ties --weights 1 0.7 0.5 --density 0.2 --lambda 0.9 "
                            f"--budget 60% --seed 3 --out {tmp_path / 'b'}")
    parent = settings_of(manifest_of(tmp_path / "a")["core"])
    child = settings_of(run_offered(snap, tmp_path, message, tmp_path / "b"))
    assert child == dict(parent, experts=parent["experts"] + [("e3", 0.5, 0.2)])
    assert child["params"]["lambda"] == 0.9 and child["seed"] == 3


def test_adding_an_expert_already_in_the_snapshot_says_so(snap, tmp_path):
    message = refused(snap, tmp_path, "merge", "--extend", "a", "--add", "e1", "--out", tmp_path / "b")
    assert message.startswith("'e1' is already an expert of snapshot a (weight 1): nothing to add")
    assert "mergepipe merge" not in message  # no command that would list e1 twice
    message = refused(snap, tmp_path, "merge", "--extend", "a", "--add", "e1", "--weight", "0.25",
                      "--out", tmp_path / "b")
    assert message.startswith("'e1' is already an expert of snapshot a (weight 1); snapshot a was merged with "
                              "dare_ties, which is not additive")
    assert "--experts e1 e2 --op dare_ties --weights 0.25 0.7 --density 0.2" in message
    parent = settings_of(manifest_of(tmp_path / "a")["core"])
    child = settings_of(run_offered(snap, tmp_path, message, tmp_path / "b"))
    assert child == dict(parent, experts=[("e1", 0.25, 0.2), ("e2", 0.7, 0.2)])


def test_offered_command_for_a_remove_runs(snap, tmp_path):
    message = refused(snap, tmp_path, "merge", "--extend", "a", "--remove", "e2", "--out", tmp_path / "b",
                      "--model-id", "smaller")
    assert message.endswith(f"--out {tmp_path / 'b'} --model-id smaller")
    core = run_offered(snap, tmp_path, message, tmp_path / "b")
    assert settings_of(core)["experts"] == [("e1", 1.0, 0.2)]
    assert manifest_of(tmp_path / "b")["run"]["model_id"] == "smaller"


def test_changing_an_expert_the_snapshot_does_not_hold_is_refused_plainly(snap, tmp_path):
    for change in (["--remove", "e3"], ["--reweight", "e3", "2"]):
        message = refused(snap, tmp_path, "merge", "--extend", "a", *change, "--out", tmp_path / "b")
        assert message == "'e3' is not an expert of snapshot a (its experts: e1, e2)"
