"""Strict JSON for the files MergePipe reads (safetensors headers, shard indexes, config.json): UTF-8,
unique keys, bounded nesting; every failure a StorageError naming the file that describes values by
kind only (never quoting the file's bytes).
"""

from __future__ import annotations

import json

from mergepipe.errors import StorageError

MAX_JSON_DEPTH = 64  # config/index/manifest nesting; a real one is a few levels deep


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_object(pairs: list) -> dict:
    """object_pairs_hook: json.loads silently keeps the last of two equal keys; refuse them instead."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def loads(raw: bytes, path, prefix: str = ""):
    """Strict UTF-8 JSON with unique keys; every failure a StorageError naming ``path`` (``prefix``:
    what is read, e.g. "header is ")."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StorageError(f"{path}: {prefix}not valid JSON (not UTF-8 text: invalid byte at position {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_object)
    except _DuplicateKey as exc:
        raise StorageError(f"{path}: {prefix}not valid (the key {short(exc.key)} appears more than once)") from None
    except json.JSONDecodeError as exc:
        raise StorageError(f"{path}: {prefix}not valid JSON ({exc.msg} at line {exc.lineno}, "
                           f"column {exc.colno})") from None
    except RecursionError:
        raise StorageError(f"{path}: {prefix}not valid JSON (nested too deeply)") from None
    except ValueError:  # Python's int-string limit: an integer of thousands of digits
        raise StorageError(f"{path}: {prefix}not valid (holds a number too large to read)") from None


def too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def kind(value) -> str:
    """What a JSON value is, without quoting it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def short(text, limit: int = 60) -> str:
    """A name from a file, quoted and cut short (ASCII only, so printable anywhere)."""
    text = str(text)
    return ascii(text if len(text) <= limit else text[:limit] + "...")


def is_text(value) -> bool:
    """A string that can be stored and printed (no lone surrogates from JSON \\u escapes, no NUL)."""
    if not isinstance(value, str) or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
