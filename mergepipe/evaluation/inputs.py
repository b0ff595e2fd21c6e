"""The inputs an evaluation reads: held-out texts and task suites, through the path checks (inside
$MERGEPIPE_ALLOWED_ROOTS when set, a regular file, bounded), parsed before any model is loaded."""

from __future__ import annotations

import hashlib
from pathlib import Path

from mergepipe.config.task_suite import parse_task_suite
from mergepipe.errors import MergePipeError
from mergepipe.evaluation.scoring import check_scoring
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
