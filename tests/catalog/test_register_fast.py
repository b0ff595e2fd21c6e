"""Registration in an instant (issue 12): the catalog commands import no torch, and
`register [--base B] PATH [PATH ...]` registers many checkpoints in one transaction, all or none.

Timings live in benchmarks, not here: these tests check what makes registration fast (no torch,
pandas or numpy import; the base parsed once) and what the batch form promises."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mergepipe
import mergepipe.catalog.models as registry
from conftest import dump_catalog, dump_catalog_file, load_checkpoint_tensors
from merge_helpers import HEAVY_MODULES, probe_cli
from mergepipe.catalog.db import Catalog
from mergepipe.cli.app import main
from mergepipe.errors import CatalogError
from mergepipe.storage.local import fingerprint
from mergepipe.catalog.models import named_by_path, register, register_many
from mergepipe.storage.safetensors import open_checkpoint

REPO = Path(mergepipe.__file__).resolve().parents[1]
HEAVY = HEAVY_MODULES


def probe(*args, cwd: Path) -> tuple[int, str, list[str]]:
    """(exit code, stdout, heavy modules imported) of one CLI command in a fresh interpreter."""
    return probe_cli(*args, cwd=cwd, modules=HEAVY)


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def copy_dir(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def base_db(tmp_path, fam_bf16) -> Path:
    """A catalog holding only the bf16 family's base, as `base`."""
    db = tmp_path / "cat.sqlite"
    cat = Catalog(db)
    register(cat, "base", str(fam_bf16.base))
    cat.close()
    return db


# --- no torch on the catalog path -------------------------------------------------------------------
def test_catalog_commands_import_no_torch_numpy_or_pandas(tmp_path, fam_bf16):
    db = tmp_path / "c.sqlite"
    experts = fam_bf16.experts
    commands = [
        ["--help"],
        ["init-db", "--db", db],
        ["register", "--db", db, "--model-id", "base", "--uri", fam_bf16.base],
        ["register", "--db", db, "--base", "base", *experts],
        ["register", "--db", db, "--base", "base", *experts, "--json"],  # unchanged
        ["models", "--db", db],
        ["models", "--db", db, "--json"],
        ["snapshots", "--db", db],
        ["lineage", "--db", db],
        ["recover", "--db", db],
    ]
    for args in commands:
        rc, out, heavy = probe(*args, cwd=tmp_path)
        assert rc == 0, (args, out)
        assert heavy == [], f"{args[0]} imported {heavy}"
    assert [m["id"] for m in json.loads(probe("models", "--db", db, "--json", cwd=tmp_path)[1])] == \
        ["base", "expert_1", "expert_2"]


def test_register_errors_import_no_torch(tmp_path, base_db):
    rc, out, heavy = probe("register", "--db", base_db, "--base", "base", tmp_path / "missing", cwd=tmp_path)
    assert (rc, out, heavy) == (2, "", [])


def test_storage_tables_without_and_with_torch():
    """The parser's ITEMSIZE and the lazily built torch tables agree; DTYPES still imports as before."""
    import torch

    from mergepipe.storage.safetensors import DTYPES, ITEMSIZE, TORCH_TO_CODE, TensorInfo, torch_dtype_of
    assert set(DTYPES) == set(ITEMSIZE)
    for code, (tdtype, size) in DTYPES.items():
        assert size == ITEMSIZE[code] == tdtype.itemsize
        assert TORCH_TO_CODE[tdtype] == code and torch_dtype_of(code) is tdtype
    assert DTYPES["BF16"][0] is torch.bfloat16
    assert TensorInfo("w", "F16", (2,), "f", 8, 4).torch_dtype is torch.float16
    with pytest.raises(AttributeError, match="no attribute 'NOPE'"):
        import mergepipe.storage.safetensors as storage
        storage.NOPE  # noqa: B018


# --- batch registration: the library ------------------------------------------------------------
def rows_but_times(cat: Catalog) -> dict:
    """The catalog's rows less registration times and the change counter."""
    dump = dump_catalog(cat)
    at = [r[1] for r in cat.conn.execute("PRAGMA table_info(models)")].index("registered_at")
    dump["models"] = [row[:at] + row[at + 1:] for row in dump["models"]]
    del dump["meta"]
    return dump


