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

The measurements live in research/deviation.py (weight space) and, because recipe searches score with
them too, in the product package mergepipe.evaluation: scoring.py (behaviour), model_loading.py (model and
tokenizer) and inputs.py (held-out texts and task suites read through the path checks); this module
re-exports them and adds the CLI.

CLI::

    python -m mergepipe.evaluate accuracy MODEL_DIR --tasks SUITE.jsonl [--json]
    python -m mergepipe.evaluate deviation MODEL_DIR --reference FULL_DIR [--base BASE_DIR] [--json]

``SUITE.jsonl`` holds one ``{"task": ..., "prompt": ..., "answer": ...}`` object per line
(``python -m benchmarks.fidelity.tasks --write SUITE.jsonl`` writes the fidelity suite).
"""

from __future__ import annotations

import argparse
import json
import sys

from mergepipe.config.task_suite import (  # noqa: F401  (the format lives in config)
    TaskExample, parse_task_suite, read_task_suite,
)
from mergepipe.errors import MergePipeError
from mergepipe.research.deviation import bound_check, deviation, load_tensors  # noqa: F401  (re-exported)
from mergepipe.evaluation.inputs import (  # noqa: F401  (re-exported)
    MAX_TEXT_BYTES, read_eval_file, suite_job, text_job,
)
from mergepipe.evaluation.model_loading import (  # noqa: F401  (re-exported)
    BOS, EOS, INSTALL_HINT, PAD, CharTokenizer, import_transformers, load_model, load_tokenizer,
)
from mergepipe.evaluation.scoring import (  # noqa: F401  (re-exported)
    accuracy, check_scoring, choice_loglik, greedy_answers, perplexity, score_task_suite,
)

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
