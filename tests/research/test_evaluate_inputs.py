"""`evaluate`'s inputs: a stored perplexity is reused only for the same text, window and token limit;
--window/--max-tokens below 2 and task-suite lines that break the JSON parser (a number of 5,000 digits,
100,000-deep nesting) are one `error:` line naming the value or the file and line, exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess

import pytest

from dashboard_helpers import build_catalog, copy_catalog
from mergepipe.catalog.db import Catalog
from mergepipe.cli.app import main
from mergepipe.errors import MergePipeError
from mergepipe.research.evaluate import perplexity, read_task_suite

from merge_helpers import cli_cmd

TEXT = "t5 t6 t7 t8 t9 t10 t11 t12 t13 t14 " * 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("evalin"), merged=False)


@pytest.fixture()
def db(built, tmp_path):
    return copy_catalog(built.db, tmp_path / "c.sqlite")


def evaluate(db, capsys, *args) -> tuple[int, str, str]:
    code = main(["--db", str(db), "--json", "evaluate", "base", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def stored_perplexities(db) -> list[dict]:
    cat = Catalog(db)
    try:
        return cat.query("SELECT dataset, value, tokens FROM evaluations WHERE metric = 'perplexity' "
                         "ORDER BY dataset")
    finally:
        cat.close()


def test_a_new_window_or_token_limit_is_scored_and_stored_apart(built, db, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    runs = {}
    for window, max_tokens in ((8, 64), (8, 64), (16, 64), (8, 32)):
        code, out, err = evaluate(db, capsys, "--text", text, "--window", window, "--max-tokens", max_tokens)
        assert code == 0, err
        (r,) = json.loads(out)
        runs.setdefault((window, max_tokens), []).append(r)
    assert [r["cached"] for r in runs[(8, 64)]] == [False, True]
    assert not runs[(16, 64)][0]["cached"] and not runs[(8, 32)][0]["cached"]
    for (window, max_tokens), (r, *_) in runs.items():
        want = perplexity(built.family / "base", TEXT, window=window, max_tokens=max_tokens)
        assert r["perplexity"] == pytest.approx(want["perplexity"], rel=1e-6) and r["tokens"] == want["tokens"]
    assert runs[(16, 64)][0]["perplexity"] != pytest.approx(runs[(8, 64)][0]["perplexity"], rel=1e-6)
    stored = stored_perplexities(db)
    assert len(stored) == 3
    assert {s["dataset"].split(";", 1)[1] for s in stored} == {
        "window=8;max_tokens=64", "window=16;max_tokens=64", "window=8;max_tokens=32"}


@pytest.mark.parametrize("flag,value", [("--window", 0), ("--window", -5), ("--window", 1),
                                        ("--max-tokens", 0), ("--max-tokens", -5)])
def test_window_and_max_tokens_below_two_are_refused(db, tmp_path, capsys, flag, value):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    before = db.read_bytes()
    code, out, err = evaluate(db, capsys, "--text", text, flag, value)
    assert code == 2 and out == ""
    assert err == f"error: {flag} must be a whole number of at least 2 tokens, not {value}\n"
    assert db.read_bytes() == before


BAD_LINES = {
    "5000 digits": '{"task": "a", "prompt": "p", "answer": ' + "9" * 5000 + "}",
    "5000-digit answer index": '{"task": "a", "prompt": "p", "choices": ["x", "y"], "answer": ' + "9" * 5000 + "}",
    "100k deep": '{"task": "a", "prompt": "p", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "100k deep object": "{" + '"a": {' * 100_000 + "}" * 100_001,
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_suite_line_that_breaks_the_parser_is_one_error_naming_file_and_line(db, tmp_path, capsys, case):
    suite = tmp_path / "s.jsonl"
    suite.write_text(json.dumps({"task": "a", "prompt": "p", "answer": "q"}) + "\n" + BAD_LINES[case] + "\n")
    with pytest.raises(MergePipeError) as e:
        read_task_suite(suite)
    assert str(e.value).startswith(f"{suite}:2: expected a JSON object with task, prompt, answer")
    assert len(str(e.value)) < 400
    before = db.read_bytes()
    code, out, err = evaluate(db, capsys, "--tasks", suite)
    assert code == 2 and out == "" and err == f"error: {e.value}\n"
    assert db.read_bytes() == before


def test_a_deep_suite_line_through_the_real_cli(db, tmp_path):
    suite = tmp_path / "deep.jsonl"
    suite.write_text(BAD_LINES["100k deep"] + "\n")
    proc = subprocess.run([*cli_cmd(), "--db", str(db), "evaluate", "base", "--tasks", str(suite)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {suite}:1: expected a JSON object") and proc.stderr.count("\n") == 1
