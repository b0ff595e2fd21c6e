"""The ``search:`` block of a search file: how many trials, how to sample, what to score, at which fidelities.

```yaml
search:
  name: ta-vs-ties           # default: the file's stem
  trials: 40                 # trials to run (a resumed search runs the missing ones)
  sampler: tpe               # random | tpe | cmaes (Optuna's samplers)
  seed: 0
  objective: {tasks: val.jsonl}          # or {text: val.txt, window: 256, max_tokens: 4096}, or
                                         # {python: "module:function"} / {python: "file.py:function"}
  holdout: {tasks: test.jsonl}           # same kinds; scored only for the final report (top N)
  fidelities: [10%, 25%, 100%]           # budgets a trial is merged at, lowest first (default [100%])
  pruner: hyperband          # hyperband | successive_halving | none (default: hyperband when > 1 fidelity)
  executor: local            # or ray (trials in flight at once: concurrency)
  address: null              # with ray: the cluster to join (default: a new local one)
  concurrency: 1
  timeout: 3600              # seconds: no new trial starts after this
  top: 1                     # recipes scored on the holdout and published by `search publish`
```
"""

from __future__ import annotations

from dataclasses import dataclass

from mergepipe.config.model import ConfigError
from mergepipe.errors import PlanError, brief
from mergepipe.planner.budget import Budget

KEYS = {"name", "trials", "sampler", "seed", "objective", "holdout", "fidelities", "pruner", "executor",
        "address", "concurrency", "timeout", "top"}
SAMPLERS = ("random", "tpe", "cmaes")
PRUNERS = ("hyperband", "successive_halving", "none")
EXECUTORS = ("local", "ray")
OBJECTIVE_KINDS = ("tasks", "text", "python")
OBJECTIVE_KEYS = {"tasks": {"tasks"}, "text": {"text", "window", "max_tokens"}, "python": {"python"}}
MAX_TRIALS = 10_000
MAX_FIDELITIES = 8


@dataclass(frozen=True)
class Objective:
    """What a trial is scored on: ``kind`` tasks (mean accuracy), text (perplexity; the score is its
    negative, so higher is better) or python (``module:function(state_dict) -> float``)."""

    kind: str
    target: str
    window: int = 256
    max_tokens: int = 4096

    def describe(self) -> dict:
        out = {self.kind: self.target}
        if self.kind == "text":
            out.update(window=self.window, max_tokens=self.max_tokens)
        return out


@dataclass(frozen=True)
class SearchSettings:
    name: str
    objective: Objective
    holdout: Objective | None = None
    trials: int = 20
    sampler: str = "tpe"
    seed: int = 0
    fidelities: tuple[str, ...] = ("100%",)
    pruner: str = "none"
    executor: str = "local"
    address: str | None = None
    concurrency: int = 1
    timeout: float | None = None
    top: int = 1

    def describe(self) -> dict:
        return {"name": self.name, "trials": self.trials, "sampler": self.sampler, "seed": self.seed,
                "objective": self.objective.describe(),
                "holdout": self.holdout.describe() if self.holdout else None,
                "fidelities": list(self.fidelities), "pruner": self.pruner, "executor": self.executor,
                "address": self.address, "concurrency": self.concurrency, "timeout": self.timeout, "top": self.top}


def parse_settings(block, default_name: str) -> SearchSettings:
    """The ``search:`` block, checked; one ConfigError naming the key."""
    if not isinstance(block, dict):
        raise ConfigError("the file needs a `search:` mapping (trials, sampler, objective, ...)")
    unknown = sorted(set(block) - KEYS, key=str)
    if unknown:
        raise ConfigError(f"unknown key {brief(unknown[0])} in search (allowed: {', '.join(sorted(KEYS))})")
    if "objective" not in block:
        raise ConfigError("search.objective is required (tasks, text or python)")
    fidelities = _fidelities(block.get("fidelities", ["100%"]))
    pruner = _choice(block, "pruner", PRUNERS, "hyperband" if len(fidelities) > 1 else "none")
    executor = _choice(block, "executor", EXECUTORS, "local")
    address = block.get("address")
    if address is not None and (executor != "ray" or not isinstance(address, str)):
        raise ConfigError("search.address is a Ray cluster address and needs executor: ray")
    return SearchSettings(
        name=_name(block.get("name", default_name)), objective=parse_objective(block["objective"], "objective"),
        holdout=parse_objective(block["holdout"], "holdout") if block.get("holdout") is not None else None,
        trials=_int(block, "trials", 20, 1, MAX_TRIALS), sampler=_choice(block, "sampler", SAMPLERS, "tpe"),
        seed=_int(block, "seed", 0, 0, 2**32 - 1), fidelities=fidelities, pruner=pruner, executor=executor,
        address=address, concurrency=_int(block, "concurrency", 1, 1, 64), timeout=_timeout(block.get("timeout")),
        top=_int(block, "top", 1, 1, 100))


def parse_objective(value, key: str) -> Objective:
    where = f"search.{key}"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping: {{tasks: FILE}}, {{text: FILE}} or {{python: module:function}}")
    kinds = [k for k in OBJECTIVE_KINDS if k in value]
    if len(kinds) != 1:
        raise ConfigError(f"{where} needs exactly one of tasks, text, python")
    kind = kinds[0]
    unknown = sorted(set(value) - OBJECTIVE_KEYS[kind], key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key {brief(unknown[0])} for a {kind} objective")
    target = value[kind]
    if not isinstance(target, str) or not target.strip():
        raise ConfigError(f"{where}.{kind} must be a file name or module:function, not {brief(target)}")
    if kind == "python" and ":" not in target:
        raise ConfigError(f"{where}.python must be module:function or path/file.py:function, not {brief(target)}")
    window = _int(value, "window", 256, 2, 1 << 16, where)
    max_tokens = _int(value, "max_tokens", 4096, window, 1 << 24, where)
    return Objective(kind, target.strip(), window, max_tokens)


def _fidelities(value) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"search.fidelities must be a list of budgets (e.g. [10%, 25%, 100%]), not {brief(value)}")
    if len(value) > MAX_FIDELITIES:
        raise ConfigError(f"search.fidelities: at most {MAX_FIDELITIES} budgets")
    fractions = []
    for v in value:
        try:
            b = Budget.parse(v) if not isinstance(v, bool) else None
        except PlanError as exc:
            raise ConfigError(f"search.fidelities: {exc}") from None
        if b is None or b.fraction is None:
            raise ConfigError(f"search.fidelities: {brief(v)} is not a share of the expert read (like 25% or 0.25)")
        fractions.append(b.fraction)
    if fractions != sorted(set(fractions)):
        raise ConfigError("search.fidelities must rise (lowest budget first, each once)")
    return tuple(Budget.parse(v).spec for v in value)


def _choice(block: dict, key: str, allowed: tuple, default: str) -> str:
    value = block.get(key, default)
    if value not in allowed:
        raise ConfigError(f"search.{key} {brief(value)} is unknown (choose from {', '.join(allowed)})")
    return value


def _int(block: dict, key: str, default: int, low: int, high: int, where: str = "search") -> int:
    value = block.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{where}.{key} must be an integer from {low} to {high}, not {brief(value)}")
    return value


def _timeout(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 7 * 86400:
        raise ConfigError(f"search.timeout must be seconds (0 < timeout <= 604800), not {brief(value)}")
    return float(value)


def _name(value) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 100 or "/" in value:
        raise ConfigError(f"search.name must be a short name without '/', not {brief(value)}")
    return value.strip()
