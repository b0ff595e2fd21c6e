"""`mergepipe doctor`: one line per finding, exit 0 healthy / 1 findings / 2 error; a corrupted catalog is
one `error:` line for every other command. Run as the real executable."""

from __future__ import annotations

import json

import pytest

from doctor_helpers import corrupt_page, doctor_family, make_catalog
from merge_helpers import probe_cli, run_cli_proc


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return doctor_family(tmp_path_factory)


def test_doctor_healthy(family, tmp_path):
    db = make_catalog(family, tmp_path)
    p = run_cli_proc(["doctor", "--db", db])
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"catalog {db} is healthy: integrity_check ok, schema current, "
                                     "nothing to recover, 3 model(s) unchanged"]
    assert p.stderr == ""
    p = run_cli_proc(["--db", db, "doctor", "--json"])
    assert p.returncode == 0 and json.loads(p.stdout)["healthy"] is True


def test_doctor_names_a_changed_model(family, tmp_path):
    db = make_catalog(family, tmp_path, copy_models=True)
    e2 = tmp_path / "models" / family[1][1].name
    shard = sorted(e2.glob("*.safetensors"))[-1]
    with open(shard, "ab") as fh:
        fh.write(b"\0" * 8)
    p = run_cli_proc(["doctor", "--db", db])
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("model e2: ") and str(e2) in lines[0], p.stdout
    assert lines[1] == "1 finding(s)"


def test_corrupted_catalog(family, tmp_path):
    db = make_catalog(family, tmp_path)
    corrupt_page(db)
    p = run_cli_proc(["models", "--db", db])
    assert p.returncode == 2
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(f"error: catalog {db} is corrupted"), p.stderr
    assert f"mergepipe doctor --db {db}" in p.stderr
    p = run_cli_proc(["doctor", "--db", db])
    assert p.returncode == 1, p.stderr
    assert f"catalog {db} is corrupted" in p.stdout.splitlines()[0]
    assert p.stdout.splitlines()[-1] == "1 finding(s) (transactions and models not checked: fix the file first)"


def test_doctor_errors(tmp_path):
    p = run_cli_proc(["doctor", "--db", tmp_path / "missing.sqlite"])
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "no catalog here" in p.stderr
    assert len(p.stderr.splitlines()) == 1


def test_doctor_starts_without_torch(family, tmp_path):
    db = make_catalog(family, tmp_path)
    code, out, heavy = probe_cli("doctor", "--db", db, cwd=tmp_path)
    assert code == 0 and "is healthy" in out
    assert heavy == []
