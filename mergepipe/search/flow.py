"""A search from start to report: checks before anything is recorded, the trials, the held-out scores of
the best recipes, and publishing them as ordinary snapshots with a lineage edge to the search."""

from __future__ import annotations

import yaml

from mergepipe.catalog import searches as table
from mergepipe.catalog.db import Catalog
from mergepipe.config.parse import parse_config
from mergepipe.config.model import ConfigError
from mergepipe.errors import ExecutionError, MergePipeError
from mergepipe.search.load import SearchFile, parse_search, sample_values
from mergepipe.search.objectives import TrialFailed
from mergepipe.search.run import check_distribution, run_trials
from mergepipe.search.trials import plan_recipe, recipe_at, score_step, scorer
from mergepipe.storage.procs import pid_alive


def start(catalog: Catalog, sf: SearchFile, on_trial=None) -> dict:
    """Check the space against the catalog (every method's recipe plans; paths are registered as a merge
    would), prepare the objective, record the search and run it. Returns :func:`show`."""
    check_distribution(sf)
    base_dir = None
    for method in sf.space.methods():
        recipe = sf.space.recipe(sample_values(sf.space, method))
        preflight_check(catalog, recipe)
        plan = plan_recipe(catalog, recipe, sf.settings.fidelities[0], register_paths=True)
        base_dir = plan.base["uri"]
    scorer(sf.settings.objective, base_dir)  # files read and parsed, the function imported: now, not mid-search
    search_id = table.start_search(catalog, sf.settings.name, stored_source(sf), sf.settings.describe())
    return proceed(catalog, search_id, sf, on_trial)


def preflight_check(catalog: Catalog, recipe: dict) -> None:
    """The merge's preflight (every model's headers, index and config only) on one of the space's recipes:
    a layout, vocabulary or head mismatch is refused before anything is registered, read or recorded."""
    from mergepipe.config.preflight import preflight
    result = preflight(catalog, parse_config(yaml.safe_dump(recipe, sort_keys=False), source="search space"))
    if result.resolved and not result.ok:
        n = len(result.problems)
        raise ConfigError(f"preflight found {n} problem{'s' if n > 1 else ''} the trials would meet; the first: "
                          f"{result.problems[0]}")


def resume(catalog: Catalog, search_id: str, on_trial=None) -> dict:
    """Run the trials a search has not finished (none of its finished trials runs again)."""
    row = table.search_row(catalog, search_id)
    if row is None:
        raise ExecutionError(f"no search {search_id!r} in the catalog (see `mergepipe search list`)")
    if row["status"] == "running" and row["pid"] and pid_alive(row["pid"]):
        raise ExecutionError(f"search {search_id} is running (pid {row['pid']}); stop it before resuming")
    sf = parse_search(row["source"], row["name"])
    return proceed(catalog, search_id, sf, on_trial)


def proceed(catalog: Catalog, search_id: str, sf: SearchFile, on_trial=None) -> dict:
    table.set_search_status(catalog, search_id, "running")
    try:
        run_trials(catalog, sf, search_id, on_trial)
    except BaseException:
        table.set_search_status(catalog, search_id, "interrupted")
        raise
    table.set_search_status(catalog, search_id, "finished", report(catalog, search_id, sf))
    return show(catalog, search_id)


def stored_source(sf: SearchFile) -> dict:
    """The search document as written, with its objective files as found (absolute paths): what a
    resumed search reads again."""
    block = dict(sf.source.get("search") or {})
    block["objective"] = sf.settings.objective.describe()
    if sf.settings.holdout is not None:
        block["holdout"] = sf.settings.holdout.describe()
    return {**sf.source, "search": block}


def report(catalog: Catalog, search_id: str, sf: SearchFile) -> dict:
    """The best recipes (top N by validation score at the last fidelity), each scored on the held-out
    objective (only here: the search never sees it), and the totals."""
    rows = table.trials(catalog, search_id)
    complete = sorted((r for r in rows if r["status"] == "complete"), key=lambda r: (-r["score"], r["number"]))
    top = []
    for row in complete[:sf.settings.top]:
        holdout = _holdout(catalog, sf, row)
        table.update_trial(catalog, search_id, row["number"], holdout=holdout)
        top.append(_summary(sf, row, holdout))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("complete", "pruned", "failed")}
    return {"best": top[0] if top else None, "top": top, "trials": len(rows), **counts,
            "expert_read": sum(r["expert_read"] or 0 for r in rows), "seconds": sum(r["seconds"] or 0 for r in rows)}


