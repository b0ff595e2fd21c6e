"""Sweep configs: a YAML file naming a base, experts and the points to merge (a grid, a list, or both).

```yaml
name: ties-vs-dare           # default: the file's stem
base: base
experts: [e1, e2, e3]
out: sweeps/                 # point i is published at <out>/<name>-<i> as model <name>-<i>
executor: ray                # or local (default): points one after another in this process
address: auto                # with ray: the cluster to join (default: a new local one)
concurrency: 2               # with ray: merges in flight at once (default 2)
settings: {seed: 0}          # shared by every point
grid:                        # every combination (keys: operator and the merge request's settings)
  operator: [ties, dare_ties]
  budget: ["30%", "100%"]
  density: [0.3]
points:                      # and/or an explicit list
  - {operator: linear, weights: [0.5, 0.3, 0.2]}
evaluate: {text: heldout.txt, window: 256, max_tokens: 2048}   # optional: perplexity of each output
```
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.config.model import MAX_CONFIG_BYTES, ConfigError
from mergepipe.config.parse import _cut
from mergepipe.config.yaml_loader import load_yaml
from mergepipe.errors import StorageError, brief
from mergepipe.storage.paths import allowed_roots, check_allowed, read_regular

KEYS = {"name", "base", "experts", "out", "executor", "address", "concurrency", "settings", "grid", "points",
        "evaluate"}
EVALUATE_KEYS = {"text", "window", "max_tokens"}
MAX_POINTS = 1000


@dataclass
class SweepConfig:
    name: str
    base: str
    experts: list
    out: Path
    points: list[dict]  # settings per point: "operator" plus MergeRequest.build keywords
    executor: str = "local"
    address: str | None = None
    concurrency: int = 1
    evaluate: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # the document as written (stored with the sweep)

    def with_overrides(self, executor=None, address=None, concurrency=None) -> "SweepConfig":
        import dataclasses
        changes = {k: v for k, v in (("executor", executor), ("address", address), ("concurrency", concurrency))
                   if v is not None}
        cfg = dataclasses.replace(self, **changes)
        _check_run(cfg.executor, cfg.address, cfg.concurrency)
        return cfg

    def point_name(self, i: int) -> str:
        return f"{self.name}-{i}"


def load_sweep(path) -> SweepConfig:
    """A sweep config file, read through the path checks (inside $MERGEPIPE_ALLOWED_ROOTS when set, a
    regular file of at most MAX_CONFIG_BYTES) and the bounded YAML loader."""
    path = Path(path)
    try:
        check_allowed(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such sweep config")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size} bytes is too large for a sweep config")
        text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")
        doc = load_yaml(text)
    except StorageError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(_cut(msg if msg.startswith(f"{path}: ") else f"{path}: {msg}")) from None
    return parse_sweep(doc, default_name=path.stem, root=path.parent)


def parse_sweep(doc, default_name: str = "sweep", root: Path = Path(".")) -> SweepConfig:
    """A sweep document's points and settings; every refusal is one ConfigError line (keys quoted
    from the document are escaped, long ones cut)."""
    try:
        return _parse_sweep(doc, default_name, root)
    except ConfigError as exc:
        raise ConfigError(_cut(str(exc))) from None


def _parse_sweep(doc, default_name: str, root: Path) -> SweepConfig:
    if not isinstance(doc, dict):
        raise ConfigError("a sweep config is a mapping (base, experts, out, grid and/or points, ...)")
    unknown = sorted(set(doc) - KEYS)
    if unknown:
        raise ConfigError(f"unknown sweep key(s): {', '.join(map(str, unknown))} (known: {', '.join(sorted(KEYS))})")
    for key in ("base", "experts", "out"):
        if not doc.get(key):
            raise ConfigError(f"a sweep config needs {brief(key)}")
    if not isinstance(doc["experts"], list):
        raise ConfigError("experts: a list of expert model ids")
    name = str(doc.get("name") or default_name)
    settings = _mapping(doc.get("settings") or {}, "settings")
    listed = _list(doc.get("points") or [], "points")
    _check_count(len(listed) + _grid_size(doc.get("grid")))
    points = [{**settings, **_mapping(p, f"points[{i}]")} for i, p in enumerate(listed)]
    points += [{**settings, **p} for p in _grid(doc.get("grid"))]
    if not points:
        raise ConfigError("a sweep config needs a grid or a list of points")
    executor = doc.get("executor", "local")
    concurrency = doc.get("concurrency", 2 if executor == "ray" else 1)
    _check_run(executor, doc.get("address"), concurrency)
    evaluate = _mapping(doc.get("evaluate") or {}, "evaluate")
    if evaluate:
        if set(evaluate) - EVALUATE_KEYS or "text" not in evaluate:
            raise ConfigError("evaluate: {text: FILE, window: N, max_tokens: N} (text required)")
        evaluate = {**evaluate, "text": _evaluate_text(root, evaluate["text"])}
    out = Path(str(doc["out"]))
    return SweepConfig(name, str(doc["base"]), list(doc["experts"]), out if out.is_absolute() else root / out,
                       points, executor, doc.get("address"), concurrency, evaluate, doc)


def _check_run(executor, address, concurrency) -> None:
    if executor not in ("local", "ray"):
        raise ConfigError(f"executor: local or ray, not {brief(executor)}")
    if address is not None and executor != "ray":
        raise ConfigError("address goes with executor: ray")
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise ConfigError(f"concurrency: a positive integer, not {brief(concurrency)}")
    if executor == "local" and concurrency != 1:
        raise ConfigError("concurrency goes with executor: ray (the local executor runs points one at a time)")


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a mapping of settings, not {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: a list, not {type(value).__name__}")
    return value


def _grid_size(grid) -> int:
    """How many points a grid makes, counted before any is built (a product of 10^12 is refused)."""
    if grid is None:
        return 0
    grid = _mapping(grid, "grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.{key}: a non-empty list of values")
    return math.prod(len(v) for v in grid.values())


def _check_count(n: int) -> None:
    if n > MAX_POINTS:
        shown = f"{n:,}" if n < 10**15 else f"about 10^{int(n.bit_length() * 0.30103)}"
        raise ConfigError(f"{shown} points is more than a sweep takes ({MAX_POINTS})")


def _grid(grid) -> list[dict]:
    if grid is None:
        return []
    grid = _mapping(grid, "grid")
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _evaluate_text(root: Path, text) -> str:
    """evaluate.text beside the config; inside the allowed roots when they are set."""
    if not isinstance(text, str) or not text:
        raise ConfigError(f"evaluate.text: a file name, not {brief(text)}")
    path = root / text
    if allowed_roots() is not None:
        try:
            check_allowed(path)
        except StorageError as exc:
            raise ConfigError(f"evaluate.text: {exc}") from None
    return str(path)
