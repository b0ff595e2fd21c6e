"""Shared fixtures for the catalog-foundation tests: small generated families, fresh catalogs, and
helpers to hand-craft safetensors files, load reference tensors and dump a catalog for comparison; and the
test markers (slow, e2e, parity, remote, ray, quick), applied by path in `pytest_collection_modifyitems`."""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.research.family import make_family
from mergepipe.catalog.models import register
from mergepipe.storage.safetensors import INDEX_NAME
from mergepipe.storage.local import proc_io


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Compile (or load from numba's on-disk cache) the fused merge kernels once, before any test: a
    first compile imports numba's compiler modules, which a cold-read test would count as disk reads."""
    from mergepipe.ops import kernels
    kernels.warm_up()


@dataclass(frozen=True)
class Family:
    root: Path
    base: Path
    experts: tuple[Path, ...]
    dtype: str
    sharded: bool

    def all_dirs(self) -> list[Path]:
        return [self.base, *self.experts]


# name -> (size, dtype, shard_bytes, experts). Tiny models (~107k params) cut into small shards.
FAMILY_SPECS = {
    "fp32-sharded": ("tiny", "fp32", 64 << 10, 2),
    "bf16-sharded": ("tiny", "bf16", 32 << 10, 2),
    "fp16-single": ("tiny", "fp16", 1 << 30, 2),
    "fp32-single": ("tiny", "fp32", 1 << 30, 1),
}


def build_family(root: Path, name: str, seed: int = 0) -> Family:
    size, dtype, shard_bytes, experts = FAMILY_SPECS[name]
    paths = make_family(root, experts=experts, size=size, dtype=dtype, shard_bytes=shard_bytes, seed=seed)
    fam = Family(Path(root), Path(paths["base"]), tuple(Path(p) for p in paths["experts"]), dtype,
                 sharded=(Path(paths["base"]) / INDEX_NAME).exists())
    return fam


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, Family]:
    """Every family in FAMILY_SPECS, built once per session; tests must only read them."""
    out = {}
    for name in FAMILY_SPECS:
        out[name] = build_family(tmp_path_factory.mktemp(name), name)
    assert out["fp32-sharded"].sharded and out["bf16-sharded"].sharded
    assert not out["fp16-single"].sharded and not out["fp32-single"].sharded
    return out


@pytest.fixture(params=list(FAMILY_SPECS))
def family(request, families) -> Family:
    return families[request.param]


@pytest.fixture(scope="session")
def fam_fp32(families) -> Family:
    return families["fp32-sharded"]


@pytest.fixture(scope="session")
def fam_bf16(families) -> Family:
    return families["bf16-sharded"]


@pytest.fixture
def fresh_family(tmp_path) -> Family:
    """A private tiny fp32 sharded family that a test may modify."""
    return build_family(tmp_path / "fam", "fp32-sharded")


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog(tmp_path / "catalog.sqlite")
    yield cat
    cat.close()


def register_family(cat: Catalog, fam: Family, prefix: str = "") -> list[str]:
    register(cat, prefix + "base", str(fam.base))
    ids = []
    for i, e in enumerate(fam.experts, start=1):
        register(cat, f"{prefix}expert_{i}", str(e), base_id=prefix + "base")
        ids.append(f"{prefix}expert_{i}")
    return ids


# Small blocks so that the larger matrices of the tiny families are cut into several blocks.
ANALYZE_BLOCK_BYTES = 8192


@pytest.fixture(scope="session")
def analyzed(tmp_path_factory, families):
    """name -> Catalog holding that family registered and analyzed on an 8 KiB grid (read-only)."""
    out = {}
    cats = []
    for name in ("fp32-sharded", "bf16-sharded"):
        cat = Catalog(tmp_path_factory.mktemp("cat-" + name) / "catalog.sqlite")
        cats.append(cat)
        register_family(cat, families[name])
        analyze(cat, block_bytes=ANALYZE_BLOCK_BYTES)
        out[name] = cat
    yield out
    for cat in cats:
        cat.close()


