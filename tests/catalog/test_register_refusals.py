"""A refused registration leaves the catalog as it was (issue 14): every class of malformed checkpoint is
refused by ``register`` (API) and ``mergepipe register`` (one ``error:`` line, exit 2) before anything is
written; the catalog's full SQL dump (``sqlite3`` iterdump: schema and every row, sorted) is identical
before and after (read through any WAL the command left). (The file's bytes are not compared: opening a catalog
REPLACEs its schema_version row, which changes page bytes and row order but no content.)"""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import _architecture, register
from mergepipe.cli.app import main
from mergepipe.errors import CatalogError, MergePipeError, StorageError
from mergepipe.storage.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mergepipe.storage.safetensors import INDEX_NAME

W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _file(path: Path, header, data_len: int = 8) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)
    return path


def _dir(path: Path, weight_map=None, config=None) -> Path:
    path.mkdir()
    _file(path / "model-1.safetensors", {"w": W})
    if weight_map is not None:
        (path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    if config is not None:
        (path / "config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    return path


def _adapter(path: Path, config) -> Path:
    path.mkdir()
    _file(path / ADAPTER_WEIGHTS, {"m.l.lora_A.weight": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]},
                                   "m.l.lora_B.weight": {"dtype": "F32", "shape": [2, 1], "data_offsets": [8, 16]}}, 16)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config))
    return path


# name -> (make(tmp) -> path, kind, error type, needles in the message)
BAD = {
    "dtype list": (lambda t: _file(t / "x.safetensors", {"w": dict(W, dtype=["F32"])}), "full", StorageError,
                   ["x.safetensors", "'w'", "dtype"]),
    "5000-digit offset": (lambda t: _file(t / "x.safetensors", b'{"w": {"dtype": "F32", "shape": [2], '
                                          b'"data_offsets": [0, ' + b"9" * 5000 + b"]}}"), "full", StorageError,
                          ["x.safetensors", "number too large"]),
    "deep metadata": (lambda t: _file(t / "x.safetensors", b'{"__metadata__": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
                      "full", StorageError, ["x.safetensors", "nested too deeply"]),
    "duplicate names": (lambda t: _file(t / "x.safetensors", b'{"w": {"dtype": "F32", "shape": [2], '
                                        b'"data_offsets": [0, 8]}, "w": {"dtype": "F32", "shape": [2], '
                                        b'"data_offsets": [0, 8]}}'), "full", StorageError,
                        ["x.safetensors", "'w' appears more than once"]),
    "index value list": (lambda t: _dir(t / "ck", {"w": ["model-1.safetensors"]}), "full", StorageError,
                         [INDEX_NAME, "weight_map['w']", "is a list"]),
    "index value null": (lambda t: _dir(t / "ck", {"w": None}), "full", StorageError,
                         [INDEX_NAME, "weight_map['w']", "is null"]),
    "index path escape": (lambda t: _dir(t / "ck", {"w": "../ck/model-1.safetensors"}), "full", StorageError,
                          [INDEX_NAME, "weight_map['w']", "no path"]),
    "architectures int": (lambda t: _dir(t / "ck", config={"architectures": 3}), "full", StorageError,
                          ["config.json", "architectures"]),
    "config not object": (lambda t: _dir(t / "ck", config=b"[1, 2]"), "full", StorageError,
                          ["config.json", "expected a JSON object"]),
    "adapter alpha list": (lambda t: _adapter(t / "ad", {"r": 1, "lora_alpha": [1]}), "lora", CatalogError,
                           [ADAPTER_CONFIG, "lora_alpha"]),
}


@pytest.fixture
def db(tmp_path) -> Path:
    """A catalog holding one good checkpoint, closed (its WAL checkpointed into the file)."""
    path = tmp_path / "cat.sqlite"
    cat = Catalog(path)
    register(cat, "base", str(_file(tmp_path / "base.safetensors", {"w": W})))
    cat.close()
    return path


def _state(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        dump = sorted(conn.iterdump())  # sorted: opening a catalog REPLACEs a meta row (new rowid)
    finally:
        conn.close()
    return dump


@pytest.mark.parametrize("case", list(BAD))
def test_refused_register_leaves_the_catalog_byte_identical(tmp_path, capsys, db, case):
    make, kind, error, needles = BAD[case]
    bad = make(tmp_path)
    base = "base" if kind == "lora" else None
    before = _state(db)
    cat = Catalog(db)
    try:
        with pytest.raises(error) as ei:
            register(cat, "bad", str(bad), base_id=base, kind=kind)
    finally:
        cat.close()
    assert isinstance(ei.value, MergePipeError)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    assert _state(db) == before
    args = ["register", "--db", str(db), "--model-id", "bad", "--uri", str(bad), "--kind", kind]
    rc = main(args + (["--base", "base"] if base else []))
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert needles[0] in err
    assert _state(db) == before


@pytest.mark.parametrize("config, expected", [
    ({"architectures": ["A", "B"]}, "A,B"),
    ({"architectures": "A"}, "A"),
    ({"architectures": 7, "model_type": "llama"}, "llama"),
    ({"architectures": [1, None], "model_type": ["x"]}, None),
    ({}, None),
    ([], None),
])
def test_architecture_never_crashes_on_odd_configs(config, expected):
    assert _architecture("full", config) == expected


def test_lora_architecture_never_crashes():
    assert _architecture("lora", {"r": 10**5000, "lora_alpha": float("nan"), "target_modules": [3, "q"]}) \
        == "LoRA r=None alpha=None on q"


@pytest.mark.parametrize("args", [["~no-such-user-xyz/ckpt"], ["--model-id", "x", "--uri", "~no-such-user-xyz/ckpt"]])
def test_tilde_of_no_such_user_is_one_error(capsys, db, args):
    before = _state(db)
    rc = main(["register", "--db", str(db), *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: ~no-such-user-xyz/ckpt: cannot expand '~'"), err
    assert _state(db) == before
