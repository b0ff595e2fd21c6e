"""Task suites: the JSONL format (exact-match and multiple-choice rows), scoring by log-likelihood
against an independent computation, and `mergepipe evaluate --tasks` storing and reusing results."""

from __future__ import annotations

import json

import pytest
import torch

from dashboard_helpers import build_catalog, copy_catalog
from mergepipe.catalog.db import Catalog
from mergepipe.cli.app import main
from mergepipe.errors import MergePipeError
from mergepipe.research.evaluate import (
    TaskExample, load_model, load_tokenizer, read_task_suite, score_task_suite,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("suites"))


@pytest.fixture(scope="module")
def base_model(built):
    d = built.family / "base"
    return load_model(d), load_tokenizer(d)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reference_loglik(model, prompt_ids: list[int], cont_ids: list[int]) -> float:
    """Independent of the library: one token at a time, the next-token distribution after each prefix."""
    total = 0.0
    seq = list(prompt_ids)
    with torch.no_grad():
        for t in cont_ids:
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double()
            total += float(logits[t] - torch.logsumexp(logits, 0))
            seq.append(t)
    return total


def test_read_task_suite_both_formats(tmp_path):
    p = write(tmp_path / "s.jsonl", [
        {"task": "gen", "prompt": "t5 t6", "answer": "t7"},
        {"task": "mc", "prompt": "t5", "choices": ["t8", "t9 t10"], "answer": 1},
        {"task": "mc", "prompt": "t6", "choices": ["t8", "t9"], "answer": "t8"},
    ])
    s = read_task_suite(p)
    assert s == {"gen": [TaskExample("t5 t6", "t7")],
                 "mc": [TaskExample("t5", "t9 t10", ("t8", "t9 t10")), TaskExample("t6", "t8", ("t8", "t9"))]}


@pytest.mark.parametrize("row,words", [
    ({"task": "a", "prompt": "p", "choices": ["x", "y"], "answer": 2}, "answer index 2 is not one of the 2 choices"),
    ({"task": "a", "prompt": "p", "choices": ["x", "y"], "answer": "z"}, "answer 'z' is not one of the choices"),
    ({"task": "a", "prompt": "p", "choices": ["x"], "answer": 0}, "choices must be a list of at least two"),
    ({"task": "a", "prompt": "p"}, "expected a JSON object with task, prompt, answer"),
])
def test_read_task_suite_refusals(tmp_path, row, words):
    p = write(tmp_path / "bad.jsonl", [{"task": "a", "prompt": "p", "answer": "q"}, row])
    with pytest.raises(MergePipeError) as e:
        read_task_suite(p)
    assert str(e.value).startswith(f"{p}:2: ") and words in str(e.value)


def test_multiple_choice_accuracy_matches_an_independent_loglik(base_model):
    model, tok = base_model
    prompts = ["t5 t6 t7", "t20 t21", "t30", "t40 t41 t42 t43"]
    choices = ["t50", "t51 t52", "t53"]
    best = []
    for p in prompts:
        scores = [reference_loglik(model, tok.encode(p, bos=True), tok.encode(c)) for c in choices]
        best.append(choices[scores.index(max(scores))])
    wrong = [next(c for c in choices if c != b) for b in best]
    suite = {"right": [TaskExample(p, b, tuple(choices)) for p, b in zip(prompts, best)],
             "half": [TaskExample(p, b if i % 2 else w, tuple(choices))
                      for i, (p, b, w) in enumerate(zip(prompts, best, wrong))]}
    seen = []
    res = score_task_suite(model, suite, tokenizer=tok, progress=lambda d, t: seen.append((d, t)))
    assert res["per_task"] == {"right": 1.0, "half": 0.5}
    assert res["mean"] == 0.75 and res["examples"] == 8 and seen == [(1, 2), (2, 2)]


def test_evaluate_tasks_stores_per_task_and_reuses(built, tmp_path, capsys, base_model):
    db = copy_catalog(built.db, tmp_path / "c.sqlite")
    model, tok = base_model
    choices = ["t50", "t60"]
    s = [reference_loglik(model, tok.encode("t5 t6", bos=True), tok.encode(c)) for c in choices]
    right = choices[s.index(max(s))]
    suite = write(tmp_path / "suite.jsonl", [
        {"task": "pick", "prompt": "t5 t6", "choices": choices, "answer": right},
        {"task": "pick", "prompt": "t5 t6", "choices": choices, "answer": next(c for c in choices if c != right)},
    ])
    assert main(["--db", str(db), "--json", "evaluate", "base", "--tasks", str(suite)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first == [{"model_id": "base", "metric": "accuracy", "dataset": "suite.jsonl", "value": 0.5,
                      "examples": 2, "per_task": {"pick": 0.5}, "cached": False}]
    assert main(["--db", str(db), "evaluate", "base", "--tasks", str(suite)]) == 0
    assert capsys.readouterr().out == "base: accuracy 0.500 on 2 examples of suite.jsonl (pick 0.500) (stored)\n"
    cat = Catalog(db)
    rows = {r["metric"]: (r["value"], r["tokens"]) for r in cat.query("SELECT * FROM evaluations")}
    cat.close()
    assert rows == {"accuracy": (0.5, 2), "accuracy:pick": (0.5, 2)}


def test_evaluate_tasks_bad_input(built, tmp_path, capsys):
    db = copy_catalog(built.db, tmp_path / "c.sqlite")
    assert main(["--db", str(db), "evaluate", "base"]) == 2
    assert capsys.readouterr().err.strip() == "error: give a held-out text (--text), a task suite (--tasks) or a reference model (--reference)"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["--db", str(db), "evaluate", "base", "--tasks", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:1: expected a JSON object") and err.count("\n") == 1
    cat = Catalog(db)
    assert cat.query("SELECT * FROM evaluations") == []
    cat.close()
