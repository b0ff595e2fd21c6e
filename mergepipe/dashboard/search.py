"""The Search page: a recipe search launched from a YAML edited on the page (checked as the Plan page checks its
YAML: the document, then its recipes against the catalog), a stored search's status and trials, every step's
score against the expert bytes it read (by fidelity), Optuna's parameter importance and the best recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import yaml

from mergepipe import api
from mergepipe.api import Catalog
from mergepipe.dashboard.formatting import fmt_bytes
from mergepipe.dashboard.models import analyzed_experts, bases
from mergepipe.dashboard.paths import check_path
from mergepipe.errors import MergePipeError

MIB = 2 ** 20
FINISHED = ("complete", "pruned", "failed")
TRIAL_COLUMNS = ["trial", "status", "fidelity", "score", "expert read (MiB)", "seconds", "params", "error"]
STEP_COLUMNS = ["trial", "step", "fidelity", "score", "expert read (MiB)", "params"]
OBJECTIVE_HELP = "a Python objective is a function score(state_dict) -> float, higher is better"


# --- folders -------------------------------------------------------------------------------------------
def search_work_dir(db) -> Path:
    """Where the page writes the search files it launches and their logs, and where their objective files are
    read from: ``<catalog>-searches`` beside the catalog (created here when it can be)."""
    p = Path(db).expanduser().absolute()
    work = p.parent / f"{p.stem}-searches"
    try:
        work.mkdir(exist_ok=True)
    except OSError:
        pass  # a read-only catalog folder: the launch says so
    return work


def search_publish_dir(db) -> Path:
    """Where "Publish the best" writes its snapshot: ``merged/`` beside the catalog, with the Run page's merges."""
    return Path(db).expanduser().absolute().parent / "merged"


# --- the YAML ---------------------------------------------------------------------------------------------
def example_search_yaml(cat: Catalog) -> str | None:
    """A search over the first base with analyzed experts and its first two of them (None when there is none):
    task_arithmetic or ties, each expert's weight, ties' density, a Python objective in the working folder."""
    base = next((b for b in bases(cat) if analyzed_experts(cat, b)), None)
    if base is None:
        return None
    experts = analyzed_experts(cat, base)[:2]
    doc = {"merge_method": {"choice": ["task_arithmetic", "ties"]}, "base_model": base,
           "models": [{"model": e, "parameters": {"weight": {"range": [0.1, 1.0]}, "density": {"range": [0.2, 0.8]}}}
                      for e in experts]}
    search = ("search:\n  trials: 20\n  sampler: tpe\n  seed: 0\n"
              "  objective: {python: objective.py:score}   # objective.py in the working folder\n"
              "  fidelities: [25%, 100%]   # budgets a trial is merged at; low scorers stop at the first\n")
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None) + search


def check_search_yaml(cat: Catalog, text: str, work_dir, roots: list[Path]) -> str:
    """A one-line description of an edited search YAML; raises a MergePipeError saying what is wrong (the YAML,
    the space, the ``search:`` block, a missing objective file in ``work_dir``, a model the catalog does not hold)."""
    if not (text or "").strip():
        raise MergePipeError("the YAML is empty")
    sf = api.parse_search(api.load_yaml(text), "search", work_dir)
    base = None
    for method in sf.space.methods():
        base = _check_recipe(cat, sf.space, method, roots)
    return _describe(sf, base)


def _check_recipe(cat: Catalog, space, method: str, roots: list[Path]) -> str:
    """Resolve ``method``'s recipe (mid-range values) against the catalog as the Plan page does (models
    registered, paths under the allowed folders); returns its base."""
    values = {d.name: method if d.path == ("merge_method",) else _middle(d)
              for d in space.dimensions if space.applies(d, method)}
    cfg = api.parse_config(yaml.safe_dump(space.recipe(values), sort_keys=False), "the edited YAML")
    return api.resolve_config(cat, cfg, register_paths=False, check_path=lambda t: check_path(t, roots)).base