# --- dashboard ----------------------------------------------------------------------------------
# Shared by the dashboard tests. Here and not in tests/dashboard/conftest.py: a second conftest.py (no
# __init__.py) would take the module name `conftest`, and `from conftest import ...` in later test files
# would then find the wrong one. A module that needs another catalog (the Sweeps page: no merge; the
# compact Plan page: compacts) defines its own `built`.
@pytest.fixture(scope="module")
def built(request, tmp_path_factory):
    """dashboard_helpers.build_catalog: the tiny analyzed and merged family, one per test module, read-only."""
    from dashboard_helpers import build_catalog
    return build_catalog(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")))


@pytest.fixture
def env(built, tmp_path, monkeypatch):
    """A private copy of `built`'s catalog shown by the app (MERGEPIPE_DB, allowed roots): AppTest page tests."""
    from dashboard_helpers import page_env
    return page_env(built, tmp_path, monkeypatch)


# --- helpers ------------------------------------------------------------------------------------
def load_checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (file or directory) through the safetensors library."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def to_np32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def write_raw_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    """Write 8-byte LE header length + JSON header + data, exactly as given (no validation)."""
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    Path(path).write_bytes(struct.pack("<Q", n) + raw + data)
    return Path(path)


def dump_catalog(cat: Catalog) -> dict[str, list[tuple]]:
    """Every row of every table, sorted: two equal dumps mean nothing in the catalog changed."""
    tables = [r[0] for r in cat.conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
    out = {}
    for t in tables:
        rows = cat.conn.execute(f"SELECT * FROM {t}").fetchall()
        out[t] = sorted(rows, key=repr)
    return out


def dump_catalog_file(path: Path) -> dict[str, list[tuple]]:
    cat = Catalog(path, create=False)
    try:
        return dump_catalog(cat)
    finally:
        cat.close()


def read_bytes_now() -> int:
    return proc_io()["read_bytes"]


def fsync_tree(*paths: Path) -> None:
    """Flush files to disk so that eviction really drops them from the page cache."""
    for p in paths:
        p = Path(p)
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# --- markers ------------------------------------------------------------------------------------
# The heavy tests, classified by where they live: marker -> node-id patterns (fnmatch, `*` crosses `/`; a
# pattern without "::" names whole files). A new file under tests/parity/ is `parity` with no edit here; an
# explicit `@pytest.mark.slow` (or any of these) on a test or a module works as well. The markers are
# described in pyproject.toml. Every test with none of them also gets `quick`: `pytest -m quick` is the
# quick loop (CONTRIBUTING.md). Nothing is deselected by default: plain `pytest` runs everything.
MARKER_RULES: dict[str, tuple[str, ...]] = {
    # against mergekit 0.1.5, run in a subprocess
    "parity": ("tests/parity/*",),
    # Debian's chromium driven by Playwright against a real Streamlit server
    "e2e": ("tests/dashboard/test_e2e*.py", "tests/dashboard/test_a11y.py", "tests/dashboard/test_demo_dashboard.py"),
    # a Range HTTP server, `mergepipe serve` or moto's S3 server on loopback
    "remote": ("tests/storage/test_remote_*.py", "tests/storage/test_serve.py",
               "tests/planner/test_coalesce.py::test_a_coalescing_plan_*",
               "tests/planner/test_coalesce.py::test_coalesce_flags_on_the_command_line",
               "tests/test_benchmarks.py::test_remote_*"),
    # a local Ray cluster (ray.init or `--executor ray` in a subprocess)
    "ray": ("tests/engine/test_ray_*.py", "tests/*::*_on_ray_*"),
    # the individually slowest of the rest (measured with --durations; each > ~3 s on 2 cores)
    "slow": (),
}
HEAVY_MARKERS = tuple(MARKER_RULES)


def _rule_matches(nodeid: str, pattern: str) -> bool:
    target = nodeid if "::" in pattern else nodeid.split("::", 1)[0]
    return fnmatch.fnmatchcase(target, pattern)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, patterns in MARKER_RULES.items():
            if item.get_closest_marker(marker) is None and any(_rule_matches(item.nodeid, p) for p in patterns):
                item.add_marker(marker)
        if not any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
            item.add_marker("quick")
