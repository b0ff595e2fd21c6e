"""Read one YAML document defensively (:func:`load_yaml`): a key given twice, nesting deeper than
MAX_DEPTH and more than MAX_NODES values once aliases are expanded are refused, each as one
:class:`ConfigError` line, before anything is built."""

from __future__ import annotations

import re

import yaml

from mergepipe.config.model import ConfigError
from mergepipe.errors import brief


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)):
            continue
        if key in seen:
            raise ConfigError(f"duplicate key {brief(key)} (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str):
    """One YAML document, through the shape checks (depth, values with aliases expanded) and the
    duplicate-key loader; every refusal is one :class:`ConfigError` line."""
    try:
        _check_shape(text)
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {(str(exc).splitlines() or [''])[0]}") from None
    except RecursionError:
        raise ConfigError("not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError):  # PyYAML's int(): a number of thousands of digits
        raise ConfigError("not valid YAML: holds a number too large to read") from None


MAX_DEPTH = 64  # a merge config nests a few levels; PyYAML's composer recurses once per level
MAX_NODES = 200_000  # values in a document, an alias counted at the size of what it names
_OPENERS = re.compile(r"(?:[\[{][ \t\r\n]*){%d}" % (MAX_DEPTH + 1))


def _check_shape(text: str) -> None:
    """Refuse from the event stream (which PyYAML parses without recursion), before anything is built:
    nesting deeper than MAX_DEPTH (the recursive composer would take seconds to hit the recursion
    limit), and more than MAX_NODES values once aliases are expanded (nested anchors make a 1 KB
    "billion laughs" of 10^9 values, which any walk over the document -- a message, a check -- would
    then take hours and gigabytes to visit)."""
    if _OPENERS.search(text):  # the scanner alone is quadratic in the flow depth: refuse the obvious at once
        raise ConfigError(f"not valid YAML: nested more than {MAX_DEPTH} levels deep")
    sizes: dict[str, int] = {}  # anchor -> values under it
    open_: list[list] = [[0, None]]  # per open collection: [values so far, its anchor]
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([1, event.anchor])
            if len(open_) - 1 > MAX_DEPTH:
                mark = event.start_mark
                raise ConfigError(f"not valid YAML (line {mark.line + 1}, column {mark.column + 1}): nested more "
                                  f"than {MAX_DEPTH} levels deep")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            n, anchor = open_.pop()
        elif isinstance(event, yaml.AliasEvent):
            n, anchor = sizes.get(event.anchor, 1), None
        elif isinstance(event, yaml.ScalarEvent):
            n, anchor = 1, event.anchor
        else:
            continue
        if anchor is not None:
            sizes[anchor] = n
        open_[-1][0] += n
        if open_[-1][0] > MAX_NODES:
            raise ConfigError(f"refused: the document holds more than {MAX_NODES:,} values once its aliases "
                              f"(*name) are expanded")