def _middle(dim):
    if dim.categorical:
        return dim.choices[0]
    return math.sqrt(dim.low * dim.high) if dim.log else (dim.low + dim.high) / 2


def _describe(sf, base: str) -> str:
    s = sf.settings
    names = ", ".join(d.name for d in sf.space.dimensions) or "nothing"
    objective = next(iter(s.objective.describe().values()))
    return (f"{s.trials} trials ({s.sampler}, seed {s.seed}) of {' or '.join(sf.space.methods())} on {base}, "
            f"searching {names}; fidelities {', '.join(s.fidelities)}; objective {Path(objective).name}")


# --- stored searches --------------------------------------------------------------------------------------
def search_labels(cat: Catalog) -> dict[str, str]:
    """Search id -> its selector label (fixed for a search: id, name, start), newest first."""
    return {r["id"]: f"{r['id']} · {r['name']} · {r['started_at']}" for r in api.searches(cat)}


def launched_search(cat: Catalog, pid: int, known=()) -> str | None:
    """The id of the search the process ``pid`` recorded (a launch from the page), once it has; searches in
    ``known`` (there before the launch) are not it."""
    return next((r["id"] for r in api.searches(cat) if r["pid"] == pid and r["id"] not in known), None)


def launch_outcome(cat: Catalog, launch: dict) -> dict:
    """Where a search launched from the page (``pid``, ``file``, ``log``, ``known``: the search ids before it)
    stands: ``search`` (its id) once it has recorded itself, ``error`` (its log's error line) when its process
    ended before, else ``pending``."""
    alive = api.pid_alive(launch["pid"])  # first: a process found gone has recorded all it will
    search_id = launched_search(cat, launch["pid"], launch.get("known", ()))
    if search_id or alive:
        return {"search": search_id, "error": None, "pending": search_id is None}
    return {"search": None, "error": f"{launch['file']}: {launch_failure(launch['log'])}", "pending": False}


def publish_outcome(cat: Catalog, job: dict) -> dict:
    """Where a "Publish the best" process (``pid``, ``search``, ``log``) stands: ``snapshot`` once the best trial
    holds one, ``error`` when its process ended without, else ``pending``."""
    alive = api.pid_alive(job["pid"])
    snapshot = published_snapshot(api.search_show(cat, job["search"]))
    if snapshot or alive:
        return {"snapshot": snapshot, "error": None, "pending": snapshot is None}
    return {"snapshot": None, "error": f"Publishing failed: {launch_failure(job['log'])}", "pending": False}


def launch_failure(log_path) -> str:
    """Why a process the page started stopped: its log's ``error:`` line (or last line)."""
    lines = [x for x in api.log_tail({"log_path": str(log_path)}, lines=20).splitlines() if x.strip()]
    error = next((x for x in reversed(lines) if x.startswith("error: ")), None)
    return (error or (lines[-1] if lines else f"the process exited (see {log_path})")).removeprefix("error: ")


def search_status(cat: Catalog, shown: dict, db) -> dict:
    """The state of a shown search (:func:`api.search_show`): ``running`` only while its process is alive, a
    one-line ``text``, trials finished of planned (``fraction``)."""
    pid = next((r["pid"] for r in api.searches(cat) if r["id"] == shown["id"]), None)
    trials = shown["trials"]
    total = max(int(shown["settings"].get("trials") or 0), len(trials), 1)
    done = sum(t["status"] in FINISHED for t in trials)
    running = shown["status"] == "running" and api.pid_alive(pid)
    resume = f"resume it with `mergepipe --db {db} search --resume {shown['id']}`"
    if running:
        text = f"running (process {pid}): {done} of {total} trials finished"
    elif shown["status"] == "running":
        text = f"stopped: its process {pid} is gone after {done} of {total} trials; {resume}"
    elif shown["status"] == "finished":
        counts = ", ".join(f"{sum(t['status'] == s for t in trials)} {s}" for s in FINISHED)
        read = fmt_bytes(sum(t["expert_read"] or 0 for t in trials))
        text = f"finished: {len(trials)} trials ({counts}), expert read {read}"
    else:
        text = f"{shown['status']} after {done} of {total} trials; {resume}"
    return {"running": running, "text": text, "fraction": min(1.0, done / total)}


