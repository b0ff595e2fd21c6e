"""Search spaces: a mergekit config whose values may be ranges or choices, plus a ``search:`` block.

```yaml
merge_method: {choice: [ties, dare_ties, task_arithmetic]}   # or a plain list: merge_method is a scalar
base_model: base
models:
  - model: e1
    parameters:
      weight: {range: [0.2, 1.0]}                             # searched as "e1.weight"
      density: [{filter: self_attn, value: {range: [0.1, 0.9]}}, {value: 0.5}]   # "e1.density[self_attn]"
  - model: e2
    parameters: {weight: {range: [0.2, 1.0], name: w2}}       # a name of your own
parameters:
  lambda: {range: [0.5, 2.0], log: true}                      # "lambda"
search: {trials: 40, sampler: tpe, objective: {tasks: val.jsonl}, holdout: {tasks: test.jsonl}}
```

A dimension is a mapping with exactly one of ``range: [low, high]`` (``log``, ``step`` optional) or
``choice: [...]``. Dimensions whose parameter the sampled method does not take are left out of that
trial (and of its recipe), so one space can compare methods. :meth:`SearchSpace.recipe` turns sampled
values into a plain mergekit document; everything here is pure data (no catalog, no optuna).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from mergepipe.config.model import ConfigError
from mergepipe.errors import brief
from mergepipe.ops.core import get_op

MAX_DIMENSIONS = 256
MAX_CHOICES = 64
DIMENSION_KEYS = {"range", "choice", "log", "step", "name"}
DENSITY_STEP = 0.01  # the grid of densities ANALYZE stores thresholds for (analyze/stats.py DEFAULT_DENSITIES)


@dataclass(frozen=True)
class Dimension:
    """One searched value: where it sits in the document (``path``), its name, and its distribution."""

    name: str
    path: tuple  # keys and list indexes from the document's root to the value
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple | None = None
    param: str | None = None  # the operator parameter it sets (None: merge_method or another key)

    @property
    def categorical(self) -> bool:
        return self.choices is not None


@dataclass(frozen=True)
class SearchSpace:
    document: dict  # the config with every dimension in place (search: removed)
    dimensions: tuple[Dimension, ...]

    def method_dimension(self) -> Dimension | None:
        return next((d for d in self.dimensions if d.path == ("merge_method",)), None)

    def methods(self) -> list[str]:
        """Every method a trial may use."""
        dim = self.method_dimension()
        return list(dim.choices) if dim else [self.document.get("merge_method")]

    def applies(self, dim: Dimension, method: str) -> bool:
        """Whether ``dim`` is searched when the trial's method is ``method``."""
        if dim.param is None:
            return True
        return dim.param in {p.name for p in get_op(method).parameters}

    def recipe(self, values: dict) -> dict:
        """The plain mergekit document of a trial: each dimension's value in place (``values`` by name);
        a dimension without a value (its method does not take it) removes its key."""
        doc = copy.deepcopy(self.document)
        for dim in self.dimensions:
            if dim.name in values:
                _set(doc, dim.path, values[dim.name])
        for dim in self.dimensions:
            if dim.name not in values and dim.param is not None:
                _remove(doc, dim.path)
        return _prune_empty(doc)


def parse_space(doc: dict) -> SearchSpace:
    """The dimensions of a search document (its ``search:`` block removed by the caller); one
    ConfigError naming the key for a bad dimension."""
    found: list[Dimension] = []
    _walk(doc, (), found)
    if not found:
        raise ConfigError("the search space has no range or choice to search (e.g. weight: {range: [0, 1]})")
    if len(found) > MAX_DIMENSIONS:
        raise ConfigError(f"the search space has {len(found)} dimensions; at most {MAX_DIMENSIONS}")
    space = name_dimensions(doc, SearchSpace(document=doc, dimensions=tuple(found)))
    methods = space.methods()
    for method in methods:
        get_op_checked(method)
    for dim in space.dimensions:
        if not any(space.applies(dim, m) for m in methods):
            raise ConfigError(f"{_where(dim.path)}: {brief(dim.param)} is not a parameter of "
                              f"{', '.join(get_op(m).name for m in methods)}")
    return space


def get_op_checked(method) -> None:
    if not isinstance(method, str):
        raise ConfigError(f"merge_method must be a method name, not {brief(method)}")
    try:
        get_op(method)
    except Exception as exc:  # PlanError: unknown operator, naming the choices
        raise ConfigError(f"merge_method: {exc}") from None


def _walk(node, path: tuple, found: list) -> None:
    if path == ("merge_method",) and isinstance(node, list):
        found.append(_choice(node, path, "merge_method"))
        return
    if isinstance(node, dict):
        if _is_dimension(node):
            found.append(_dimension(node, path))
            return
        for key, value in node.items():
            _walk(value, path + (key,), found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, path + (i,), found)


def _is_dimension(node: dict) -> bool:
    return "range" in node or "choice" in node


def _where(path: tuple) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def _dimension(node: dict, path: tuple) -> Dimension:
    where = _where(path)
    unknown = sorted(set(node) - DIMENSION_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {brief(unknown[0])} in a search dimension "
                          f"(allowed: {', '.join(sorted(DIMENSION_KEYS))})")
    if ("range" in node) == ("choice" in node):
        raise ConfigError(f"{where}: give either range or choice")
    name = node.get("name", _default_name(path))
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}.name must be a non-empty string")
    if "choice" in node:
        if set(node) - {"choice", "name"}:
            raise ConfigError(f"{where}: log and step apply to a range, not a choice")
        return _choice(node["choice"], path, name)
    return _range(node, path, name, where)


