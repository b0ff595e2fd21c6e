"""With MERGEPIPE_ALLOWED_ROOTS set, `evaluate` and a union merge read no file outside the roots, whether
MergePipe opens it (--text, --tasks: an absolute path, a symlink, `..`) or transformers would (a tokenizer.json
linked out of the root): one `error:` line naming the path and not the file's content, exit 2, the catalog
byte-identical. Without transformers, `evaluate` says which extra to install. The real CLI, in a process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard_helpers import build_catalog, copy_catalog
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register
from mergepipe.research.evaluate import INSTALL_HINT

from merge_helpers import cli_cmd
from vocab_helpers import added_tokens_family

SECRET = "TOP-SECRET-0451"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    """(inside, outside, built): a catalog and family inside the root; secrets outside it."""
    top = tmp_path_factory.mktemp("roots")
    inside, outside = top / "in", top / "out"
    outside.mkdir()
    built = build_catalog(inside)
    (outside / "secret.txt").write_text(f"{SECRET} " * 40)
    (outside / "secret.jsonl").write_text(json.dumps({"task": SECRET, "prompt": SECRET, "answer": SECRET}) + "\n")
    (inside / "held.txt").write_text("t5 t6 t7 t8 t9 t10 t11 t12 " * 6)
    return inside, outside, built


def cli(args: list, inside: Path, pre: str = "") -> subprocess.CompletedProcess:
    """The real CLI with the roots set to ``inside`` (``pre``: Python run first, in the same process)."""
    env = {**os.environ, "MERGEPIPE_ALLOWED_ROOTS": str(inside), "PYTHONPATH": str(REPO)}
    cmd = [*cli_cmd()] if not pre else [sys.executable, "-c", pre + "; from mergepipe.cli import main; "
                                        "sys.argv = ['mergepipe'] + sys.argv[1:]; sys.exit(main())"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300, env=env)


def refused(proc: subprocess.CompletedProcess, *names) -> str:
    """The one error line of a refusal that names ``names`` and shows nothing of the secrets."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(str(n) in lines[0] for n in names), lines[0]
    assert SECRET not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
    return lines[0]


def given_path(how: str, inside: Path, outside: Path, name: str) -> str:
    if how == "absolute":
        return str(outside / name)
    if how == "dotdot":
        return f"{inside}/../{outside.name}/{name}"
    link = inside / f"link-{name}"
    if not link.is_symlink():
        link.symlink_to(outside / name)
    return str(link)


@pytest.mark.parametrize("flag,name", [("--text", "secret.txt"), ("--tasks", "secret.jsonl")])
@pytest.mark.parametrize("how", ["absolute", "symlink", "dotdot"])
def test_evaluate_files_outside_the_roots_are_refused(area, tmp_path, flag, name, how):
    inside, outside, built = area
    db = copy_catalog(built.db, inside / f"c-{how}-{name}.sqlite")
    before = db.read_bytes()
    path = given_path(how, inside, outside, name)
    line = refused(cli(["--db", db, "evaluate", "base", flag, path], inside), path, outside / name)
    assert "is outside the allowed folders" in line and "MERGEPIPE_ALLOWED_ROOTS" in line
    assert db.read_bytes() == before


def test_evaluate_refuses_a_tokenizer_linked_out_of_the_roots(area):
    inside, outside, built = area
    model = inside / "linked"
    if not model.exists():
        shutil.copytree(built.family / "base", model)
        shutil.copy(model / "tokenizer.json", outside / "tokenizer.json")
        (model / "tokenizer.json").unlink()
        (model / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    db = copy_catalog(built.db, inside / "c-linked.sqlite")
    cat = Catalog(db)
    register(cat, "linked", str(model), base_id="base")
    cat.close()
    before = db.read_bytes()
    line = refused(cli(["--db", db, "evaluate", "linked", "--text", inside / "held.txt"], inside),
                   model / "tokenizer.json", outside / "tokenizer.json")
    assert "is outside the allowed folders" in line
    assert db.read_bytes() == before


def test_evaluate_inside_the_roots_still_scores(area):
    inside, _, built = area
    db = copy_catalog(built.db, inside / "c-ok.sqlite")
    proc = cli(["--db", db, "--json", "evaluate", "base", "--text", inside / "held.txt", "--window", "16"], inside)
    assert proc.returncode == 0, proc.stderr
    (res,) = json.loads(proc.stdout)
    assert res["model_id"] == "base" and res["tokens"] > 10 and res["perplexity"] > 1 and not res["cached"]


def test_a_union_merge_refuses_a_tokenizer_linked_out_of_the_roots(tmp_path):
    inside, outside = tmp_path / "in", tmp_path / "out"
    outside.mkdir()
    base, experts = added_tokens_family(inside)
    tok = experts[0] / "tokenizer.json"
    shutil.move(tok, outside / "tokenizer.json")
    tok.symlink_to(outside / "tokenizer.json")
    cfg = inside / "union.yml"
    cfg.write_text(f"merge_method: linear\nbase_model: {base}\nmodels:\n"
                   + "".join(f"  - model: {e}\n    parameters: {{weight: 1.0}}\n" for e in experts)
                   + "dtype: float32\ntokenizer_source: union\n")
    db = inside / "c.sqlite"
    Catalog(db).close()
    before = db.read_bytes()
    out = inside / "merged"
    line = refused(cli(["--db", db, "merge", "--config", cfg, "--out", out], inside), tok, outside / "tokenizer.json")
    assert "is outside the allowed folders" in line
    assert db.read_bytes() == before and not out.exists()


def test_evaluate_without_transformers_says_which_extra_to_install(area):
    inside, _, built = area
    db = copy_catalog(built.db, inside / "c-notf.sqlite")
    before = db.read_bytes()
    proc = cli(["--db", db, "evaluate", "base", "--text", inside / "held.txt"], inside,
               pre="import sys; sys.modules['transformers'] = None")
    assert proc.returncode == 2 and proc.stderr == f"error: {INSTALL_HINT}\n"
    assert INSTALL_HINT == "evaluating a model needs transformers, which is not installed: pip install 'mergepipe[eval]'"
    assert db.read_bytes() == before


def test_a_sweep_evaluate_text_outside_the_roots_is_refused(area):
    inside, outside, built = area
    given_path("symlink", inside, outside, "secret.txt")
    cfg = inside / "sweep.yml"
    cfg.write_text("name: s\nbase: base\nexperts: [expert_1]\nout: sweep-outs\npoints:\n  - {budget: \"50%\"}\n"
                   "evaluate: {text: link-secret.txt, window: 16}\n")
    db = copy_catalog(built.db, inside / "c-sweep.sqlite")
    before = db.read_bytes()
    line = refused(cli(["--db", db, "sweep", "--config", cfg], inside), "evaluate.text", outside / "secret.txt")
    assert "is outside the allowed folders" in line
    assert db.read_bytes() == before and not (inside / "sweep-outs").exists()
