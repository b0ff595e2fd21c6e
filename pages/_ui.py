"""Rendering glue shared by the pages (not a page itself): the catalog of this rerun, cached views,
the child processes the dashboard started, and user-error display. Everything computed comes from
mergepipe.dashboard.views; nothing here knows about merging."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess

import pandas as pd
import streamlit as st

from mergepipe.dashboard import views
from mergepipe.errors import MergePipeError


def db() -> str:
    """The catalog path ($MERGEPIPE_DB, default ./mergepipe.sqlite), absolute."""
    return str(views.db_path())


def roots() -> list:
    return views.allowed_roots(db())


@contextlib.contextmanager
def catalog():
    """A short-lived Catalog for this rerun (cheap to open; never shared between threads)."""
    cat = views.open_catalog(db())
    try:
        yield cat
    finally:
        cat.close()


@contextlib.contextmanager
def user_errors():
    """Show a user error (any MergePipeError, a refused path, a locked or unreadable catalog) as a
    message instead of a traceback; Streamlit's own control flow (rerun, stop) passes through."""
    try:
        yield
    except MergePipeError as exc:
        st.error(str(exc))
    except (OSError, sqlite3.Error) as exc:
        st.error(f"{type(exc).__name__}: {exc}")


def table(df, **kw):
    """st.dataframe of ``df`` as every table shows it (views.table: a missing value reads '-', not `None`)."""
    return st.dataframe(views.table(df), **kw)


def default(key: str, **value) -> dict:
    """A keyed widget's default-value argument (``value=``, ``default=``, ``index=``), left out once session state
    holds the key: a widget given a default while its key was set through st.session_state (a callback applying a
    YAML, the suggested budget) makes Streamlit log a warning with a 30-line stack."""
    return {} if key in st.session_state else value


def flash(kind: str, message: str) -> None:
    """Queue a message (from a callback) to be shown by the page's next render."""
    st.session_state.setdefault("_flash", []).append((kind, message))


def show_flash() -> None:
    for kind, message in st.session_state.pop("_flash", []):
        getattr(st, kind)(message)


def action(fn, *args, **kw):
    """Run a callback's action; a user error becomes a flashed error message (result None)."""
    try:
        return fn(*args, **kw)
    except MergePipeError as exc:
        flash("error", str(exc))
    except (OSError, sqlite3.Error) as exc:
        flash("error", f"{type(exc).__name__}: {exc}")
    return None


def with_catalog(fn, *args, **kw):
    cat = views.open_catalog(db())
    try:
        return fn(cat, *args, **kw)
    finally:
        cat.close()


# --- child processes ---------------------------------------------------------------------------------
@st.cache_resource
def _processes() -> dict[int, subprocess.Popen]:
    return {}


def keep_process(run_id: int, proc: subprocess.Popen) -> None:
    _processes()[run_id] = proc


def reap() -> None:
    """poll() the children this server started so that finished ones do not linger as zombies."""
    procs = _processes()
    for run_id, proc in list(procs.items()):
        if proc.poll() is not None:
            procs.pop(run_id, None)


# --- cached views (keyed by catalog path + statistics version) ----------------------------------------
@st.cache_data(max_entries=32, show_spinner=False)
def tensor_stats(db_path: str, version: str, experts: tuple) -> pd.DataFrame:
    return with_catalog(views.tensor_stats_df, list(experts))


@st.cache_data(max_entries=32, show_spinner=False)
def block_stats(db_path: str, version: str, experts: tuple, tensors: tuple | None) -> pd.DataFrame:
    return with_catalog(views.block_stats_df, list(experts), None if tensors is None else list(tensors))


@st.cache_data(max_entries=32, show_spinner=False)
def norm_matrix(db_path: str, version: str, experts: tuple, level: str, tensors: tuple | None = None):
    if level == "block" or tensors is not None:
        df = block_stats(db_path, version, experts, tensors)
    else:
        df = tensor_stats(db_path, version, experts)
    return views.norm_matrix(df, level, list(experts))


@st.cache_data(max_entries=32, show_spinner=False)
def layout(db_path: str, version: str, base: str):
    return with_catalog(views.block_layout, base)


@st.cache_data(max_entries=64, show_spinner=False)
def conflict(db_path: str, version: str, experts: tuple, tensors: tuple, metric: str):
    return with_catalog(views.conflict_matrix, list(experts), list(tensors), metric)


@st.cache_resource(max_entries=8, show_spinner="Loading block statistics...")
def plan_context(db_path: str, version: str, key: str, _request):
    """One PlanContext per merge request (``key``: its text; its own long-lived connection): moving the
    budget only re-plans."""
    cat = views.open_catalog(db_path)
    return views.plan_context(cat, _request)


@st.cache_resource(max_entries=64, show_spinner=False)
def plan_view(db_path: str, version: str, key: str, budget: float | None, target: float | None, _ctx):
    """The plan and its figures at one budget of one request (shared, never mutated): a cached load or a
    slider back to an earlier budget re-plans and re-draws nothing."""
    return views.plan_view(_ctx, budget, target)


@st.cache_resource(max_entries=64, show_spinner=False)
def plan_mask(db_path: str, version: str, key: str, budget, target, top: int, search: str, _view):
    """The access mask of one plan view with its rows chosen (top N by bytes read, a search over expert ids)."""
    return views.plan_mask(_view, top, search)


@st.cache_resource(max_entries=32, show_spinner=False)
def snapshot_view(db_path: str, version: str, snapshot_id: str):
    """One snapshot's manifest, recipe and figures (shared, never mutated; a manifest never changes)."""
    return with_catalog(views.snapshot_view, snapshot_id)
