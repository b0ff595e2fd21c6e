"""Helpers for the Plan -> Execute -> Manifest tests: generated families analyzed once per session,
cheap private catalog copies, output loading, hashing, catalog dumps and CLI runners.

Families are built (and analyzed) once per test session per spec and then only read. Every test
that changes a catalog works on its own copy of the analyzed template (an SQLite backup), so tests
never see each other's plans, snapshots or registrations.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.research.family import make_family
from mergepipe.catalog.models import register

# Every top-k fraction the tests use: ties at 0.3/0.5, breadcrumbs (gamma 0.01) at 0.3/0.5.
DENSITIES = (0.01, 0.2, 0.21, 0.3, 0.31, 0.5, 0.51)
ALL_OPS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs",
           "breadcrumbs_ties", "della", "della_linear")
STAGING_MARK = ".mergepipe-staging-"


@dataclass(frozen=True)
class FamSpec:
    size: str
    dtype: str
    shard_bytes: int
    experts_on_disk: int
    experts_registered: int
    block_bytes: int
    seed: int = 0


SPECS = {
    # Tiny llama (~107k params): 8 input shards, ~250 blocks of 4 KiB per expert.
    "tiny-fp32": FamSpec("tiny", "fp32", 64 << 10, 4, 3, 4096),
    "tiny-bf16": FamSpec("tiny", "bf16", 32 << 10, 3, 3, 4096),
    # Small llama (~5M params), fp32: a merge takes long enough (della) to be killed at many points.
    "small-fp32": FamSpec("small", "fp32", 8 << 20, 2, 2, 64 << 10),
    # Small llama, bf16, 4 MiB shards, 256 KiB blocks: for the cold-cache /proc/self/io measurements.
    "small-bf16": FamSpec("small", "bf16", 4 << 20, 2, 2, 256 << 10),
}


@dataclass(frozen=True)
class Fam:
    name: str
    spec: FamSpec
    root: Path
    base: Path
    experts: tuple[Path, ...]  # on disk (the first experts_registered are registered as e1, e2, ...)
    template_db: Path

    @property
    def expert_ids(self) -> list[str]:
        return [f"e{i}" for i in range(1, self.spec.experts_registered + 1)]

    def dirs(self) -> list[Path]:
        return [self.base, *self.experts]


_CACHE: dict[str, Fam] = {}


def shared_family(tmp_path_factory, name: str) -> Fam:
    """The family ``name`` built and analyzed once per session (read-only: never modify it)."""
    if name not in _CACHE:
        spec = SPECS[name]
        root = tmp_path_factory.mktemp("fam-" + name)
        paths = make_family(root / "fam", experts=spec.experts_on_disk, size=spec.size, dtype=spec.dtype,
                            shard_bytes=spec.shard_bytes, seed=spec.seed)
        db = root / "template.sqlite"
        cat = Catalog(db)
        try:
            register(cat, "base", paths["base"])
            for i, e in enumerate(paths["experts"][: spec.experts_registered], start=1):
                register(cat, f"e{i}", e, base_id="base")
            analyze(cat, block_bytes=spec.block_bytes, densities=DENSITIES)
            cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            cat.close()
        _CACHE[name] = Fam(name, spec, root, Path(paths["base"]), tuple(Path(p) for p in paths["experts"]), db)
    return _CACHE[name]


def copy_catalog(fam: Fam, dest: Path) -> Path:
    """A private copy of the family's analyzed catalog at ``dest`` (a .sqlite path)."""
    dest = Path(dest)
    src = sqlite3.connect(str(fam.template_db))
    dst = sqlite3.connect(str(dest))
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return dest


def open_copy(fam: Fam, dest: Path) -> Catalog:
    return Catalog(copy_catalog(fam, dest))


# --- outputs ------------------------------------------------------------------------------------
def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (all *.safetensors files) through safetensors."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} appears twice in {path}"
            out[k] = v
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def dir_hashes(path: Path, pattern: str = "*") -> dict[str, str]:
    """name -> sha256 of every regular file directly in ``path`` (the manifest excluded)."""
    return {p.name: sha256_file(p) for p in sorted(Path(path).glob(pattern))
            if p.is_file() and p.name != "mergepipe_manifest.json"}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def l2_dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b||_2 over all tensors, in float64."""
    assert set(a) == set(b)
    return float(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)) ** 0.5


def l2_norm(a: dict[str, torch.Tensor]) -> float:
    return float(sum(float((v.double() ** 2).sum()) for v in a.values())) ** 0.5


# --- catalog ------------------------------------------------------------------------------------
def dump_db(path: Path) -> dict[str, list]:
    """Every row of every table of the catalog at ``path``, sorted (read through a fresh connection)."""
    conn = sqlite3.connect(str(path))
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in tables}
    finally:
        conn.close()


def rows(path: Path, sql: str, params=()) -> list[dict]:
    conn = sqlite3.connect(str(path))
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


def check_catalog_consistent(db: Path) -> None:
    """Snapshots, their models, manifests and lineage agree with each other."""
    snaps = rows(db, "SELECT * FROM snapshots")
    models = {m["id"]: m for m in rows(db, "SELECT * FROM models")}
    manifests = {m["snapshot_id"]: m for m in rows(db, "SELECT * FROM manifests")}
    for s in snaps:
        m = models.get(s["model_id"])
        assert m is not None, f"snapshot {s['id']} has no model row"
        assert m["snapshot_id"] == s["id"]
        assert s["id"] in manifests and manifests[s["id"]]["manifest_hash"] == s["manifest_hash"]
        assert Path(s["out"]).is_dir(), f"published snapshot {s['id']} has no directory {s['out']}"
        assert rows(db, "SELECT 1 FROM lineage WHERE child_id = ?", [s["model_id"]])
    snap_ids = {s["id"] for s in snaps}
    for m in models.values():
        if m["snapshot_id"]:
            assert m["snapshot_id"] in snap_ids, f"model {m['id']} points at missing snapshot {m['snapshot_id']}"
    for e in rows(db, "SELECT * FROM lineage"):
        assert e["child_id"] in models and e["parent_id"] in models


# --- CLI ----------------------------------------------------------------------------------------
def cli_cmd() -> list[str]:
    script = Path(sys.executable).parent / "mergepipe"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mergepipe.cli"]


SLOW_WRITES = """
import sys, time
from mergepipe.storage import writers
real_write = writers.ShardWriter.write
def write(self, offset, data):
    time.sleep(0.02)
    return real_write(self, offset, data)
