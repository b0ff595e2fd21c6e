"""Paths: with MERGEPIPE_ALLOWED_ROOTS set, every file read or written resolves (symlinks followed)
inside the roots; only regular files are opened (a FIFO never blocks a reader); errors name paths,
never file contents; the dashboard inherits the caller's roots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.dashboard import paths as dashboard_paths
from mergepipe.errors import StorageError
from mergepipe.research.family import make_family
from mergepipe.storage.paths import ROOTS_ENV, allowed_roots, check_allowed, open_regular, read_regular

from merge_helpers import dump_db, run_cli, run_cli_proc

SECRET = "TOP-SECRET-CONTENT-0123456789"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    fam = make_family(root / "allowed" / "fam", experts=1, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=5)
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.safetensors").write_text(SECRET * 100)
    shutil.copytree(fam["experts"][0], outside / "real-expert")
    return {"root": root, "allowed": root / "allowed", "outside": outside, **fam}


def _linked_model(family, name: str, target: Path) -> Path:
    d = family["allowed"] / name
    if not d.exists():
        shutil.copytree(family["experts"][0], d)
        for f in d.glob("*.safetensors"):
            f.unlink()
        (d / "model.safetensors").symlink_to(target)
    return d


def _register(db: Path, *args) -> tuple:
    before = dump_db(db) if db.exists() else None
    res = run_cli(["--db", db, "register", *map(str, args)])
    return res, before


def test_a_symlink_out_of_the_roots_is_refused_and_nothing_is_echoed(tmp_path, family, monkeypatch):
    db = tmp_path / "c.sqlite"
    assert run_cli(["--db", db, "register", "--model-id", "base", "--uri", family["base"]]).returncode == 0
    for name, target in (("evil-secret", family["outside"] / "secret.safetensors"),
                         ("evil-real", family["outside"] / "real-expert" / "model.safetensors")):
        model = _linked_model(family, name, target)
        monkeypatch.setenv(ROOTS_ENV, str(family["allowed"]))
        res, before = _register(db, "--model-id", name, "--uri", model, "--base", "base")
        assert res.returncode == 2
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ")
        assert f"a link to {target}" in lines[0] and "outside the allowed folders" in lines[0]
        assert SECRET[:10] not in res.stderr + res.stdout
        assert dump_db(db) == before
    # a directory that is itself a link out of the roots
    (family["allowed"] / "dir-link").symlink_to(family["outside"] / "real-expert")
    res, before = _register(db, "--model-id", "dl", "--uri", family["allowed"] / "dir-link", "--base", "base")
    assert res.returncode == 2 and "outside the allowed folders" in res.stderr and dump_db(db) == before
    # without roots the command line acts for its user: a link to a real checkpoint registers
    monkeypatch.delenv(ROOTS_ENV)
    res, _ = _register(db, "--model-id", "evil-real", "--uri", family["allowed"] / "evil-real", "--base", "base")
    assert res.returncode == 0, res.stderr


def test_the_secret_is_not_echoed_without_roots_either(tmp_path, family, monkeypatch):
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    res, _ = _register(tmp_path / "c.sqlite", "--model-id", "s", "--uri", family["outside"] / "secret.safetensors")
    assert res.returncode == 2 and "not a safetensors file" in res.stderr
    assert SECRET[:10] not in res.stderr


@pytest.mark.parametrize("fifo_name", ["model.safetensors", "config.json"])
def test_a_fifo_is_refused_at_once(tmp_path, family, fifo_name):
    d = tmp_path / "fifo-model"
    shutil.copytree(family["experts"][0], d)
    (d / fifo_name).unlink()
    os.mkfifo(d / fifo_name)
    res = run_cli_proc(["--db", tmp_path / "c.sqlite", "register", "--model-id", "f", "--uri", d], timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {d / fifo_name}: is a FIFO, not a regular file"


def test_open_regular_refuses_devices_and_directories(tmp_path, monkeypatch):
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    with pytest.raises(StorageError, match="is a character device, not a regular file"):
        open_regular("/dev/zero")
    with pytest.raises(StorageError, match="is a directory, not a regular file"):
        open_regular(tmp_path)
    big = tmp_path / "big.json"
    big.write_bytes(b"{}" + b" " * 100)
    with pytest.raises(StorageError, match="larger than the 50-byte limit"):
        read_regular(big, limit=50)
    assert read_regular(big) == b"{}" + b" " * 100


def test_outputs_outside_the_roots_are_refused(tmp_path, family, monkeypatch):
    db = tmp_path / "c.sqlite"
    for args in (["--model-id", "base", "--uri", family["base"]],
                 ["--model-id", "e1", "--uri", family["experts"][0], "--base", "base"]):
        assert run_cli(["--db", db, "register", *map(str, args)]).returncode == 0
    monkeypatch.setenv(ROOTS_ENV, f"{family['allowed']}{os.pathsep}{tmp_path}")
    before = dump_db(db)
    out = family["outside"] / "merged"
    res = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "--out", out])
    assert res.returncode == 2 and "outside the allowed folders" in res.stderr
    assert not out.exists() and dump_db(db) == before
    res = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "--out", tmp_path / "merged"])
    assert res.returncode == 0, res.stderr


def test_roots_are_resolved(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv(ROOTS_ENV, f"{tmp_path / 'link'}{os.pathsep}{tmp_path / 'link'}{os.pathsep}")
    assert allowed_roots() == [(tmp_path / "real").resolve()]
    assert check_allowed(tmp_path / "link" / "x") == (tmp_path / "real" / "x").resolve()
    monkeypatch.setenv(ROOTS_ENV, "")
    assert allowed_roots() is None


def test_the_dashboard_holds_storage_to_its_roots(tmp_path, family, monkeypatch):
    """Started by hand (no MERGEPIPE_ALLOWED_ROOTS), the app's default roots also bind the storage
    layer, so a YAML or registration through the dashboard cannot follow a link out of them."""
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    env = dict(os.environ)
    roots = dashboard_paths.allowed_roots(family["allowed"] / "c.sqlite", env, cwd=family["allowed"])
    assert roots == [family["allowed"].resolve()] and env[ROOTS_ENV] == str(family["allowed"].resolve())
    monkeypatch.setenv(ROOTS_ENV, env[ROOTS_ENV])
    from mergepipe.api import register
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(family["base"]))
    with pytest.raises(StorageError, match="outside the allowed folders"):
        register(cat, "evil", str(_linked_model(family, "evil-real", family["outside"] / "real-expert" /
                                                 "model.safetensors")), base_id="base")
    assert [m["id"] for m in cat.models()] == ["base"]


def test_a_linked_tokenizer_file_does_not_carry_an_outside_file_into_the_output(tmp_path, family, monkeypatch):
    base = family["allowed"] / "base-linked-tok"
    if not base.exists():
        shutil.copytree(family["base"], base)
        (base / "tokenizer.json").unlink(missing_ok=True)
        (base / "tokenizer.json").symlink_to(family["outside"] / "secret.safetensors")
    db = tmp_path / "c.sqlite"
    assert run_cli(["--db", db, "register", "--model-id", "base", "--uri", base]).returncode == 0
    assert run_cli(["--db", db, "register", "--model-id", "e1", "--uri", family["experts"][0],
                    "--base", "base"]).returncode == 0
    monkeypatch.setenv(ROOTS_ENV, f"{family['allowed']}{os.pathsep}{tmp_path}")
    res = run_cli(["--db", db, "merge", "--base", "base", "--experts", "e1", "--out", tmp_path / "merged"])
    assert res.returncode == 2 and "outside the allowed folders" in res.stderr and SECRET[:10] not in res.stderr
    assert not (tmp_path / "merged").exists()


def test_merge_configs_are_read_through_the_path_checks(tmp_path, family, monkeypatch):
    from mergepipe.config.model import ConfigError
    from mergepipe.config.parse import load_config
    secret = family["outside"] / "merge.yml"
    secret.write_text(f"# {SECRET}\nmerge_method: linear\nmodels: []\n")
    link = family["allowed"] / "linked.yml"
    if not link.exists():
        link.symlink_to(secret)
    monkeypatch.setenv(ROOTS_ENV, str(family["allowed"]))
    with pytest.raises(ConfigError, match="outside the allowed folders") as err:
        load_config(link)
    assert SECRET[:10] not in str(err.value)
    fifo = tmp_path / "fifo.yml"
    os.mkfifo(fifo)
    monkeypatch.delenv(ROOTS_ENV)
    with pytest.raises(ConfigError, match="no such config file"):  # not a regular file: never opened
        load_config(fifo)
