"""Merge fidelity: how far a budgeted merge is from the full-budget merge, and what it can still do.

Two kinds of measurement, both for any model directory (a registered checkpoint or a merge output):

* **Weight space** (:func:`deviation`). For a budgeted merge ``M_A``, the full-budget merge ``M_full``
  of the same operator and parameters, and the base ``B`` (all tensors as float32, flattened together
  into one vector, non-float tensors ignored):

  - ``relative``       = ||M_A - M_full||_2 / ||M_full||_2
    The *relative l2 deviation* the MergePipe paper reports ("8.84e-4 at budget 0.5"): deviation of
    the budgeted merge from the full-budget merge, relative to the size of the full-budget model.
  - ``relative_delta`` = ||M_A - M_full||_2 / ||M_full - B||_2
    The same deviation relative to the size of the merged *update*. This is what the planner's error
    bound is expressed in (``plan["error_bound"]["relative"]``), and a much stricter scale: fine-tuning
    deltas are small next to the weights.
  - ``absolute``       = ||M_A - M_full||_2, comparable with ``plan["error_bound"]["absolute"]``.

  :func:`bound_check` compares the realized absolute deviation with the plan's bound (additive
  operators, invariant 3: realized <= bound).

* **Behaviour** (:func:`accuracy`). Per-task exact-match accuracy and their mean, by greedy decoding
  with the model. Tasks are passed in as ``{task name: [(prompt, answer), ...]}``, so the library does
  not depend on any particular task suite. Models with a ``vocab.json`` whose tokens are single
  characters plus ``<pad>``, ``<s>``, ``</s>`` use :class:`CharTokenizer` (the fidelity family in
  ``benchmarks/fidelity`` does); other models use ``transformers.AutoTokenizer``.

transformers is imported lazily (optional extra ``[eval]``). Every file it loads (config, weights, tokenizer)
comes from a checked copy of the model folder (:func:`~mergepipe.storage.tokenizer_files.checked_folder`), and
held-out texts and task suites are read through the same path checks ($MERGEPIPE_ALLOWED_ROOTS).

The measurements live in research/deviation.py (weight space), research/scoring.py (behaviour) and
research/model_loading.py (model and tokenizer); this module re-exports them and adds the inputs'
checks (held-out texts, task suites) and the CLI.

CLI::

    python -m mergepipe.evaluate accuracy MODEL_DIR --tasks SUITE.jsonl [--json]
    python -m mergepipe.evaluate deviation MODEL_DIR --reference FULL_DIR [--base BASE_DIR] [--json]

``SUITE.jsonl`` holds one ``{"task": ..., "prompt": ..., "answer": ...}`` object per line
(``python -m benchmarks.fidelity.tasks --write SUITE.jsonl`` writes the fidelity suite).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from mergepipe.config.task_suite import (  # noqa: F401  (the format lives in config)
    TaskExample, parse_task_suite, read_task_suite,
)
from mergepipe.errors import MergePipeError
from mergepipe.research.deviation import bound_check, deviation, load_tensors  # noqa: F401  (re-exported)
from mergepipe.research.model_loading import (  # noqa: F401  (re-exported)
    BOS, EOS, INSTALL_HINT, PAD, CharTokenizer, import_transformers, load_model, load_tokenizer,
)
from mergepipe.research.scoring import (  # noqa: F401  (re-exported)
    accuracy, check_scoring, choice_loglik, greedy_answers, perplexity, score_task_suite,
)
from mergepipe.storage.paths import check_allowed, read_regular

MAX_TEXT_BYTES = 256 << 20  # a held-out text or task suite


def read_eval_file(path, label: str = "") -> bytes:
    """The bytes of a held-out text or task suite: inside the allowed roots (symlinks followed), a regular
    file, at most MAX_TEXT_BYTES; ``label`` prefixes the errors (``evaluate.text: ``)."""
    try:
        check_allowed(path)
        if not Path(path).is_file():
            raise MergePipeError(f"{path} is not a file")
        return read_regular(path, MAX_TEXT_BYTES)
    except MergePipeError as exc:
        raise MergePipeError(f"{label}{exc}") from None


def text_job(path, window: int, max_tokens: int) -> dict:
    """A held-out text to score by perplexity (``mergepipe evaluate --text``), read through the path checks.
    ``dataset`` keys a stored result: the text's sha256 with the window and token limit, which change it."""
    check_scoring(window, max_tokens)
    data = read_eval_file(path)
    return {"metric": "perplexity", "dataset": f"{_digest(data)};window={window};max_tokens={max_tokens}",
            "name": Path(path).name, "text": data.decode("utf-8", errors="replace"), "window": window,
            "max_tokens": max_tokens}


def suite_job(path) -> dict:
    """A task suite to score (``mergepipe evaluate --tasks``): read once through the path checks, parsed
    before any model is loaded; ``dataset``: the file's sha256."""
    data = read_eval_file(path)
    return {"metric": "accuracy", "dataset": _digest(data), "name": Path(path).name,
            "suite": parse_task_suite(data, path)}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_suite(path) -> dict[str, list[tuple[str, str]]]:
    """A task suite as (prompt, answer) pairs per task (the format: :func:`read_task_suite`)."""
    return {name: [(ex.prompt, ex.answer) for ex in examples] for name, examples in read_task_suite(path).items()}


def write_suite(suite: dict[str, list[tuple[str, str]]], path) -> None:
    with open(path, "w") as fh:
        for name, pairs in suite.items():
            for p, a in pairs:
                fh.write(json.dumps({"task": name, "prompt": p, "answer": a}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mergepipe.evaluate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy", help="per-task exact-match accuracy of a model directory")
    a.add_argument("model_dir")
    a.add_argument("--tasks", required=True, help="JSONL suite: {task, prompt, answer} per line")
    a.add_argument("--json", action="store_true")
    d = sub.add_parser("deviation", help="relative l2 deviation of a model from a reference model")
    d.add_argument("model_dir")
    d.add_argument("--reference", required=True, help="the full-budget merge")
    d.add_argument("--base", help="the base model (adds the deviation relative to the merged update)")
    d.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except MergePipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.cmd == "accuracy":
        res = accuracy(args.model_dir, read_suite(args.tasks))
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            for name, acc in res["per_task"].items():
                print(f"{name:<16} {acc:.3f}")
            print(f"{'mean':<16} {res['mean']:.3f}")
    else:
        res = deviation(args.model_dir, args.reference, args.base)
        res.pop("per_tensor")
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"||M - R||            {res['absolute']:.6g}")
            print(f"||M - R|| / ||R||     {res['relative']:.6e}  (relative l2 deviation)")
            if "relative_delta" in res:
                print(f"||M - R|| / ||R - B|| {res['relative_delta']:.6e}  (relative to the merged update)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
