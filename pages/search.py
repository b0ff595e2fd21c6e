"""Search: launch a recipe search (`mergepipe search FILE`) from a YAML edited here, in its own process; watch a
stored search's trials live, their scores against the expert bytes they read, Optuna's parameter importance;
download the best recipe as mergekit YAML and publish it as a snapshot (`mergepipe search publish`, its own
process too). A launch or a publish in flight is watched by a fragment that reruns the page when it ends; the
page's full run settles it (selects the new search, or shows why it stopped)."""

import streamlit as st

from mergepipe import api
from mergepipe.dashboard import views
from mergepipe.errors import MergePipeError
from pages import _nav, _ui as ui

_nav.through_app()

st.title("Search")
LAUNCH, PUBLISH, YAML = "_search_launch", "_search_publishing", "_search_yaml"


def keep_yaml():
    """The edited YAML, kept apart from its widget's state (which a rerun from a fragment can drop)."""
    st.session_state[YAML] = st.session_state["search_yaml"]


def do_launch():
    s = st.session_state

    def fn(cat):
        views.check_search_yaml(cat, s[YAML], work, ui.roots())
        return list(views.search_labels(cat)), api.launch_search(ui.db(), cat, s[YAML], work)

    res = ui.action(ui.with_catalog, fn)
    if res:
        known, (path, proc) = res
        ui.keep_process(f"search-{proc.pid}", proc)
        s[LAUNCH] = {"pid": proc.pid, "file": str(path), "log": str(path.with_suffix(".log")), "known": known}


def do_publish(search_id: str):
    def fn(cat):
        return api.launch_search_publish(ui.db(), cat, search_id, str(views.search_publish_dir(ui.db())), work)

    res = ui.action(ui.with_catalog, fn)
    if res:
        log, proc = res
        ui.keep_process(f"publish-{proc.pid}", proc)
        st.session_state[PUBLISH] = {"pid": proc.pid, "log": str(log), "search": search_id}


@st.fragment(run_every=1.0)
def wait_for(key: str, outcome, text: str):
    """While the job in session state ``key`` is pending: ``text``; then the whole page again."""
    ui.reap()
    with ui.user_errors(), ui.catalog() as c:
        if not outcome(c, st.session_state[key])["pending"]:
            st.rerun(scope="app")
    st.info(text)


def settle(cat, key: str, outcome) -> dict | None:
    """The outcome of the job in session state ``key`` (None without one); an ended job leaves session state
    and its error is shown."""
    job = st.session_state.get(key)
    if job is None:
        return None
    res = outcome(cat, job)
    if not res["pending"]:
        st.session_state.pop(key)
        if res["error"]:
            st.error(res["error"])
    return res


def launch_form(cat):
    example = views.example_search_yaml(cat)
    if example is None:
        st.info("Nothing to search yet: register a base and its experts on the **Models** page and analyze them.")
        return
    st.caption(f"Objective files are read from the working folder `{work}` ({views.OBJECTIVE_HELP}); "
               "the models must be registered already.")
    st.session_state.setdefault(YAML, example)
    text = st.text_area("Search YAML (a mergekit config with ranges and choices, and a `search:` block)",
                        value=st.session_state[YAML], key="search_yaml", height=340, on_change=keep_yaml)
    valid = True
    try:
        what = views.check_search_yaml(cat, text, work, ui.roots())
    except MergePipeError as exc:
        st.error(f"Not valid: {exc}", icon=":material/error:")
        valid = False
    else:
        st.success(f"Valid: {what}.")
    st.button("Launch search", type="primary", key="search_launch", on_click=do_launch, disabled=not valid)
    launched = settle(cat, LAUNCH, views.launch_outcome)
    if launched and launched["search"]:
        st.session_state["search"] = launched["search"]  # the selector below shows it
    elif launched and launched["pending"]:
        job = st.session_state[LAUNCH]
        wait_for(LAUNCH, views.launch_outcome,
                 f"Starting the search of `{job['file']}` (process {job['pid']}): checking its recipes...")


