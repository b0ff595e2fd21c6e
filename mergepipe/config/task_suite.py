"""The task-suite format of ``mergepipe evaluate --tasks`` and the dashboard's Evaluate: JSONL, one example
per line. Parsing only (no model): the dashboard checks a suite before it starts a run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mergepipe.errors import MergePipeError


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """One example of a task suite: with ``choices`` a multiple-choice question scored by log-likelihood
    (lm-eval-harness ``acc``: the choice whose tokens the model finds likeliest after the prompt), without
    them a generation scored by exact match of the greedy continuation (:func:`accuracy`)."""
    prompt: str
    answer: str
    choices: tuple[str, ...] | None = None


def _example(row: dict) -> TaskExample:
    prompt, answer, choices = str(row["prompt"]), row["answer"], row.get("choices")
    if choices is None:
        return TaskExample(prompt, str(answer))
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise TypeError("choices must be a list of at least two non-empty strings")
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < len(choices):
            raise TypeError(f"answer index {answer} is not one of the {len(choices)} choices")
        answer = choices[answer]
    if answer not in choices:
        raise TypeError(f"answer {answer!r} is not one of the choices")
    return TaskExample(prompt, str(answer), tuple(choices))


def read_task_suite(path) -> dict[str, list[TaskExample]]:
    """A JSONL task suite: one object per line, ``{"task", "prompt", "answer"}`` (exact match) or
    ``{"task", "prompt", "choices": [...], "answer": index or choice}`` (multiple choice)."""
    suite: dict[str, list[TaskExample]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MergePipeError(f"{path}: cannot read the task suite ({exc.strerror if isinstance(exc, OSError) else exc})") from None
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
                suite.setdefault(str(row["task"]), []).append(_example(row))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise MergePipeError(f"{path}:{i}: expected a JSON object with task, prompt, answer and optionally "
                                     f"choices ({exc})") from None
    if not suite:
        raise MergePipeError(f"{path}: the task suite is empty")
    return suite