def test_register_many_records_every_expert_like_register(tmp_path, fam_bf16):
    one_by_one = Catalog(tmp_path / "single.sqlite")
    register(one_by_one, "base", str(fam_bf16.base))
    for e in fam_bf16.experts:
        register(one_by_one, e.name, str(e), base_id="base")
    batch = Catalog(tmp_path / "batch.sqlite")
    register(batch, "base", str(fam_bf16.base))
    counter = batch.change_counter()

    results = register_many(batch, named_by_path(fam_bf16.experts), base_id="base")

    assert [(r["model_id"], r["status"]) for r in results] == [("expert_1", "registered"), ("expert_2", "registered")]
    assert batch.change_counter() == counter + 1  # one transaction
    for e, r in zip(fam_bf16.experts, results):
        assert r["fingerprint"] == fingerprint(open_checkpoint(e))
        m = batch.model(e.name)
        assert (m["base_id"], m["kind"], m["uri"], m["fingerprint"]) == ("base", "full", str(e.resolve()),
                                                                          r["fingerprint"])
    assert rows_but_times(batch) == rows_but_times(one_by_one)
    # again: nothing changes, nothing is written
    assert [r["status"] for r in register_many(batch, named_by_path(fam_bf16.experts), base_id="base")] == \
        ["unchanged", "unchanged"]
    assert batch.change_counter() == counter + 1
    one_by_one.close()
    batch.close()


def test_register_many_parses_the_base_once(tmp_path, fam_bf16, monkeypatch):
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(fam_bf16.base))
    experts = [copy_dir(fam_bf16.experts[i % 2], tmp_path / f"e{i}") for i in range(4)]
    opened = []
    real_open = registry.open_checkpoint
    monkeypatch.setattr(registry, "open_checkpoint", lambda uri: opened.append(Path(uri).resolve()) or real_open(uri))
    register_many(cat, named_by_path(experts), base_id="base")
    assert opened.count(fam_bf16.base.resolve()) == 1
    assert sorted(opened) == sorted([fam_bf16.base.resolve(), *(e.resolve() for e in experts)])
    cat.close()


def test_register_many_mixes_new_unchanged_and_replaced(tmp_path, fam_bf16):
    cat = Catalog(tmp_path / "c.sqlite")
    register(cat, "base", str(fam_bf16.base))
    register(cat, "a", str(fam_bf16.experts[0]), base_id="base")
    register(cat, "b", str(fam_bf16.experts[0]), base_id="base")
    items = [("a", fam_bf16.experts[0]), ("b", fam_bf16.experts[1]), ("c", fam_bf16.experts[1])]
    with pytest.raises(CatalogError, match="'b' is already registered"):
        register_many(cat, items, base_id="base")
    res = register_many(cat, items, base_id="base", replace=True)
    assert [r["status"] for r in res] == ["unchanged", "replaced", "registered"]
    assert cat.model("b")["fingerprint"] == cat.model("c")["fingerprint"] != cat.model("a")["fingerprint"]
    cat.close()


def test_named_by_path(tmp_path):
    (tmp_path / "math").mkdir()
    (tmp_path / "w.safetensors").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "math")
    paths = [f"{tmp_path}/math/", f"{tmp_path}/x/../w.safetensors", str(tmp_path / "link")]
    assert named_by_path(paths) == [("math", paths[0]), ("w", paths[1]), ("link", paths[2])]
    with pytest.raises(CatalogError, match=r"would both be named 'math'; register them one at a time"):
        named_by_path([tmp_path / "math", tmp_path / "other" / "math"])


# --- batch registration: the command line -------------------------------------------------------
def test_cli_batch_register(tmp_path, capsys, base_db, fam_bf16):
    rc, out, err = cli(capsys, "register", "--db", base_db, "--base", "base", *fam_bf16.experts)
    assert (rc, err) == (0, "")
    assert [line.split(" (")[0] for line in out.splitlines()] == ["registered: expert_1", "registered: expert_2"]
    rc, out, err = cli(capsys, "register", "--db", base_db, "--base", "base", *fam_bf16.experts, "--json")
    assert rc == 0 and [(r["model_id"], r["status"]) for r in json.loads(out)] == \
        [("expert_1", "unchanged"), ("expert_2", "unchanged")]
    # one path may carry its own id; --uri alone is named after its directory
    rc, out, _ = cli(capsys, "register", "--db", base_db, "--base", "base", "--model-id", "math", fam_bf16.experts[0])
    assert rc == 0 and out.startswith("registered: math (")
    rc, out, _ = cli(capsys, "register", "--db", base_db, "--base", "base", "--uri", fam_bf16.experts[1], "--json")
    assert rc == 0 and json.loads(out)["model_id"] == "expert_2" and json.loads(out)["status"] == "unchanged"