def params_text(params: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def search_trials_df(shown: dict) -> pd.DataFrame:
    """One row per trial: number, status, last fidelity, score there, expert bytes read (MiB, all its steps),
    seconds, parameters, error."""
    return pd.DataFrame([{
        "trial": t["number"], "status": t["status"], "fidelity": t["fidelity"], "score": t["score"],
        "expert read (MiB)": None if t["expert_read"] is None else t["expert_read"] / MIB, "seconds": t["seconds"],
        "params": params_text(t["params"]), "error": t["error"],
    } for t in shown["trials"]], columns=TRIAL_COLUMNS)


def search_steps_df(shown: dict) -> pd.DataFrame:
    """One row per step of every trial (a merge at one fidelity): its score and the expert bytes it read."""
    return pd.DataFrame([{
        "trial": t["number"], "step": s["step"], "fidelity": s["budget"], "score": s["score"],
        "expert read (MiB)": (s["expert_read"] or 0) / MIB, "params": params_text(t["params"]),
    } for t in shown["trials"] for s in t["steps"]], columns=STEP_COLUMNS)


def search_score_figure(steps: pd.DataFrame, fidelities: list[str]) -> go.Figure:
    """Score (higher is better) against the expert bytes read, one point per step, one colour per fidelity."""
    fig = go.Figure()
    order = list(fidelities) + sorted(set(steps["fidelity"]) - set(fidelities))
    for budget in order:
        part = steps[steps["fidelity"] == budget]
        if part.empty:
            continue
        fig.add_trace(go.Scatter(
            x=part["expert read (MiB)"].tolist(), y=part["score"].tolist(), mode="markers", name=budget,
            marker={"size": 10},
            text=[f"trial {t}, step {s}<br>{p}" for t, s, p in zip(part["trial"], part["step"], part["params"])],
            hovertemplate="%{text}<br>expert read %{x:.3f} MiB<br>score %{y:.4g}<extra></extra>"))
    fig.update_layout(xaxis_title="expert bytes read (MiB)", yaxis_title="score (higher is better)",
                      legend_title="fidelity", margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=400)
    return fig


# --- parameter importance and the best recipe ----------------------------------------------------------
def importance_note(shown: dict, importances: dict) -> str | None:
    """Why there is no importance chart (None when there is one)."""
    complete = sum(t["status"] == "complete" for t in shown["trials"])
    if complete < 2:
        return f"Parameter importance needs at least 2 complete trials ({complete} so far)."
    if not importances:
        return "No parameter importance: the complete trials share their parameters or their score."
    return None


def importance_figure(importances: dict) -> go.Figure:
    """Optuna's parameter importances (fANOVA, summing to 1), the largest on top."""
    ranked = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in ranked], y=[k for k, _ in ranked], orientation="h",
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(xaxis_title="importance (fANOVA, sums to 1)", margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      height=120 + 30 * len(ranked))
    return fig


def best_recipe(shown: dict) -> dict | None:
    """The best trial's recipe as mergekit YAML (``yaml``, ``file_name``) with a line saying what it scored;
    None until the search has finished with a complete trial."""
    best = shown.get("best")
    if not best:
        return None
    held = f", held-out {best['holdout']:.4g}" if best.get("holdout") is not None else ""
    return {"yaml": best["recipe"], "file_name": f"{shown['name']}-best.yml", "trial": best["trial"],
            "text": f"trial {best['trial']}: score {best['score']:.4g}{held} at {best['fidelity']} "
                    f"({params_text(best['params'])})"}


def published_snapshot(shown: dict) -> str | None:
    """The snapshot the best trial was published as, if it was."""
    best = shown.get("best")
    if not best:
        return None
    return next((t["snapshot_id"] for t in shown["trials"] if t["number"] == best["trial"]), None)
