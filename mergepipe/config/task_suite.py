"""The task-suite format of ``mergepipe evaluate --tasks`` and the dashboard's Evaluate: JSONL, one example
per line. Parsing only (no model): the dashboard checks a suite before it starts a run. The file is read through
the path checks (inside $MERGEPIPE_ALLOWED_ROOTS when set, a regular file); any bad line -- a number of
thousands of digits, nesting deeper than the parser's recursion limit -- is one error naming file and line."""

from __future__ import annotations

import dataclasses
import json

from mergepipe.errors import MergePipeError, StorageError
from mergepipe.storage.paths import read_regular

MAX_SUITE_BYTES = 64 << 20


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
            shown = answer if answer.bit_length() <= 64 else "(a number of thousands of digits)"
            raise TypeError(f"answer index {shown} is not one of the {len(choices)} choices")
        answer = choices[answer]
    if answer not in choices:
        raise TypeError(f"answer {_shown(answer)} is not one of the choices")
    return TaskExample(prompt, str(answer), tuple(choices))


def _shown(value, limit: int = 60) -> str:
    """A short repr for a message (an int of more than 4,300 digits has no repr: ValueError)."""
    try:
        text = repr(value)
    except ValueError:
        return "(a value too large to show)"
    return text if len(text) <= limit else text[:limit] + "..."


def read_task_suite(path) -> dict[str, list[TaskExample]]:
    """A JSONL task suite: one object per line, ``{"task", "prompt", "answer"}`` (exact match) or
    ``{"task", "prompt", "choices": [...], "answer": index or choice}`` (multiple choice)."""
    try:
        data = read_regular(path, MAX_SUITE_BYTES)
    except StorageError as exc:
        raise MergePipeError(f"cannot read the task suite: {exc}") from None
    return parse_task_suite(data, path)


def parse_task_suite(data: bytes, path) -> dict[str, list[TaskExample]]:
    """The suite in ``data`` (the bytes of the file ``path``, named in errors)."""
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise MergePipeError(f"{path}: cannot read the task suite ({exc.reason} at byte {exc.start})") from None
    suite: dict[str, list[TaskExample]] = {}
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
                suite.setdefault(str(row["task"]), []).append(_example(row))
            # ValueError: bad JSON, or a number past Python's 4,300-digit limit; RecursionError: deep nesting
            except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
                reason = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
                raise MergePipeError(f"{path}:{i}: expected a JSON object with task, prompt, answer and optionally "
                                     f"choices ({reason[:200]})") from None
    if not suite:
        raise MergePipeError(f"{path}: the task suite is empty")
    return suite
