"""Merges as range tasks on a real local Ray cluster (one per module, 2 CPUs): bit-identical to the
local executor for every operator (passthrough: see tests/parity/test_parity_slices.py), realized bytes summed from the workers equal to the plan,
a worker process killed mid-task (SIGKILL from inside the task) retried to a correct snapshot or
failing cleanly, and the CLI's --executor ray (joining the cluster, and without Ray installed)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from mergepipe.analyze.runner import analyze
from mergepipe.engine.engine import Engine
from mergepipe.engine.ranges import KILL_ENV
from mergepipe.engine.ray_executor import RayExecutor, runtime_env
from mergepipe.errors import ExecutionError
from mergepipe.planner.context import Planner
from mergepipe.planner.request import MergeRequest

from merge_helpers import STAGING_MARK, cli_cmd, dir_hashes, manifest_of, open_copy, rows, shared_family

SHARD = 48 << 10  # several output shards, so range tasks write into more than one file


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-bf16")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("ray")


@pytest.fixture(scope="module")
def cat(fam, workdir):
    c = open_copy(fam, workdir / "c.sqlite")
    analyze(c, ["e1", "e2", "e3"], arcee=True)  # the interpolation methods' Gram statistics, arcee's thresholds
    yield c
    c.close()


_counter = itertools.count()


def out_dir(workdir: Path, tag: str) -> Path:
    return workdir / f"{tag}-{next(_counter)}"


CASES = {
    "linear": dict(experts=["e1", "e2", "e3"], budget="60%"),
    "task_arithmetic": dict(experts=["e1", "e2", "e3"], lam=0.8),
    "ties": dict(experts=["e1", "e2", "e3"], density=0.3, budget="50%"),
    "dare_linear": dict(experts=["e1", "e2"], density=0.5),
    "dare_ties": dict(experts=["e1", "e2", "e3"], density=0.3, budget="70%"),
    "breadcrumbs_ties": dict(experts=["e1", "e2"], density=0.5, gamma=0.01),
    "della": dict(experts=["e1", "e2"], density=0.5, epsilon=0.1),
    "slerp": dict(experts=["e1"], t=0.3),
    "breadcrumbs": dict(experts=["e1", "e2"], density=0.5, gamma=0.01),
    "della_linear": dict(experts=["e1", "e2", "e3"], density=0.5, epsilon=0.1, budget="80%"),
    "nuslerp": dict(experts=["e1", "e2"], weights=[1.0, 2.0]),
    "model_stock": dict(experts=["e1", "e2", "e3"]),
    "multislerp": dict(experts=["e1", "e2"]),
    "karcher": dict(experts=["e1", "e2", "e3"]),
    "nearswap": dict(experts=["e1"], t=0.5),
    "sce": dict(experts=["e1", "e2", "e3"]),
    "ram": dict(experts=["e1", "e2", "e3"]),
    "ramplus_tl": dict(experts=["e1", "e2", "e3"]),
    "arcee_fusion": dict(experts=["e1"]),
}


def plan_for(cat, op: str):
    case = dict(CASES[op])
    return Planner(cat).plan(MergeRequest.build("base", case.pop("experts"), op, **case), save=False)


@pytest.mark.parametrize("op", list(CASES))
def test_ray_output_is_the_local_output_bit_for_bit(cluster, cat, workdir, op):
    plan = plan_for(cat, op)
    local = out_dir(workdir, f"{op}-local")
    distributed = out_dir(workdir, f"{op}-ray")
    _, m_local = Engine(cat).execute(plan, out=local, out_shard_bytes=SHARD)
    _, m_ray = Engine(cat, executor=RayExecutor()).execute(plan, out=distributed, out_shard_bytes=SHARD)
    assert dir_hashes(distributed) == dir_hashes(local)  # every shard, the index, config, the model card
    assert len(list(distributed.glob("*.safetensors"))) > 1
    assert m_ray.core == m_local.core and m_ray.manifest_hash == m_local.manifest_hash
    assert m_ray.run["range_tasks"] >= 2 and "range_tasks" not in m_local.run
    # the realized bytes are the workers' counters summed: equal to the plan, expert by expert
    assert m_ray.core["realized_by_expert"] == plan["expert_read_by_expert"]
    assert m_ray.core["realized"]["expert_read"] == sum(m_ray.core["realized_by_tensor"].values()) \
        == sum(plan["expert_read_by_expert"].values()) > 0
    snap = rows(Path(cat.path), "SELECT * FROM snapshots WHERE id = ?", (m_ray.snapshot_id,))
    assert snap and snap[0]["out"] == str(distributed)


def test_a_worker_killed_mid_task_is_retried_to_the_same_snapshot(cluster, cat, workdir, monkeypatch):
    plan = plan_for(cat, "ties")
    local = out_dir(workdir, "kill-local")
    _, m_local = Engine(cat).execute(plan, out=local, out_shard_bytes=SHARD)
    marker = workdir / "killed-once"
    monkeypatch.setenv(KILL_ENV, str(marker))
    out = out_dir(workdir, "kill-ray")
    _, m_ray = Engine(cat, executor=RayExecutor(retries=2)).execute(plan, out=out, out_shard_bytes=SHARD)
    assert marker.exists()  # a worker process really died (SIGKILL after its first write)
    assert dir_hashes(out) == dir_hashes(local)
    assert m_ray.manifest_hash == m_local.manifest_hash
    assert m_ray.core["realized_by_expert"] == plan["expert_read_by_expert"]  # the dead attempt is not counted


def test_a_merge_whose_worker_dies_without_retries_publishes_nothing(cluster, cat, workdir, monkeypatch):
    plan = plan_for(cat, "dare_ties")
    db = Path(cat.path)
    before = {t: rows(db, f"SELECT * FROM {t}") for t in ("models", "snapshots")}
    marker = workdir / "killed-no-retry"
    monkeypatch.setenv(KILL_ENV, str(marker))
    out = out_dir(workdir, "dead")
    with pytest.raises(ExecutionError) as err:
        Engine(cat, executor=RayExecutor(retries=0)).execute(plan, out=out, out_shard_bytes=SHARD)
    assert marker.exists()
    assert "did not finish on Ray (WorkerCrashedError, 0 retries); nothing was published" in str(err.value)
    assert not out.exists()
    assert not [p for p in workdir.iterdir() if STAGING_MARK in p.name]
    assert {t: rows(db, f"SELECT * FROM {t}") for t in ("models", "snapshots")} == before
    assert rows(db, "SELECT status FROM txns ORDER BY rowid DESC LIMIT 1") == [{"status": "aborted"}]


def test_cli_merge_joins_the_cluster_at_address(cluster, fam, workdir):
    db = workdir / "cli.sqlite"
    open_copy(fam, db).close()
    out = out_dir(workdir, "cli-ray")
    proc = subprocess.run([*cli_cmd(), "--db", str(db), "--json", "merge", "--base", "base", "--experts", "e1", "e2",
                           "--op", "ties", "--density", "0.3", "--out", str(out), "--out-shard-size", str(SHARD),
                           "--executor", "ray", "--address", cluster],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["snapshot_id"] == manifest_of(out)["run"]["snapshot_id"]
    assert manifest_of(out)["run"]["range_tasks"] >= 2
    local = out_dir(workdir, "cli-local")
    c = open_copy(fam, workdir / "cli-local.sqlite")
    try:
        plan = Planner(c).plan(MergeRequest.build("base", ["e1", "e2"], "ties", density=0.3), save=False)
        Engine(c).execute(plan, out=local, out_shard_bytes=SHARD)
    finally:
        c.close()
    assert dir_hashes(out) == dir_hashes(local)


def test_cli_executor_ray_without_ray_says_how_to_install_it(fam, workdir):
    db = workdir / "noray.sqlite"
    open_copy(fam, db).close()
    out = out_dir(workdir, "noray")
    code = ("import sys; sys.modules['ray'] = None; from mergepipe.cli import main; "
            "sys.argv = ['mergepipe'] + sys.argv[1:]; sys.exit(main())")
    before = rows(db, "SELECT * FROM plans")
    proc = subprocess.run([sys.executable, "-c", code, "--db", str(db), "merge", "--base", "base", "--experts", "e1",
                           "--out", str(out), "--executor", "ray"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 2
    assert proc.stderr == "error: --executor ray needs Ray, which is not installed: pip install 'mergepipe[ray]'\n"
    assert not out.exists() and rows(db, "SELECT * FROM plans") == before


def test_address_without_ray_executor_is_refused(fam, workdir):
    db = workdir / "addr.sqlite"
    open_copy(fam, db).close()
    proc = subprocess.run([*cli_cmd(), "--db", str(db), "merge", "--base", "base", "--experts", "e1",
                           "--out", str(workdir / "addr-out"), "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 2 and proc.stderr == "error: --address goes with --executor ray\n"


def test_an_error_raised_in_a_task_fails_the_merge_with_its_own_message(cluster, cat, workdir):
    """A merged block that overflows to Inf is refused inside a worker; the driver re-raises that
    ExecutionError unchanged (not retried), and nothing is published."""
    plan = Planner(cat).plan(MergeRequest.build("base", ["e1", "e2"], "task_arithmetic", lam=1e300), save=False)
    with pytest.raises(ExecutionError) as local_err:
        Engine(cat).execute(plan, out=out_dir(workdir, "inf-local"))
    out = out_dir(workdir, "inf-ray")
    with pytest.raises(ExecutionError) as ray_err:
        Engine(cat, executor=RayExecutor()).execute(plan, out=out)
    # the same refusal (which block a worker hits first depends on the order tasks finish)
    pattern = (r"the merge of tensor \S+ \(block \d+\) gives \d+ non-finite values \(\d+ NaN, \d+ Inf\) in bf16; "
               r"an input or a parameter made them .*; nothing was published")
    assert re.fullmatch(pattern, str(local_err.value)) and re.fullmatch(pattern, str(ray_err.value))
    assert type(ray_err.value) is ExecutionError
    assert not out.exists() and not [p for p in workdir.iterdir() if STAGING_MARK in p.name]