def test_cli_batch_register_lora_and_delta_kinds_need_base(tmp_path, capsys, base_db, fam_bf16):
    before = dump_catalog_file(base_db)
    for kind in ("delta", "lora"):
        rc, out, err = cli(capsys, "register", "--db", base_db, "--kind", kind, *fam_bf16.experts)
        assert rc == 2 and out == "" and err == f"error: a {kind} checkpoint needs --base\n"
    assert dump_catalog_file(base_db) == before


def _corrupt(tmp_path: Path) -> Path:
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "model.safetensors").write_bytes((10_000).to_bytes(8, "little") + b'{"w": {}}')
    return d


def _mismatched(tmp_path: Path, fam) -> Path:
    from safetensors.torch import save_file
    tensors = load_checkpoint_tensors(fam.base)
    tensors.pop("model.norm.weight")
    d = tmp_path / "mismatch"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _twin(tmp_path: Path, fam) -> Path:
    return copy_dir(fam.experts[1], tmp_path / "other" / fam.experts[0].name)


# name -> (extra arguments, given the tmp dir and the family; text the one error line holds)
BAD_BATCHES = {
    "missing-dir": (lambda t, f: ["--base", "base", f.experts[0], t / "missing", f.experts[1]],
                    lambda t, f: f"{t / 'missing'}: no such file or directory"),
    "corrupt-header": (lambda t, f: ["--base", "base", f.experts[0], _corrupt(t), f.experts[1]],
                       lambda t, f: f"{t / 'corrupt' / 'model.safetensors'}: its header length runs past the end"),
    "layout-mismatch": (lambda t, f: ["--base", "base", f.experts[0], f.experts[1], _mismatched(t, f)],
                        lambda t, f: "mismatch does not match base base: missing tensor model.norm.weight"),
    "duplicate-basename": (lambda t, f: ["--base", "base", f.experts[0], f.experts[1], _twin(t, f)],
                           lambda t, f: f"{f.experts[0]} and {t / 'other' / 'expert_1'} would both be named "
                                        f"'expert_1'"),
    "unknown-base": (lambda t, f: ["--base", "nobase", *f.experts], lambda t, f: "unknown model id 'nobase'"),
    "own-base": (lambda t, f: ["--base", "base", f.experts[0], f.base], lambda t, f: "'base': a model cannot be its "
                                                                                      "own base"),
    "not-an-adapter": (lambda t, f: ["--base", "base", "--kind", "lora", *f.experts],
                       lambda t, f: f"{f.experts[0]}: not a PEFT adapter directory"),
    "model-id-with-many": (lambda t, f: ["--model-id", "x", *f.experts], lambda t, f: "--model-id names one"),
    "uri-and-paths": (lambda t, f: ["--uri", f.experts[0], f.experts[1]], lambda t, f: "either --uri PATH or"),
    "nothing": (lambda t, f: ["--base", "base"], lambda t, f: "give the checkpoints to register"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batch_is_one_error_and_changes_nothing(tmp_path, capsys, base_db, fam_bf16, case):
    make_args, make_needle = BAD_BATCHES[case]
    args = make_args(tmp_path, fam_bf16)
    before = dump_catalog_file(base_db)
    rc, out, err = cli(capsys, "register", "--db", base_db, *args)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert make_needle(tmp_path, fam_bf16) in err, err
    assert "Traceback" not in err
    assert dump_catalog_file(base_db) == before


def test_bad_batch_in_a_fresh_process(tmp_path, base_db, fam_bf16):
    before = dump_catalog_file(base_db)
    rc, out, heavy = probe("register", "--db", base_db, "--base", "base", *fam_bf16.experts, _corrupt(tmp_path),
                           cwd=tmp_path)
    assert (rc, out, heavy) == (2, "", [])
    assert dump_catalog_file(base_db) == before


# --- analyze ID [ID ...] ----------------------------------------------------------------------------
def test_analyze_takes_positional_ids(tmp_path, capsys, base_db, fam_bf16):
    assert cli(capsys, "register", "--db", base_db, "--base", "base", *fam_bf16.experts)[0] == 0
    rc, out, err = cli(capsys, "analyze", "--db", base_db, "expert_2", "--block-bytes", 8192, "--json")
    assert rc == 0, err
    assert [r["model_id"] for r in json.loads(out)] == ["expert_2"]
    rc, out, err = cli(capsys, "analyze", "--db", base_db, "expert_1", "ghost")
    assert rc == 2 and "unknown model id 'ghost'" in err


def test_api_exposes_batch_registration():
    from mergepipe import api
    assert api.register_many is register_many and api.register is register
    assert {"register", "register_many"} <= set(api.__all__)
