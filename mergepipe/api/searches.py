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


def launch_search(db_path, catalog: Catalog, yaml_text: str, work_dir):
    """Check a search document (as :func:`parse_search`, objective files found in ``work_dir``), write it to a
    new ``search-N.yml`` in ``work_dir`` and start ``mergepipe --db DB search`` on it in its own process
    session (the dashboard's Search page). The search records its own row, with that process's pid, once its
    checks against the catalog pass; until then its output (``search-N.log``) says why it stopped. Returns
    (the search file, its Popen)."""
    from pathlib import Path

    from mergepipe.config.model import MAX_CONFIG_BYTES, ConfigError
    from mergepipe.config.parse import load_yaml
    from mergepipe.engine.runs import launch_search as launch
    if len(yaml_text.encode("utf-8")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"the search file is larger than {MAX_CONFIG_BYTES} bytes")
    parse_search(load_yaml(yaml_text), "search", Path(work_dir))
    return launch(db_path, catalog, yaml_text, work_dir)


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


def launch_search_publish(db_path, catalog: Catalog, search_id: str, out, log_dir):
    """:func:`search_publish` of the best recipe in a separate ``mergepipe search publish`` process (the
    dashboard's "Publish the best": a merge cannot run on a Streamlit script thread). Returns (its log, its
    Popen); the snapshot id lands on the best trial (:func:`search_show`)."""
    from mergepipe.engine.runs import launch_search_publish as launch
    return launch(db_path, catalog, search_id, out, log_dir)


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
