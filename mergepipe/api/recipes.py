"""Recipes (config/recipe.py): stored, versioned merges re-planned against the catalog and run the cheaper
way (from scratch or incremental), and the watcher that runs one as checkpoints appear."""

from __future__ import annotations

from pathlib import Path

from mergepipe.api.merging import check_target, execute
from mergepipe.catalog.db import Catalog
from mergepipe.engine.txn import recover
from mergepipe.errors import MergePipeError


def recipe_save(catalog: Catalog, name: str, base: str, experts, operator: str = "linear", weights=None,
                params=None, budget=None, out: str | None = None) -> int:
    """Store a recipe (a new version when it differs from the latest); returns its version."""
    from mergepipe.config.recipe import Recipe, save_recipe
    return save_recipe(catalog, Recipe.build(name, base, experts, operator, weights, params, budget, out))


def recipe_show(catalog: Catalog, name: str, version: int | None = None) -> dict:
    from mergepipe.config.recipe import load_recipe
    recipe, v = load_recipe(catalog, name, version)
    return {**recipe.body(), "weights": recipe.weights, "version": v}


def recipe_list(catalog: Catalog) -> list[dict]:
    from mergepipe.catalog.recipes import recipe_rows
    return recipe_rows(catalog)


def recipe_explain(catalog: Catalog, name: str) -> str:
    """Both ways to run the recipe now (from scratch, incremental) with their estimated reads."""
    from mergepipe.config.recipe import explain_options, recipe_options
    return explain_options(recipe_options(catalog, name))


def recipe_run(catalog: Catalog, name: str, out_shard_bytes: int | None = None, progress=None) -> dict:
    """Re-plan the recipe against the catalog, run the cheaper of from-scratch and incremental (nothing
    when its last snapshot is up to date); returns ``{"choice", "snapshot_id", "explain", ...}``."""
    from mergepipe.catalog.recipes import record_recipe_snapshot
    from mergepipe.config.recipe import explain_options, recipe_options
    options = recipe_options(catalog, name)
    result = {"recipe": name, "version": options["version"], "choice": options["choice"], "snapshot_id": None,
              "explain": explain_options(options)}
    if options["choice"] == "none":
        return result
    chosen = options[options["choice"]]
    Path(options["out"]).expanduser().parent.mkdir(parents=True, exist_ok=True)  # a pattern may name subfolders
    check_target(catalog, options["out"])
    snapshot_id, manifest = execute(catalog, chosen["plan"], options["out"], None, out_shard_bytes, progress)
    record_recipe_snapshot(catalog, name, options["version"], snapshot_id, options["choice"])
    result.update(snapshot_id=snapshot_id, model_id=manifest.run["model_id"], out=manifest.run["out"],
                  read=sum(v for k, v in manifest.core["realized"].items() if k.endswith("_read")))
    return result


def watch(catalog: Catalog, dirs, recipe: str, interval: float = 5.0, once: bool = False, log=print) -> dict:
    """Watch ``dirs`` for new or changed checkpoints: register and analyze them on the recipe's base and run
    the recipe (incremental or from scratch, whichever is cheaper); until SIGTERM/SIGINT (a merge under way
    is finished first), or one pass with ``once``. One watcher per catalog (a lock file beside it); its
    state is in the catalog, and a watcher killed mid-merge is recovered on the next start."""
    import signal
    import time
    from mergepipe.config.recipe import load_recipe
    from mergepipe.config.watch import WatchLock, checkpoint_dirs, scan
    base = load_recipe(catalog, recipe)[0].base
    checkpoint_dirs(dirs)  # refuse a missing folder now
    lock = WatchLock(catalog.path)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    runs = []
    try:
        leftovers = recover(catalog)
        if leftovers.get("rolled_back"):
            log(f"recovered {len(leftovers['rolled_back'])} unfinished merge(s) of an earlier run")
        first = True
        while stop["signal"] is None:
            taken = scan(catalog, dirs, base, log)
            if first or taken:
                first = False
                try:
                    result = recipe_run(catalog, recipe)
                except MergePipeError as exc:  # e.g. no expert matches yet: wait for the next change
                    log(f"recipe {recipe}: {exc}")
                    continue
                if result["snapshot_id"]:
                    log(f"published {result['snapshot_id']} ({result['choice']}) at {result['out']}")
                    runs.append(result)
            if once and not any(r["status"] == "pending" for r in _watch_state(catalog)):
                break
            deadline = time.monotonic() + interval
            while stop["signal"] is None and time.monotonic() < deadline:
                time.sleep(min(0.1, interval))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        lock.release()
    if stop["signal"] is not None:
        log(f"stopped on signal {stop['signal']}")
    return {"runs": runs, "stopped_by": stop["signal"]}


def _watch_state(catalog: Catalog) -> list[dict]:
    from mergepipe.catalog.recipes import watch_seen
    return list(watch_seen(catalog).values())
