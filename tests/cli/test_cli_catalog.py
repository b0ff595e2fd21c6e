"""The catalog commands of the CLI, in-process through mergepipe.cli.main and as a real subprocess:
the original MergePipe spellings, --json listings, and user errors as one `error:` line, exit 2,
catalog unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ANALYZE_BLOCK_BYTES, dump_catalog_file, load_checkpoint_tensors, register_family
from mergepipe.analyze.runner import analyze
from mergepipe.catalog.schema import SCHEMA_VERSION
from mergepipe.catalog.db import Catalog
from mergepipe.cli.app import main
from mergepipe.research.family import make_family
from mergepipe.storage.safetensors import INDEX_NAME

MERGEPIPE = Path(sys.executable).parent / "mergepipe"
BLOCK_KEYS = {"tensor", "block", "row_start", "row_end", "offset", "nbytes", "delta_l2", "delta_max_abs",
              "delta_nnz"}


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def template_db(tmp_path_factory, fam_bf16):
    """A catalog holding the bf16 family (base, expert_1, expert_2) with expert_1 analyzed; copied per test."""
    db = tmp_path_factory.mktemp("template") / "cat.sqlite"
    cat = Catalog(db)
    register_family(cat, fam_bf16)
    analyze(cat, ["expert_1"], densities=(0.5,))
    cat.close()  # the last connection checkpoints the WAL into the main file
    assert not Path(str(db) + "-wal").exists()
    return db


@pytest.fixture
def registered(env, template_db):
    db = env / "cat.sqlite"
    shutil.copyfile(template_db, db)
    return db


def test_catalog_commands_end_to_end(env, capsys, fam_bf16, monkeypatch):
    db = env / "my.sqlite"
    rc, out, err = cli(capsys, "init-db", "--db", db)
    assert (rc, err) == (0, "") and db.exists()
    assert out.strip() == f"catalog ready: {db} (schema v{SCHEMA_VERSION})"

    # the original README spelling
    rc, out, err = cli(capsys, "register", "--db", db, "--model-id", "base", "--uri", fam_bf16.base)
    assert rc == 0 and out.startswith("registered: base (sha256:") and err == ""
    rc, out, _ = cli(capsys, "register", "--db", db, "--model-id", "base", "--uri", fam_bf16.base)
    assert rc == 0 and out.startswith("unchanged: base")
    rc, out, _ = cli(capsys, "register", "--db", db, "--model-id", "expert_1", "--uri", fam_bf16.experts[0],
                     "--base", "base", "--json")
    res = json.loads(out)
    assert rc == 0 and res["status"] == "registered" and res["model_id"] == "expert_1"
    # the global flag before the command works too
    assert cli(capsys, "--db", db, "register", "--model-id", "expert_2", "--uri", fam_bf16.experts[1],
               "--base", "base")[0] == 0

    rc, out, _ = cli(capsys, "models", "--db", db, "--json")
    models = json.loads(out)
    assert rc == 0 and [m["id"] for m in models] == ["base", "expert_1", "expert_2"]
    assert [m["analyzed"] for m in models] == [False, False, False]
    assert [m["base_id"] for m in models] == [None, "base", "base"]
    assert all(m["architecture"] == "LlamaForCausalLM" and m["dtype"] == "BF16" for m in models)
    assert "config" not in models[0]

    rc, out, err = cli(capsys, "analyze", "--db", db, "--block-bytes", ANALYZE_BLOCK_BYTES, "--densities", 0.33)
    assert rc == 0 and err == ""
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("expert_1: ") and " blocks, read " in lines[0]
    rc, out, _ = cli(capsys, "analyze", "--db", db, "--json")
    again = json.loads(out)
    assert rc == 0 and [(r["model_id"], r["skipped"]) for r in again] == [("expert_1", True), ("expert_2", True)]
    rc, out, _ = cli(capsys, "analyze", "--db", db, "--model-id", "expert_2")
    assert rc == 0 and out.strip() == "expert_2: unchanged, skipped"

    rc, out, _ = cli(capsys, "--json", "models", "--db", db)
    assert [m["analyzed"] for m in json.loads(out)] == [False, True, True]
    monkeypatch.setenv("COLUMNS", "200")  # rich truncates cells to fit the terminal width
    rc, out, _ = cli(capsys, "models", "--db", db)  # the table rendering
    assert rc == 0 and "expert_1" in out and "LlamaForCausalLM" in out

    rc, out, _ = cli(capsys, "blocks", "--db", db, "--model-id", "expert_1", "--json")
    blocks = json.loads(out)
    assert rc == 0 and blocks
    cat = Catalog(db, create=False)
    want = cat.blocks("expert_1")
    stats = cat.tensor_stats("expert_1")
    cat.close()
    assert len(blocks) == len(want)
    for b, w in zip(blocks, want):
        assert set(b) >= BLOCK_KEYS
        assert {k: b[k] for k in BLOCK_KEYS} == {k: w[k] for k in BLOCK_KEYS}
    # the extra density asked for on the command line is stored
    assert all(0.33 in s["thresholds"] for s in stats.values() if s["delta_nnz"])
    # blocks are consistent with the checkpoint: rows and bytes cover each tensor
    tensors = load_checkpoint_tensors(fam_bf16.experts[0])
    for name, t in tensors.items():
        mine = [b for b in blocks if b["tensor"] == name]
        assert sum(b["nbytes"] for b in mine) == t.numel() * t.element_size()
        assert mine[0]["row_start"] == 0 and mine[-1]["row_end"] == t.shape[0]

    name = "model.layers.1.mlp.down_proj.weight"
    rc, out, _ = cli(capsys, "blocks", "--db", db, "--model-id", "expert_1", "--tensor", name, "--json")
    only = json.loads(out)
    assert rc == 0 and {b["tensor"] for b in only} == {name}
    assert only == [b for b in blocks if b["tensor"] == name]
    assert [b["block"] for b in only] == list(range(len(only)))
    rc, out, _ = cli(capsys, "blocks", "--db", db, "--model-id", "expert_1", "--tensor", name)
    assert rc == 0 and "|d|_2" in out  # delta_l2 (short header at 80 columns)


def test_db_defaults_to_env_then_cwd(env, capsys, fam_bf16, monkeypatch):
    assert cli(capsys, "init-db")[0] == 0
    assert (env / "mergepipe.sqlite").exists()
    other = env / "env.sqlite"
    monkeypatch.setenv("MERGEPIPE_DB", str(other))
    assert cli(capsys, "register", "--model-id", "base", "--uri", fam_bf16.base)[0] == 0
    assert other.exists()
    assert [r[0] for r in dump_catalog_file(other)["models"]] == ["base"]
    assert dump_catalog_file(env / "mergepipe.sqlite")["models"] == []


def test_make_family_command(env, capsys):
    out_dir = env / "fam"
    rc, out, err = cli(capsys, "make-family", out_dir, "--experts", 2, "--size", "tiny", "--dtype", "fp16",
                       "--shard-bytes", 16384, "--seed", 5, "--json")
    assert rc == 0 and err == ""
    paths = json.loads(out)
    assert paths == {"base": str(out_dir / "base"), "experts": [str(out_dir / "expert_1"), str(out_dir / "expert_2")]}
    for p in [paths["base"], *paths["experts"]]:
        p = Path(p)
        assert (p / INDEX_NAME).exists() and (p / "config.json").exists() and (p / "tokenizer.json").exists()
        weight_map = json.loads((p / INDEX_NAME).read_text())["weight_map"]
        assert len(set(weight_map.values())) > 1
        assert {str(t.dtype) for t in load_checkpoint_tensors(p).values()} == {"torch.float16"}
    # reproducible: the same seed through the Python API gives identical tensors
    ref = make_family(env / "ref", experts=2, size="tiny", dtype="fp16", shard_bytes=16384, seed=5)
    a, b = load_checkpoint_tensors(Path(paths["experts"][1])), load_checkpoint_tensors(Path(ref["experts"][1]))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    rc, out, _ = cli(capsys, "make-family", env / "fam2", "--experts", 1, "--size", "tiny")
    assert rc == 0 and out.strip() == f"wrote base {env / 'fam2' / 'base'} and 1 experts"


# --- user errors --------------------------------------------------------------------------------
def _corrupt(env: Path) -> Path:
    p = env / "corrupt.safetensors"
    p.write_bytes((10_000).to_bytes(8, "little") + b'{"w": {}}')
    return p


def _mismatched(env: Path, fam) -> Path:
    from safetensors.torch import save_file
    t = load_checkpoint_tensors(fam.base)
    t.pop("model.norm.weight")
    p = env / "mismatch.safetensors"
    save_file(t, str(p))
    return p


ERROR_CASES = {
    "blocks-unknown-id": (lambda env, fam: ["blocks", "--model-id", "nope", "--json"], "unknown model id 'nope'"),
    "blocks-unknown-tensor": (lambda env, fam: ["blocks", "--model-id", "expert_1", "--tensor", "x.weight"],
                              "no tensor 'x.weight'"),
    "blocks-not-analyzed": (lambda env, fam: ["blocks", "--model-id", "expert_2"], "no block statistics"),
    "analyze-unknown-id": (lambda env, fam: ["analyze", "--model-id", "expert_1", "ghost"], "unknown model id 'ghost'"),
    "analyze-base": (lambda env, fam: ["analyze", "--model-id", "base"], "has no base"),
    "register-bad-path": (lambda env, fam: ["register", "--model-id", "x", "--uri", env / "no" / "where"],
                          "no such file or directory"),
    "register-empty-dir": (lambda env, fam: ["register", "--model-id", "x", "--uri", env], "no .safetensors files"),
    "register-corrupt": (lambda env, fam: ["register", "--model-id", "x", "--uri", _corrupt(env)],
                         "runs past the end of the file"),
    "register-mismatch": (lambda env, fam: ["register", "--model-id", "x", "--uri", _mismatched(env, fam),
                                            "--base", "base"], "missing tensor model.norm.weight"),
    "register-unknown-base": (lambda env, fam: ["register", "--model-id", "x", "--uri", fam.experts[0],
                                                "--base", "nobase"], "unknown model id 'nobase'"),
    "register-changed-content": (lambda env, fam: ["register", "--model-id", "expert_1", "--uri", fam.experts[1],
                                                   "--base", "base"], "--replace"),
    "register-lora-not-an-adapter": (lambda env, fam: ["register", "--model-id", "x", "--uri", fam.experts[0],
                                                       "--base", "base", "--kind", "lora"],
                                     "not a PEFT adapter directory (no adapter_config.json)"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_user_errors_one_line_exit_2_catalog_unchanged(registered, capsys, fam_bf16, case):
    db = registered
    before = dump_catalog_file(db)
    make_args, needle = ERROR_CASES[case]
    rc, out, err = cli(capsys, *make_args(db.parent, fam_bf16), "--db", db)
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in err and out == ""
    assert dump_catalog_file(db) == before


def test_commands_on_a_missing_catalog_do_not_create_it(env, capsys):
    db = env / "absent.sqlite"
    for args in (["models"], ["analyze"], ["blocks", "--model-id", "x"]):
        rc, out, err = cli(capsys, *args, "--db", db)
        assert rc == 2 and out == ""
        assert err.splitlines() == [f"error: {db}: no catalog here (run `mergepipe init-db --db {db}`)"]
    assert not db.exists()


# --- a real subprocess ----------------------------------------------------------------------------
def test_console_script_subprocess(env, fam_bf16):
    assert MERGEPIPE.exists()
    db = env / "sub.sqlite"
    child_env = {k: v for k, v in os.environ.items() if k != "MERGEPIPE_DB"}
    run = lambda *a: subprocess.run([str(MERGEPIPE), *map(str, a)], capture_output=True, text=True,  # noqa: E731
                                    cwd=env, timeout=120, env=child_env)
    p = run("init-db", "--db", db)
    assert p.returncode == 0 and p.stdout.startswith("catalog ready:"), p.stderr
    p = run("register", "--db", db, "--model-id", "base", "--uri", fam_bf16.base)
    assert p.returncode == 0 and p.stdout.startswith("registered: base"), p.stderr
    before = dump_catalog_file(db)
    corrupt = _corrupt(env)
    p = run("register", "--db", db, "--model-id", "x", "--uri", corrupt, "--base", "base")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [p.stderr.strip()] and p.stderr.startswith(f"error: {corrupt}: its header length")
    assert "Traceback" not in p.stderr
    assert dump_catalog_file(db) == before
    p = run("models", "--db", db, "--json")
    assert p.returncode == 0 and [m["id"] for m in json.loads(p.stdout)] == ["base"]
