"""Recipe searches (mergepipe.search): load a search file, run or resume a search, show, list and publish."""

from __future__ import annotations

from mergepipe.catalog.db import Catalog


def load_search(path):
    """A search file (a mergekit config with ranges and choices, and a ``search:`` block), checked."""
    from mergepipe.search.load import load_search as load
    return load(path)


def parse_search(doc, name: str = "search", root="."):
    """A search document already loaded (a dict), checked; objective files are found beside ``root``."""
    from pathlib import Path

    from mergepipe.search.load import parse_search as parse
    return parse(doc, default_name=name, root=Path(root))


def search(catalog: Catalog, space, on_trial=None) -> dict:
    """Run a search (``space``: :func:`load_search`'s result): its recipes checked against the catalog, then
    its trials merged in memory at rising budgets and scored; ``on_trial(row)`` after each trial. Returns
    :func:`search_show` of it (``best``: the winning parameters by name, score, held-out score, recipe)."""
    from mergepipe.search.flow import start
    return start(catalog, space, on_trial)


def search_resume(catalog: Catalog, search_id: str, on_trial=None) -> dict:
    """Run the trials a killed or stopped search has not finished; finished trials never run again."""
    from mergepipe.search.flow import resume
    return resume(catalog, search_id, on_trial)


def search_show(catalog: Catalog, search_id: str) -> dict:
    from mergepipe.search.flow import show
    return show(catalog, search_id)


def searches(catalog: Catalog) -> list[dict]:
    """Every search, newest first."""
    from mergepipe.catalog.searches import searches as rows
    return rows(catalog)


def search_publish(catalog: Catalog, search_id: str, out, top: int = 1) -> list[dict]:
    """Publish the ``top`` best recipes of a search as snapshots under ``out`` (an ordinary merge each, with
    a lineage edge from the search)."""
    from mergepipe.api.configs import merge_config
    from mergepipe.search.flow import publish
    return publish(catalog, search_id, out, top, merge_config)


def search_parameter_importance(catalog: Catalog, search_id: str) -> dict[str, float]:
    """Optuna's parameter importances (fANOVA) over the search's complete trials ({} with fewer than 2)."""
    from mergepipe.search.importance import importances
    return importances(catalog, search_id)


def merge_in_memory(catalog: Catalog, plan):
    """Execute a plan into memory (no files, no catalog rows): tensors, expert bytes read, seconds."""
    from mergepipe.engine.memory import merge_in_memory as run
    return run(catalog, plan)


def load_into_model(tensors: dict, base_dir, auto_class: str = "AutoModelForCausalLM"):
    """A transformers model with the base's config holding merged ``tensors`` (for Python objectives)."""
    from mergepipe.search.objectives import load_into_model as load
    return load(tensors, base_dir, auto_class)
