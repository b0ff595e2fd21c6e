"""One trial's merges: a recipe planned at a fidelity (budget), merged in memory and scored.

:func:`plan_recipe` runs where the search runs (planning reads the catalog only, in milliseconds);
:func:`score_step` runs where the trial runs (this process, or a Ray worker): it merges the plan into
memory (mergepipe.engine.memory), hands the tensors to the objective and returns the score with what the
merge cost. Objectives are prepared once per process and reused.
"""

from __future__ import annotations

import threading
import time

import yaml

from mergepipe.catalog.db import Catalog
from mergepipe.config.parse import parse_config
from mergepipe.config.resolve import plan_from_config
from mergepipe.engine.memory import merge_in_memory
from mergepipe.errors import MergePipeError
from mergepipe.planner.plan import Plan
from mergepipe.search.objectives import TrialFailed, prepare
from mergepipe.search.settings import Objective

_SCORERS: dict = {}
_SCORERS_LOCK = threading.Lock()


def recipe_at(recipe: dict, budget: str) -> dict:
    """The recipe with ``mergepipe.budget`` set to ``budget``."""
    ext = {k: v for k, v in (recipe.get("mergepipe") or {}).items() if k not in ("budget", "target_bound")}
    return {**recipe, "mergepipe": {**ext, "budget": budget}}


def plan_recipe(catalog: Catalog, recipe: dict, budget: str, register_paths: bool = False) -> Plan:
    """The plan of ``recipe`` at ``budget`` (not saved: a trial's plan lives in its step row)."""
    cfg = parse_config(yaml.safe_dump(recipe_at(recipe, budget), sort_keys=False), source="recipe")
    return plan_from_config(catalog, cfg, save=False, register_paths=register_paths)[0]


def scorer(objective: Objective, base_dir):
    """The prepared objective (files read, function imported) for this process."""
    key = (objective, str(base_dir))
    with _SCORERS_LOCK:
        if key not in _SCORERS:
            _SCORERS[key] = prepare(objective, base_dir)
        return _SCORERS[key]


def score_step(catalog_path, plan_json: str, objective: Objective, base_dir) -> dict:
    """Merge a plan in memory and score it: {score, expert_read, seconds, merge_seconds, error}. A failure
    of the merge or the objective is returned as ``error`` (the trial fails; the search goes on)."""
    t0 = time.perf_counter()
    catalog = Catalog(catalog_path)
    try:
        merged = merge_in_memory(catalog, Plan.from_json(plan_json))
        score = scorer(objective, base_dir)(merged.tensors)
    except (TrialFailed, MergePipeError) as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - t0}
    finally:
        catalog.close()
    return {"score": score, "expert_read": merged.expert_read, "merge_seconds": merged.seconds,
            "seconds": time.perf_counter() - t0}
