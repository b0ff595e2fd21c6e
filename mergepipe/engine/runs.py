"""Merge runs launched as separate processes (the dashboard's Run page).

A run is a row in the catalog's ``runs`` table; the child process (``mergepipe execute --run-id N``)
writes its own progress in short transactions, so any reader (a refreshed browser, another page)
sees it. Cancelling sends SIGTERM; the engine aborts its transaction and nothing is published.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from mergepipe.catalog import runs as runs_table
from mergepipe.catalog.db import Catalog
from mergepipe.engine.txn import check_output_path, pid_alive
from mergepipe.errors import ExecutionError, MergePipeError

PROGRESS_INTERVAL_S = 0.3


def active_run_for(catalog: Catalog, out: str) -> dict | None:
    rows = runs_table.active_runs_at(catalog, out)
    return next((r for r in rows if pid_alive(r["pid"]) or r["pid"] is None), None)


def create_run(catalog: Catalog, plan_id: str, out: str, model_id: str, planned: int, log_path: str | None) -> int:
    out = str(Path(out).absolute())
    if active_run_for(catalog, out):
        raise ExecutionError(f"a run writing {out} is already in progress")
    check_output_path(Path(out))
    with catalog.transaction():
        return runs_table.insert_merge_run(catalog, plan_id, out, model_id, log_path, planned)


def launch_run(db_path: str | Path, catalog: Catalog, plan_id: str, out: str, model_id: str,
               log_dir: str | Path, out_shard_bytes: int | None = None) -> tuple[int, subprocess.Popen]:
    """Start ``mergepipe execute`` for a saved plan in its own process session; returns (run id, Popen)."""
    from mergepipe.planner.plan import load_plan
    plan = load_plan(catalog, plan_id)
    if catalog.has_model(model_id):
        raise ExecutionError(f"model id {model_id!r} is already registered; choose another")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    run_id = create_run(catalog, plan.id, out, model_id, plan.estimated["expert_read"], None)
    log_path = log_dir / f"run-{run_id}.log"
    cmd = ["execute", plan.id, "--out", str(out), "--model-id", model_id, "--run-id", str(run_id)]
    if out_shard_bytes:
        cmd += ["--out-shard-size", str(out_shard_bytes)]
    return run_id, _spawn(catalog, db_path, cmd, run_id, log_path)


def _spawn(catalog: Catalog, db_path, args: list[str], run_id: int, log_path: Path) -> subprocess.Popen:
    """Start ``mergepipe ARGS`` detached and record its pid in the run's row."""
    proc = _detached(db_path, args, log_path)
    with catalog.transaction():
        runs_table.set_run_process(catalog, run_id, proc.pid, str(log_path))
    return proc


def _detached(db_path, args: list[str], log_path: Path) -> subprocess.Popen:
    """Start ``mergepipe --db DB ARGS`` detached (own session, no shell, output to the log)."""
    cmd = [sys.executable, "-m", "mergepipe.cli", "--db", str(db_path), *args]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def launch_search(db_path: str | Path, catalog: Catalog, yaml_text: str,
                  work_dir: str | Path) -> tuple[Path, subprocess.Popen]:
    """Write a search document to a new file ``search-N.yml`` in ``work_dir`` (its objective files are found
    beside it) and start ``mergepipe search FILE`` on it detached, its output in ``search-N.log``. The search
    records its own row (``searches``, with this process's pid) once its checks pass; ``catalog`` is where it
    will: it must be the one at ``db_path``. Returns (the search file, its Popen)."""
    if Path(catalog.path).resolve() != Path(db_path).resolve():
        raise ExecutionError(f"{db_path} is not the open catalog {catalog.path}")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    path = _new_file(work_dir, "search-{}.yml", yaml_text)
    proc = _detached(db_path, ["search", str(path)], path.with_suffix(".log"))
    return path, proc


def launch_search_publish(db_path: str | Path, catalog: Catalog, search_id: str, out_dir: str | Path,
                          log_dir: str | Path) -> tuple[Path, subprocess.Popen]:
    """Start ``mergepipe search publish ID --out DIR`` detached: the best recipe merged and published in its
    own process, never in the caller's (a merge takes SIGTERM over, which only a main thread may, and the
    dashboard's scripts run on other threads). Returns (its log, its Popen); the published snapshot lands on
    the best trial's row."""
    from mergepipe.catalog.searches import search_row
    row = search_row(catalog, search_id)
    if row is None:
        raise ExecutionError(f"no search {search_id!r} in the catalog")
    if row["status"] != "finished":
        raise ExecutionError(f"search {search_id} is {row['status']}: publish it once it has finished")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{search_id}-publish.log"
    return log_path, _detached(db_path, ["search", "publish", search_id, "--out", str(out_dir)], log_path)


def _new_file(folder: Path, pattern: str, text: str) -> Path:
    """``text`` in the first ``pattern.format(n)`` (n = 1, 2, ...) that does not exist yet (created exclusively)."""
    n = 1
    while True:
        path = folder / pattern.format(n)
        try:
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(text)
            return path
        except FileExistsError:
            n += 1


