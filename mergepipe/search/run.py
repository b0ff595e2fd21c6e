"""Running a search: Optuna asks for recipes, trials are merged in memory at rising budgets and scored,
Optuna's pruner stops the ones that rank low at a cheap budget, everything is recorded in the catalog.

A trial is a sequence of steps, one per fidelity (``search.fidelities``, lowest budget first): step k
merges the trial's recipe at budget k, scores it, reports the score to Optuna at step k + 1 and asks the
pruner whether to go on (successive halving / Hyperband promote by rank among the trials that reached
that step). A trial that reaches the last fidelity completes with its score there. Steps run on a
:class:`Runner`: this process (one at a time, or ``concurrency`` threads) or Ray tasks (``executor: ray``).

Resuming (``resume``): finished trials (complete, pruned, failed) are replayed into the new study from
the catalog and never run again; a trial that was running when the search was killed runs again, whole,
under its own number, with its own parameters.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from mergepipe.catalog import searches as table
from mergepipe.catalog.db import Catalog, now
from mergepipe.errors import ExecutionError, MergePipeError
from mergepipe.search.load import SearchFile, check_recipe
from mergepipe.search.optuna_glue import (add_finished, distribution, make_study, optuna_state, suggest)
from mergepipe.search.trials import plan_recipe, score_step


@dataclass
class Running:
    """A trial in flight: its Optuna trial, number, parameters, recipe and next step."""

    trial: object
    number: int
    params: dict
    recipe: dict
    step: int = 0
    score: float | None = None
    expert_read: int = 0
    seconds: float = 0.0
    steps: list = field(default_factory=list)


class Runner:
    """Runs steps here: one at a time (``concurrency`` 1) or on threads."""

    def __init__(self, concurrency: int = 1):
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="mergepipe-search") \
            if concurrency > 1 else None

    def submit(self, *args) -> Future:
        if self.pool is not None:
            return self.pool.submit(score_step, *args)
        fut: Future = Future()
        fut.set_result(score_step(*args))
        return fut

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class RayRunner(Runner):
    """Runs each step as a Ray task (one CPU) on a local cluster on loopback, or the one at ``address``."""

    def __init__(self, address: str | None = None):
        from mergepipe.engine.ray_executor import connect
        self.ray = connect(address)
        self.remote = self.ray.remote(num_cpus=1, max_retries=0)(score_step)

    def submit(self, *args) -> Future:
        return self.remote.remote(*args).future()

    def close(self) -> None:
        pass


class SearchRun:
    """One run of a search (a new one, or a resumed one) against ``catalog``."""

    def __init__(self, catalog: Catalog, sf: SearchFile, search_id: str, on_trial=None):
        self.catalog, self.sf, self.settings, self.search_id = catalog, sf, sf.settings, search_id
        self.on_trial = on_trial
        self.study = make_study(self.settings)
        self.next_number = 0
        self.pending: dict[Future, Running] = {}
        self.base_dir = None

    # --- resume -------------------------------------------------------------------------------------
    def replay(self) -> int:
        """Add the catalog's finished trials to the study; queue the interrupted ones again. Returns how
        many trials are already finished."""
        finished = 0
        for row in table.trials(self.catalog, self.search_id):
            self.next_number = max(self.next_number, row["number"] + 1)
            if row["status"] in table.FINISHED:
                add_finished(self.study, self.sf.space, row)
                finished += 1
            else:
                self.study.enqueue_trial(row["params"], user_attrs={"number": row["number"]})
        return finished

    # --- the loop -----------------------------------------------------------------------------------
    def run(self, runner: Runner) -> None:
        started = time.monotonic()
        finished = self.replay()
        budget = self.settings.trials - finished
        asked = 0
        while True:
            while (len(self.pending) < self.settings.concurrency and asked < budget
                   and not self._timed_out(started)):
                self._start(runner, self.study.ask())
                asked += 1
            if not self.pending:
                break
            done, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
            for fut in done:
                self._step_done(runner, self.pending.pop(fut), fut.result())

    def _timed_out(self, started: float) -> bool:
        return self.settings.timeout is not None and time.monotonic() - started > self.settings.timeout

    def _start(self, runner: Runner, trial) -> None:
        number = trial.user_attrs.get("number")
        if number is None:
            number = self.next_number
            self.next_number += 1
            trial.set_user_attr("number", number)
        params = suggest(trial, self.sf.space)
        running = Running(trial, number, params, check_recipe(self.sf.space, params))
        table.start_trial(self.catalog, self.search_id, number, params)
        self._submit(runner, running)

    def _submit(self, runner: Runner, running: Running) -> None:
        budget = self.settings.fidelities[running.step]
        try:
            plan = plan_recipe(self.catalog, running.recipe, budget)
        except MergePipeError as exc:
            self._finish(running, "failed", error=str(exc))
            return
        if self.base_dir is None:
            self.base_dir = plan.base["uri"]
        running.steps.append({"budget": budget, "plan": plan})
        fut = runner.submit(self.catalog.path, plan.to_json(), self.settings.objective, self.base_dir)
        self.pending[fut] = running

    def _step_done(self, runner: Runner, running: Running, result: dict) -> None:
        step, plan = running.step, running.steps[-1]["plan"]
        running.seconds += result["seconds"]
        if "error" in result:
            self._finish(running, "failed", error=result["error"])
            return
        running.score, running.expert_read = result["score"], running.expert_read + result["expert_read"]
        bound = (plan.error_bound or {}).get("relative")
        table.record_step(self.catalog, self.search_id, running.number, step, budget=running.steps[-1]["budget"],
                          plan_id=plan.id, score=result["score"], error_bound=bound,
                          expert_read=result["expert_read"], full_expert_bytes=plan.full_expert_bytes,
                          seconds=result["seconds"])
        running.trial.report(result["score"], step + 1)
        if step + 1 == len(self.settings.fidelities):
            self._finish(running, "complete")
        elif running.trial.should_prune():
            self._finish(running, "pruned")
        else:
            running.step += 1
            self._submit(runner, running)

    def _finish(self, running: Running, status: str, error: str | None = None) -> None:
        if status == "complete":
            self.study.tell(running.trial, running.score)
        else:
            self.study.tell(running.trial, state=optuna_state(status))
        fidelity = running.steps[-1]["budget"] if running.steps else None
        table.update_trial(self.catalog, self.search_id, running.number, status=status, fidelity=fidelity,
                           score=running.score, expert_read=running.expert_read, seconds=running.seconds,
                           error=error, finished_at=now())
        if self.on_trial:
            self.on_trial({"number": running.number, "status": status, "score": running.score,
                           "fidelity": fidelity, "params": running.params, "error": error})


def make_runner(settings) -> Runner:
    if settings.executor == "ray":
        return RayRunner(settings.address)
    return Runner(settings.concurrency)


def run_trials(catalog: Catalog, sf: SearchFile, search_id: str, on_trial=None) -> None:
    """Run (or resume) ``search_id``'s trials until ``trials`` are finished or the time is up."""
    runner = make_runner(sf.settings)
    try:
        SearchRun(catalog, sf, search_id, on_trial).run(runner)
    finally:
        runner.close()


def check_distribution(sf: SearchFile) -> None:
    """Every dimension maps to an Optuna distribution (refused before anything runs otherwise)."""
    for dim in sf.space.dimensions:
        try:
            distribution(dim)
        except ValueError as exc:
            raise ExecutionError(f"search space {dim.name}: {exc}") from None
