"""Reading a search file: the bounded YAML loader and path checks of every config, then the space and the
``search:`` block, then every method's recipe checked as a mergekit config (before any catalog access)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from mergepipe.config.model import MAX_CONFIG_BYTES, ConfigError
from mergepipe.config.parse import _cut, load_yaml, parse_config
from mergepipe.errors import StorageError
from mergepipe.search.settings import Objective, SearchSettings, parse_settings
from mergepipe.search.space import SearchSpace, parse_space
from mergepipe.storage.paths import check_allowed, read_regular


@dataclass(frozen=True)
class SearchFile:
    space: SearchSpace
    settings: SearchSettings
    source: dict  # the document as written (stored with the search)

    def with_overrides(self, executor=None, address=None, concurrency=None, trials=None) -> "SearchFile":
        """Command-line settings over the file's, checked as the file's are."""
        given = {"executor": executor, "address": address, "concurrency": concurrency, "trials": trials}
        block = {**self.source.get("search", {}), **{k: v for k, v in given.items() if v is not None}}
        if not any(v is not None for v in given.values()):
            return self
        settings = parse_settings(block, self.settings.name)
        settings = replace(settings, objective=self.settings.objective, holdout=self.settings.holdout)
        return replace(self, settings=settings, source={**self.source, "search": block})


def load_search(path) -> SearchFile:
    """A search file, read through the path checks (inside $MERGEPIPE_ALLOWED_ROOTS when set, a regular file
    of at most MAX_CONFIG_BYTES); every refusal is one ConfigError line naming the file and the key."""
    path = Path(path)
    try:
        check_allowed(path)
        if not path.is_file():
            raise ConfigError(f"no such search file")
        text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")
        return parse_search(load_yaml(text), default_name=path.stem, root=path.absolute().parent)
    except StorageError as exc:
        raise ConfigError(_cut(str(exc))) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(_cut(msg if msg.startswith(f"{path}: ") else f"{path}: {msg}")) from None


def parse_search(doc, default_name: str = "search", root: Path = Path("."), check_files: bool = True) -> SearchFile:
    """A search document (already loaded): space, settings, objective files beside it (``check_files``
    False: not looked for, e.g. to publish or show a finished search whose files have moved since)."""
    try:
        return _parse(doc, default_name, Path(root), check_files)
    except RecursionError:
        raise ConfigError("the search file is nested too deeply") from None
    except ConfigError as exc:
        raise ConfigError(_cut(str(exc))) from None


def _parse(doc, default_name: str, root: Path, check_files: bool = True) -> SearchFile:
    if not isinstance(doc, dict):
        raise ConfigError("a search file is a mergekit config (a mapping) with a `search:` block")
    config = {k: v for k, v in doc.items() if k != "search"}
    settings = parse_settings(doc.get("search"), default_name)
    if check_files:
        settings = replace(settings, objective=_beside(settings.objective, root, "objective"),
                           holdout=_beside(settings.holdout, root, "holdout") if settings.holdout else None)
    space = parse_space(config)
    for method in space.methods():
        check_recipe(space, sample_values(space, method))
    return SearchFile(space, settings, doc)


def sample_values(space: SearchSpace, method: str) -> dict:
    """One value per dimension that applies to ``method`` (mid-range, first choice): for checking."""
    values = {}
    for dim in space.dimensions:
        if dim.path == ("merge_method",):
            values[dim.name] = method
        elif space.applies(dim, method):
            values[dim.name] = dim.choices[0] if dim.categorical else _middle(dim)
    return values


def _middle(dim) -> float:
    return math.sqrt(dim.low * dim.high) if dim.log else (dim.low + dim.high) / 2


def check_recipe(space: SearchSpace, values: dict) -> dict:
    """The recipe of ``values`` as a mergekit document, refused (one line naming the key) when it is not a
    valid config."""
    doc = space.recipe(values)
    parse_config(yaml.safe_dump(doc, sort_keys=False), source="search space")
    return doc


def _beside(objective: Objective, root: Path, key: str) -> Objective:
    """Files named by an objective are found beside the search file (and must lie in the allowed roots)."""
    if objective.kind == "python":
        module, _, func = objective.target.rpartition(":")
        if not module.endswith(".py"):
            return objective
        target = f"{_checked(root / module, key)}:{func}"
    else:
        target = str(_checked(root / objective.target, key))
    return replace(objective, target=target)


def _checked(path: Path, key: str) -> Path:
    try:
        check_allowed(path)
    except StorageError as exc:
        raise ConfigError(f"search.{key}: {exc}") from None
    if not path.is_file():
        raise ConfigError(f"search.{key}: {path}: no such file")
    return path