writers.ShardWriter.write = write
from mergepipe.cli.app import main
sys.exit(main(sys.argv[1:]))
"""


def slowed_cli_cmd() -> list[str]:
    """The real CLI with every output write 20 ms late: a merge of a small family then lasts seconds, so a
    test can signal it mid-write however fast the machine merges."""
    return [sys.executable, "-c", SLOW_WRITES]


def run_cli_proc(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the real ``mergepipe`` executable."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cli_cmd() + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(args: list[str]) -> CliResult:
    """Run ``mergepipe.cli.main`` in this process, capturing stdout and stderr."""
    from mergepipe.cli.app import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())


def manifest_of(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "mergepipe_manifest.json").read_text())


def plan_kwargs_for_baseline(plan) -> dict:
    """Arguments for mergepipe.research.baselines.naive_merge that reproduce ``plan`` at full budget."""
    return dict(operator=plan["operator"], weights=[e["weight"] for e in plan["experts"]],
                densities=[1.0 if e["density"] is None else e["density"] for e in plan["experts"]],
                params=plan["params"], seed=plan["seed"], block_bytes=plan["grid"]["block_bytes"],
                expert_ids=[e["id"] for e in plan["experts"]], expert_kinds=[e["kind"] for e in plan["experts"]])


def fsync_dirs(*paths: Path) -> None:
    """Flush files to disk so that evicting them really drops them from the page cache."""
    for p in paths:
        for f in [q for q in Path(p).rglob("*") if q.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# --- start-up probes ------------------------------------------------------------------------------
REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("torch", "numpy", "pandas")
# Runs the CLI as `python -m mergepipe.cli` does, then reports which of MODULES got imported.
PROBE = """
import runpy, sys
MODULES = sys.argv.pop(1).split(",")
sys.argv = ["mergepipe", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("mergepipe.cli", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print("HEAVY:" + ",".join(m for m in MODULES if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def probe_cli(*args, cwd: Path, modules=HEAVY_MODULES) -> tuple[int, str, list[str]]:
    """(exit code, stdout, which of ``modules`` got imported) of one CLI command in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "MERGEPIPE_DB"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", PROBE, ",".join(modules), *map(str, args)], capture_output=True,
                       text=True, cwd=cwd, env=env, timeout=120)
    *errors, last = p.stderr.splitlines()
    assert last.startswith("HEAVY:"), p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, [m for m in last[len("HEAVY:"):].split(",") if m]


def catalog_counts(db: Path) -> dict[str, int]:
    """Rows per catalog table a refused merge must leave as they were."""
    dump = dump_db(db)
    return {t: len(dump[t]) for t in ("models", "plans", "snapshots", "analyses") if t in dump}


def assert_config_refused(cat, db: Path, config: Path, tmp_path: Path, expected: str) -> None:
    """``merge --config`` refuses ``config`` with ``expected``: through the API (ConfigError) and the CLI (one
    ``error:`` line, non-zero exit), nothing written and the catalog's rows as they were."""
    import pytest
    from mergepipe import api
    from mergepipe.config.model import ConfigError
    before = catalog_counts(db)
    with pytest.raises(ConfigError) as exc:
        api.merge_config(cat, config, tmp_path / "out", model_id="bad")
    assert str(exc.value) == expected
    r = run_cli(["--db", db, "merge", "--config", config, "--out", tmp_path / "cli-out", "--model-id", "bad-cli"])
    assert r.returncode != 0 and r.stderr.strip() == f"error: {expected}", r.stderr
    assert catalog_counts(db) == before and not (tmp_path / "out").exists() and not (tmp_path / "cli-out").exists()


def slice_source(model, start, end, **params) -> dict:
    """One ``slices:`` source: model, layer_range and (when given) its parameters."""
    s = {"model": str(model), "layer_range": [start, end]}
    if params:
        s["parameters"] = params
    return s
