"""The local Ray cluster that `merge --executor ray` starts: every listening TCP socket of its processes
is on loopback, Ray's token authentication is on (no warning printed), and the merge through it gives the
local executor's output byte for byte. A real CLI process; its Ray processes are watched while it runs."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from pathlib import Path

import psutil

from mergepipe.engine.engine import Engine
from mergepipe.planner.context import Planner
from mergepipe.planner.request import MergeRequest

from merge_helpers import cli_cmd, dir_hashes, open_copy, shared_family

SHARD = 48 << 10


def is_loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def watch(proc: subprocess.Popen) -> tuple[set, dict]:
    """(process name, host, port) of every listening TCP socket of ``proc`` and its descendants, and
    the environment of its gcs_server, sampled until ``proc`` exits."""
    listening, gcs_env = set(), {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                listening |= {(p.name(), s.laddr.ip, s.laddr.port) for s in p.net_connections("tcp")
                              if s.status == psutil.CONN_LISTEN}
                if p.name() == "gcs_server" and not gcs_env:
                    gcs_env = p.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    return listening, gcs_env


def test_a_local_cluster_listens_on_loopback_only_with_token_auth(tmp_path_factory, tmp_path):
    fam = shared_family(tmp_path_factory, "tiny-bf16")
    db = tmp_path / "c.sqlite"
    open_copy(fam, db).close()
    out = tmp_path / "ray-out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([*cli_cmd(), "--db", str(db), "merge", "--base", "base", "--experts", "e1", "e2",
                             "--op", "ties", "--density", "0.3", "--out", str(out), "--out-shard-size", str(SHARD),
                             "--executor", "ray"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        listening, gcs_env = watch(proc)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    assert [s for s in listening if not is_loopback(s[1])] == []
    assert gcs_env.get("RAY_AUTH_MODE") == "token" and len(gcs_env.get("RAY_AUTH_TOKEN", "")) == 64
    assert "Token authentication" not in stderr and "token" not in stderr.lower()

    local = tmp_path / "local-out"
    cat = open_copy(fam, tmp_path / "local.sqlite")
    try:
        plan = Planner(cat).plan(MergeRequest.build("base", ["e1", "e2"], "ties", density=0.3), save=False)
        Engine(cat).execute(plan, out=local, out_shard_bytes=SHARD)
    finally:
        cat.close()
    assert dir_hashes(out) == dir_hashes(local)
