"""The evaluation harness's command line: user errors are one line on stderr and exit 2."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from mergepipe.research.evaluate import main

from merge_helpers import shared_family


def run(args):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


def test_deviation_of_a_model_from_itself_and_its_base(fam):
    code, out, _ = run(["deviation", fam.dirs()[1], "--reference", fam.dirs()[1], "--json"])
    assert code == 0 and json.loads(out)["absolute"] == 0.0
    code, out, _ = run(["deviation", fam.dirs()[1], "--reference", fam.dirs()[0], "--base", fam.dirs()[0], "--json"])
    res = json.loads(out)
    assert code == 0 and res["absolute"] > 0 and res["relative_delta"] == 0.0  # the reference is the base


@pytest.mark.parametrize("case,message", [
    ("missing model", "no such file or directory"),
    ("missing suite", "cannot read the task suite"),
    ("bad suite row", "expected a JSON object with task, prompt, answer"),
    ("empty suite", "the task suite is empty"),
    ("no tokenizer", "no usable tokenizer"),
])
def test_user_errors_are_one_line_exit_2(fam, tmp_path, case, message):
    suite = tmp_path / "s.jsonl"
    suite.write_text({"bad suite row": '{"task": "t"}\n', "empty suite": "\n"}.get(
        case, json.dumps({"task": "t", "prompt": "ab", "answer": "ba"}) + "\n"))
    args = {
        "missing model": ["deviation", tmp_path / "nope", "--reference", fam.dirs()[0]],
        "missing suite": ["accuracy", fam.dirs()[0], "--tasks", tmp_path / "nope.jsonl"],
        "bad suite row": ["accuracy", fam.dirs()[0], "--tasks", suite],
        "empty suite": ["accuracy", fam.dirs()[0], "--tasks", suite],
        "no tokenizer": ["accuracy", _without_tokenizer(fam.dirs()[0], tmp_path / "bare"), "--tasks", suite],
    }[case]
    code, _, err = run(args)
    assert code == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def _without_tokenizer(src, dest):
    import shutil
    dest.mkdir()
    for f in [*src.glob("*.safetensors*"), src / "config.json"]:
        shutil.copy(f, dest / f.name)
    return dest


def test_accuracy_of_a_model_with_its_tokenizer_runs(fam, tmp_path):
    suite = tmp_path / "s.jsonl"
    suite.write_text("".join(json.dumps({"task": t, "prompt": "ab", "answer": "ba"}) + "\n" for t in ("x", "y")))
    code, out, _ = run(["accuracy", fam.dirs()[0], "--tasks", suite, "--json"])
    res = json.loads(out)
    assert code == 0 and set(res["per_task"]) == {"x", "y"} and 0.0 <= res["mean"] <= 1.0


def test_different_layouts_are_refused(fam, tmp_path):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "other"
    d.mkdir()
    tensors = load_file(next(fam.dirs()[1].glob("*.safetensors")))
    save_file({k: v for k, v in list(tensors.items())[:3]}, d / "model.safetensors")
    code, _, err = run(["deviation", d, "--reference", fam.dirs()[0]])
    assert code == 2 and "have different tensors" in err