def _holdout(catalog: Catalog, sf: SearchFile, row: dict) -> float | None:
    if sf.settings.holdout is None:
        return None
    recipe = sf.space.recipe(row["params"])
    plan = plan_recipe(catalog, recipe, sf.settings.fidelities[-1])
    result = score_step(catalog.path, plan.to_json(), sf.settings.holdout, plan.base["uri"])
    if "error" in result:
        raise TrialFailed(f"the held-out objective failed on trial {row['number']}: {result['error']}")
    return result["score"]


def _summary(sf: SearchFile, row: dict, holdout: float | None) -> dict:
    return {"trial": row["number"], "params": row["params"], "score": row["score"], "holdout": holdout,
            "fidelity": row["fidelity"], "recipe": recipe_yaml(sf, row["params"])}


def recipe_yaml(sf: SearchFile, params: dict) -> str:
    """A trial's recipe as a mergekit YAML config at the search's last fidelity."""
    recipe = recipe_at(sf.space.recipe(params), sf.settings.fidelities[-1])
    return yaml.safe_dump(recipe, sort_keys=False)


def show(catalog: Catalog, search_id: str) -> dict:
    """A search with its trials (and each trial's steps) and report."""
    row = table.search_row(catalog, search_id)
    if row is None:
        raise ExecutionError(f"no search {search_id!r} in the catalog (see `mergepipe search list`)")
    trials = table.trials(catalog, search_id)
    report_ = row["report"] or {}
    return {"id": row["id"], "name": row["name"], "status": row["status"], "settings": row["settings"],
            "started_at": row["started_at"], "finished_at": row["finished_at"], "best": report_.get("best"),
            "top": report_.get("top", []), "trials": trials, "source": row["source"]}


def published_name(shown: dict) -> str:
    """``<search name>-<first 6 hex digits of its id>``: two runs of one search file publish apart."""
    return f"{shown['name']}-{shown['id'].removeprefix('search-')[:6]}"


def publish(catalog: Catalog, search_id: str, out_dir, top: int = 1, merge_config=None) -> list[dict]:
    """Publish the ``top`` best recipes as snapshots (``out_dir/<search name>-<id>-best``, ``-top2``, ...) through
    ``merge_config(catalog, config, out, model_id)`` (an ordinary merge), each with a lineage edge from the
    search (role ``search``). Returns [{trial, snapshot_id, model_id, out}]."""
    from pathlib import Path
    shown = show(catalog, search_id)
    sf = parse_search(shown["source"], shown["name"], check_files=False)
    complete = sorted((t for t in shown["trials"] if t["status"] == "complete"), key=lambda t: (-t["score"], t["number"]))
    best = [{"trial": t["number"], "recipe": recipe_yaml(sf, t["params"])} for t in complete[:top]]
    if not best:
        raise ExecutionError(f"search {search_id} has no complete trial to publish")
    try:
        Path(out_dir).mkdir(exist_ok=True)
    except OSError as exc:
        raise ExecutionError(f"{out_dir}: cannot create the output directory ({exc.strerror})") from None
    published = []
    for rank, entry in enumerate(best, 1):
        model_id = f"{published_name(shown)}-best" if rank == 1 else f"{published_name(shown)}-top{rank}"
        cfg = parse_config(entry["recipe"], source=f"{search_id} trial {entry['trial']}")
        try:
            _, snapshot_id, _ = merge_config(catalog, cfg, Path(out_dir) / model_id, model_id)
        except MergePipeError as exc:
            raise type(exc)(f"publishing trial {entry['trial']}: {exc}") from None
        table.add_lineage_edge(catalog, model_id, search_id)
        table.update_trial(catalog, search_id, entry["trial"], snapshot_id=snapshot_id)
        published.append({"trial": entry["trial"], "snapshot_id": snapshot_id, "model_id": model_id,
                          "out": str(Path(out_dir) / model_id)})
    return published
