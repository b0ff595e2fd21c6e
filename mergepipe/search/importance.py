"""Which searched parameters mattered: Optuna's importance evaluator over a search's complete trials."""

from __future__ import annotations

from mergepipe.catalog import searches as table
from mergepipe.catalog.db import Catalog
from mergepipe.search.load import parse_search
from mergepipe.search.optuna_glue import add_finished, import_optuna


def importances(catalog: Catalog, search_id: str) -> dict[str, float]:
    """Parameter name -> importance (fANOVA, summing to 1) over the complete trials; {} with fewer than two
    complete trials or nothing that varied."""
    optuna = import_optuna()
    row = table.search_row(catalog, search_id)
    space = parse_search(row["source"], row["name"], check_files=False).space
    study = optuna.create_study(direction="maximize")
    complete = [r for r in table.trials(catalog, search_id) if r["status"] == "complete"]
    for r in complete:
        add_finished(study, space, r)
    if len(complete) < 2:
        return {}
    try:
        return dict(optuna.importance.get_param_importances(study))
    except (RuntimeError, ValueError):  # every complete trial has the same parameters or score
        return {}
