"""Optuna, used as it comes: its samplers (random, TPE, CMA-ES), its pruners (successive halving, Hyperband)
and its ask-and-tell interface; the study lives in memory and the catalog holds the trials (mergepipe
replays them into a new study to resume)."""

from __future__ import annotations

import logging

from mergepipe.errors import MergePipeError
from mergepipe.search.space import Dimension, SearchSpace

INSTALL_HINT = "a search needs optuna, which is not installed: pip install 'mergepipe[search]'"


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise MergePipeError(INSTALL_HINT) from None
    optuna.logging.set_verbosity(logging.WARNING)
    return optuna


def make_sampler(settings):
    optuna = import_optuna()
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    if settings.sampler == "cmaes":  # categorical dimensions (a method choice) fall back to random sampling
        return optuna.samplers.CmaEsSampler(seed=settings.seed, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=settings.seed)


def make_pruner(settings):
    optuna = import_optuna()
    steps = len(settings.fidelities)
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=steps, reduction_factor=3)
    if settings.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2,
                                                      min_early_stopping_rate=0)
    return optuna.pruners.NopPruner()


def make_study(settings):
    optuna = import_optuna()
    return optuna.create_study(direction="maximize", sampler=make_sampler(settings), pruner=make_pruner(settings))


def distribution(dim: Dimension):
    optuna = import_optuna()
    if dim.categorical:
        return optuna.distributions.CategoricalDistribution(list(dim.choices))
    return optuna.distributions.FloatDistribution(dim.low, dim.high, log=dim.log, step=dim.step)


def suggest(trial, space: SearchSpace) -> dict:
    """The trial's values, by dimension name: the method first, then every dimension it takes."""
    values = {}
    method_dim = space.method_dimension()
    method = space.document.get("merge_method")
    if method_dim is not None:
        method = values[method_dim.name] = trial.suggest_categorical(method_dim.name, list(method_dim.choices))
    for dim in space.dimensions:
        if dim is method_dim or not space.applies(dim, method):
            continue
        if dim.categorical:
            values[dim.name] = trial.suggest_categorical(dim.name, list(dim.choices))
        else:
            values[dim.name] = trial.suggest_float(dim.name, dim.low, dim.high, log=dim.log, step=dim.step)
    return values


def optuna_state(status: str):
    states = import_optuna().trial.TrialState
    return {"complete": states.COMPLETE, "pruned": states.PRUNED, "failed": states.FAIL}[status]


def add_finished(study, space: SearchSpace, row: dict) -> None:
    """A finished trial from the catalog, added to ``study`` as it ended (scores at each step it ran)."""
    optuna = import_optuna()
    dims = {d.name: d for d in space.dimensions}
    params = {k: v for k, v in row["params"].items() if k in dims}
    steps = {s["step"] + 1: s["score"] for s in row["steps"] if s["score"] is not None}
    frozen = optuna.trial.create_trial(
        params=params, distributions={k: distribution(dims[k]) for k in params},
        value=row["score"] if row["status"] == "complete" else None, state=optuna_state(row["status"]),
        intermediate_values=steps, user_attrs={"number": row["number"]})
    study.add_trial(frozen)