def _range(node: dict, path: tuple, name: str, where: str) -> Dimension:
    bounds = node["range"]
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(_is_number(b) for b in bounds)):
        raise ConfigError(f"{where}.range must be [low, high] (two numbers), not {brief(bounds)}")
    low, high = float(bounds[0]), float(bounds[1])
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError(f"{where}.range must have low < high (finite), not {brief(bounds)}")
    log = node.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log must be true or false, not {brief(log)}")
    if log and low <= 0:
        raise ConfigError(f"{where}: a log range needs low > 0, not {low:g}")
    step = node.get("step")
    if step is not None and (not _is_number(step) or not 0 < float(step) <= high - low):
        raise ConfigError(f"{where}.step must be a positive number at most high - low, not {brief(step)}")
    if step is not None and log:
        raise ConfigError(f"{where}: give log or step, not both")
    param = _param_of(path)
    if step is None and not log and param == "density" and high - low >= DENSITY_STEP:
        step = DENSITY_STEP  # ANALYZE's thresholds grid: a density off it would be analyzed again (read whole)
    return Dimension(name.strip(), path, low, high, log, None if step is None else float(step), param=param)


def _choice(values, path: tuple, name: str) -> Dimension:
    where = _where(path)
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: choice must be a non-empty list, not {brief(values)}")
    if len(values) > MAX_CHOICES:
        raise ConfigError(f"{where}: at most {MAX_CHOICES} choices, not {len(values)}")
    if not all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
        raise ConfigError(f"{where}: choices must be strings, numbers or booleans")
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(f"{where}: a choice is listed twice")
    if path == ("merge_method",):
        for v in values:
            get_op_checked(v)
        values = [get_op(v).name for v in values]
    return Dimension(name.strip(), path, choices=tuple(values), param=_param_of(path))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _param_of(path: tuple) -> str | None:
    """The operator parameter a dimension sets: the key after the last ``parameters``."""
    keys = list(path)
    if "parameters" not in keys:
        return None
    after = keys[len(keys) - 1 - keys[::-1].index("parameters") + 1:]
    return after[0] if after and isinstance(after[0], str) else None


def _default_name(path: tuple) -> str:
    """``lambda``, ``e1.weight``, ``e1.density[self_attn]``, ``slices[0].sources[1].weight``..."""
    param = _param_of(path)
    if param is None:
        return _where(path)
    keys = list(path)
    cut = len(keys) - 1 - keys[::-1].index("parameters")
    owner = keys[:cut]
    prefix = ""
    if len(owner) == 2 and owner[0] == "models" and isinstance(owner[1], int):
        prefix = "{model}."  # filled in with the model's name by _name_models
    elif owner:
        prefix = _where(tuple(owner)) + "."
    rest = keys[cut + 2:]
    suffix = ""
    if len(rest) >= 2 and isinstance(rest[0], int) and rest[1] == "value":
        suffix = f"[{rest[0]}]"  # a filter condition's value: named by its filter below
    elif rest:
        suffix = "." + _where(tuple(rest))
    return f"{prefix}{param}{suffix}"


def name_dimensions(doc: dict, space: SearchSpace) -> SearchSpace:
    """Default names made readable: a model's name for ``{model}``, a filter's name for ``[i]``."""
    renamed = []
    for dim in space.dimensions:
        name = dim.name
        if name != _default_name(dim.path):  # a name of the user's own
            renamed.append(dim)
            continue
        if "{model}" in name:
            entry = doc["models"][dim.path[1]]
            ref = entry.get("model") if isinstance(entry, dict) else None
            name = name.replace("{model}", str(ref) if isinstance(ref, str) else f"models[{dim.path[1]}]")
        if dim.param and name.endswith("]") and len(dim.path) >= 2 and dim.path[-1] == "value":
            cond = _get(doc, dim.path[:-1])
            label = cond.get("filter") if isinstance(cond, dict) else None
            if isinstance(label, str):
                name = name[: name.rindex("[")] + f"[{label}]"
        renamed.append(Dimension(**{**dim.__dict__, "name": name}))
    names = [d.name for d in renamed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"dimension name {brief(twice[0])} is used twice; give one of them `name:`")
    return SearchSpace(space.document, tuple(renamed))


def _get(doc, path: tuple):
    for key in path:
        doc = doc[key]
    return doc


def _set(doc, path: tuple, value) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _remove(doc, path: tuple) -> None:
    """Remove the parameter a dimension sets (every value of it: filter conditions included)."""
    keys = list(path)
    cut = len(keys) - 1 - keys[::-1].index("parameters")
    _get(doc, path[:cut + 1]).pop(path[cut + 1], None)


def _prune_empty(node):
    """Drop the ``parameters`` mappings that removing dimensions left empty."""
    if isinstance(node, dict):
        return {k: _prune_empty(v) for k, v in node.items() if not (k == "parameters" and v == {})}
    if isinstance(node, list):
        return [_prune_empty(v) for v in node]
    return node