def launch_analyze(db_path: str | Path, catalog: Catalog, model_ids: list[str], log_dir: str | Path,
                   block_bytes: int | None = None) -> tuple[int, subprocess.Popen]:
    """Start ``mergepipe analyze`` in its own process; progress lands in the runs table (kind 'analyze')."""
    for mid in model_ids:
        catalog.model(mid)
    busy = runs_table.active_analyze_runs(catalog)
    if any(pid_alive(r["pid"]) for r in busy):
        raise ExecutionError("an analyze run is already in progress")
    with catalog.transaction():
        run_id = runs_table.insert_analyze_run(catalog, model_ids)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"analyze-{run_id}.log"
    args = ["analyze", "--run-id", str(run_id)]
    if model_ids:
        args += ["--model-id", *model_ids]
    if block_bytes:
        args += ["--block-bytes", str(block_bytes)]
    proc = _spawn(catalog, db_path, args, run_id, log_path)
    return run_id, proc


def launch_evaluate(db_path: str | Path, catalog: Catalog, model_ids: list[str], text_path: str | Path | None,
                    log_dir: str | Path, tasks_path: str | Path | None = None,
                    reference: str | None = None) -> tuple[int, subprocess.Popen]:
    """Start ``mergepipe evaluate`` (perplexity on a held-out text and/or accuracy on a task suite) in its
    own process; progress lands in the runs table (kind 'evaluate': thousandths of the work done)."""
    from mergepipe.catalog.evaluations import insert_evaluate_run
    if not model_ids:
        raise ExecutionError("choose at least one model to evaluate")
    if not text_path and not tasks_path and not reference:
        raise ExecutionError("give a held-out text or a task suite to evaluate on")
    for mid in model_ids + ([reference] if reference else []):
        catalog.model(mid)
    args = ["evaluate", *model_ids] + (["--reference", reference] if reference else [])
    for flag, path in (("--text", text_path), ("--tasks", tasks_path)):
        if path:
            if not Path(path).is_file():
                raise ExecutionError(f"{path} is not a file")
            args += [flag, str(path)]
    with catalog.transaction():
        run_id = insert_evaluate_run(catalog, model_ids)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = _spawn(catalog, db_path, [*args, "--run-id", str(run_id)], run_id, log_dir / f"evaluate-{run_id}.log")
    return run_id, proc


class RunProgress:
    """Progress callback for the engine that writes the run row at most every PROGRESS_INTERVAL_S."""

    def __init__(self, catalog: Catalog, run_id: int):
        self.catalog = catalog
        self.run_id = run_id
        self.last = 0.0
        with catalog.transaction():
            runs_table.mark_run_running(catalog, run_id, os.getpid())

    def __call__(self, done: int, total: int, expert_bytes: int) -> None:
        t = time.monotonic()
        if t - self.last < PROGRESS_INTERVAL_S and done < total:
            return
        self.last = t
        with self.catalog.transaction():
            runs_table.update_run_progress(self.catalog, self.run_id, done, total, expert_bytes)

    def finish(self) -> None:
        with self.catalog.transaction():
            runs_table.mark_run_succeeded(self.catalog, self.run_id)

    def fail(self, status: str, message: str) -> None:
        """Record why the run ended. Called while its error propagates, so it never raises: when the
        catalog cannot be written now (full, read-only), the row stays 'running' with this process's pid
        and `recover` marks it failed once the process is gone."""
        try:
            with self.catalog.transaction():
                runs_table.mark_run_ended(self.catalog, self.run_id, status, message)
        except Exception:  # noqa: BLE001  (the error being propagated is the one to report)
            pass


@contextmanager
def recorded_run(catalog: Catalog, run_id: int | None, finish: bool = True):
    """The bookkeeping of a run started with ``--run-id`` (a row the dashboard's launcher inserted):
    marked running on entry; on the way out cancelled (Ctrl-C, SIGTERM), failed (with the error, which
    goes on propagating) or, with ``finish``, succeeded. ``finish=False`` where the engine marks the run
    succeeded itself, in the transaction that publishes its snapshot. Yields the RunProgress callback to
    report progress through, or None (and records nothing) without a run id."""
    if run_id is None:
        yield None
        return
    run = RunProgress(catalog, run_id)
    try:
        yield run
    except KeyboardInterrupt:
        run.fail("cancelled", "cancelled by the user")
        raise
    except MergePipeError as exc:
        run.fail("failed", str(exc))
        raise
    except BaseException as exc:
        run.fail("failed", f"{type(exc).__name__}: {exc}")
        raise
    if finish:
        run.finish()


def get_run(catalog: Catalog, run_id: int) -> dict:
    rows = runs_table.run_rows(catalog, run_id)
    if not rows:
        raise ExecutionError(f"unknown run {run_id}")
    run = rows[0]
    if run["status"] in ("queued", "running") and run["pid"] and not pid_alive(run["pid"]):
        run["status"] = "failed"  # the process died without recording why; `recover` makes it durable
    return run


def cancel_run(catalog: Catalog, run_id: int) -> bool:
    run = get_run(catalog, run_id)
    if run["status"] not in ("queued", "running") or not run["pid"]:
        return False
    try:
        os.killpg(run["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def log_tail(run: dict, lines: int = 40) -> str:
    path = run.get("log_path")
    if not path or not Path(path).exists():
        return ""
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])
