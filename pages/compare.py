"""Compare: two snapshots or plans side by side -- settings diff, bytes, bound, quality scores, per-tensor
access difference, lineage -- from their manifests and plans."""

import streamlit as st

from mergepipe.dashboard import views
from mergepipe.api import launch_evaluate
from pages import _nav, _ui as ui

_nav.through_app()

st.title("Compare")


def do_measure(model_a: str, model_b: str):
    def fn(cat):
        return launch_evaluate(ui.db(), cat, [model_a], None, views.log_dir(ui.db()), reference=model_b)

    res = ui.action(ui.with_catalog, fn)
    if res:
        run_id, proc = res
        ui.keep_process(run_id, proc)
        st.session_state["measure_watch"] = run_id
        ui.flash("info", f"evaluate run {run_id} started: ||{model_a} - {model_b}||")


ui.reap()
ui.show_flash()

with ui.user_errors(), ui.catalog() as cat:
    ids, captions = views.choices(cat)
    if len(ids) < 2:
        st.info("Compare needs two snapshots or saved plans: save a plan on the **Plan** page or launch a merge "
                "on the **Run** page.")
        st.stop()
    for key, i in (("cmp_a", 1), ("cmp_b", 0)):  # default: the two latest (snapshots first), older one as A
        if st.session_state.get(key) not in ids and st.query_params.get(key) not in ids:
            st.session_state[key] = ids[i]
    c1, c2 = st.columns(2)
    # no format_func: a selectbox bound to the URL matches the URL's value against the shown labels
    a_id = c1.selectbox("A: snapshot or plan", ids, key="cmp_a", bind="query-params")
    c1.caption(captions.get(a_id, ""))
    b_id = c2.selectbox("B: snapshot or plan", ids, key="cmp_b", bind="query-params")
    c2.caption(captions.get(b_id, ""))
    if a_id == b_id:
        st.warning("Choose two different snapshots or plans.")
        st.stop()
    a, b = views.side(cat, a_id), views.side(cat, b_id)

    st.subheader("Settings")
    only = st.toggle("Only the differences", key="cmp_only")
    ui.table(views.settings_diff(a, b, only), hide_index=True, key="cmp_settings",
             column_config={"A": st.column_config.TextColumn(width="large"),
                            "B": st.column_config.TextColumn(width="large")})
    st.subheader("Bytes and bound")
    ui.table(views.numbers_df(a, b), hide_index=True, key="cmp_numbers")
    st.subheader("Quality")
    scores = views.scores_df(cat, a, b)
    if scores.empty:
        st.caption("No stored scores: evaluate the snapshots on the **Snapshots** page (Evaluate).")
    else:
        ui.table(scores, hide_index=True, key="cmp_scores")
    if a.run["model_id"] and b.run["model_id"]:
        note = views.realized_deviation(cat, a, b)
        if note:
            st.info(note)
        st.button("Measure the realized deviation ||A - B||", key="cmp_measure", on_click=do_measure,
                  args=(a.run["model_id"], b.run["model_id"]),
                  help="Reads both checkpoints in a separate process (`mergepipe evaluate A --reference B`); the "
                       "result is stored. With B the full-budget merge of A's settings, it is the distance A's "
                       "error bound bounds.")
        last = views.latest_run(cat, "evaluate")
        running = bool(last) and views.run_progress(last)["running"]

        @st.fragment(run_every=1.0 if running else None)
        def measure_progress():
            with ui.user_errors(), ui.catalog() as c2:
                run = views.latest_run(c2, "evaluate")
                if not run or st.session_state.get("measure_watch") != run["id"]:
                    return
                p = views.run_progress(run)
                st.progress(p["fraction"], text=f"evaluate run {p['id']} {p['status']} ({p['elapsed_text']})")
                if p["status"] == "failed":
                    st.error(f"evaluate run {p['id']} failed: {p['error'] or 'the process died'}")
                if not p["running"]:
                    st.session_state.pop("measure_watch")
                    st.rerun(scope="app")

        measure_progress()
    st.subheader("Access")
    diff = views.access_diff(a, b)
    st.caption(f"{int((diff['only A'] + diff['only B'] > 0).sum())} of {len(diff)} tensors read differently; "
               f"{int(diff['only A'].sum())} expert blocks only by A, {int(diff['only B'].sum())} only by B "
               "(a plan: the blocks it would read).")
    st.plotly_chart(views.access_figure(diff), key="cmp_access")
    with st.expander("Per-tensor table"):
        ui.table(diff, hide_index=True, key="cmp_access_table",
                 column_config={"tensor": st.column_config.TextColumn(width="large")})
    st.subheader("Lineage")
    for line in views.lineage_note(a, b):
        st.write(line)