def search_view(search_id: str, running: bool):
    @st.fragment(run_every=1.0 if running else None)
    def watch():
        ui.reap()
        with ui.user_errors(), ui.catalog() as c:
            shown = api.search_show(c, search_id)
            state = views.search_status(c, shown, ui.db())
            st.progress(state["fraction"], text=f"{search_id}: {state['text']}")
            ui.table(views.search_trials_df(shown), hide_index=True, width="stretch", key="search_trials",
                     column_config={"expert read (MiB)": st.column_config.NumberColumn(format="%.3f"),
                                    "seconds": st.column_config.NumberColumn(format="%.2f")})
            steps = views.search_steps_df(shown)
            if not steps.empty:
                st.caption("Every step of every trial: its score against the expert bytes it read, by fidelity.")
                st.plotly_chart(views.search_score_figure(steps, shown["settings"]["fidelities"]), width="stretch",
                                key="search_scores")
        if running and not state["running"]:
            st.rerun(scope="app")  # ended: the importance, the best recipe and Publish

    watch()


def importance(cat, shown: dict):
    st.subheader("Parameter importance")
    st.caption("Optuna's importance evaluator (fANOVA) over the complete trials: how much of the score's "
               "variation each searched parameter explains.")
    with ui.user_errors():
        importances = api.search_parameter_importance(cat, shown["id"])
        note = views.importance_note(shown, importances)
        if note:
            st.info(note)
        else:
            st.plotly_chart(views.importance_figure(importances), width="stretch", key="search_importance")


def best(cat, shown: dict):
    st.subheader("Best recipe")
    recipe = views.best_recipe(shown)
    if recipe is None:
        st.info("The best recipe appears when the search has finished with a complete trial.")
        return
    st.caption(recipe["text"])
    st.code(recipe["yaml"], language="yaml")
    out = views.search_publish_dir(ui.db())
    publishing = settle(cat, PUBLISH, views.publish_outcome) or {}
    snapshot = publishing.get("snapshot") or views.published_snapshot(shown)
    c1, c2 = st.columns(2)
    c1.download_button("Download the best recipe (mergekit YAML)", recipe["yaml"], file_name=recipe["file_name"],
                       mime="application/x-yaml", key="search_download")
    c2.button("Publish the best", key="search_publish", on_click=do_publish, args=(shown["id"],),
              disabled=snapshot is not None or PUBLISH in st.session_state,
              help=f"An ordinary merge of the best recipe (its own process), published under {out}")
    if PUBLISH in st.session_state:
        job = st.session_state[PUBLISH]
        wait_for(PUBLISH, views.publish_outcome,
                 f"Publishing the best recipe of {job['search']} (process {job['pid']}): merging...")
    elif snapshot:
        st.success(f"Published trial {recipe['trial']} as snapshot {snapshot}")
        st.page_link("pages/snapshots.py", label=f"Open snapshot {snapshot}", query_params={"snapshot": snapshot},
                     icon=":material/description:")
    else:
        st.caption(f"Publishes under `{out}`.")


ui.reap()
ui.show_flash()
work = views.search_work_dir(ui.db())
with ui.user_errors(), ui.catalog() as cat:
    st.subheader("Launch")
    launch_form(cat)
    labels = views.search_labels(cat)
    st.subheader("Searches")
    if not labels:
        st.info("No searches yet: launch one above, or run `mergepipe search SPACE.yml`.")
        st.stop()
    if st.session_state.get("search") not in labels and st.query_params.get("search") not in labels:
        st.session_state["search"] = next(iter(labels))
    search_id = st.selectbox("Search", list(labels), key="search", bind="query-params", format_func=labels.get)
    shown = api.search_show(cat, search_id)
    running = views.search_status(cat, shown, ui.db())["running"]
    search_view(search_id, running)
    if not running:
        importance(cat, shown)
        best(cat, shown)
