"""Run: execute a saved plan in a separate process (the CLI), watch its progress from the catalog,
cancel it, read its log. The run lives in the catalog, so it survives a refresh or a page change."""

import streamlit as st

from mergepipe.dashboard import views
from mergepipe.api import cancel_run, get_run, launch_run, load_plan, log_tail
from pages import _nav, _ui as ui

_nav.through_app()

st.title("Run")


def do_launch():
    s = st.session_state

    def fn(cat):
        out = views.check_out_path(s.get("out", ""), ui.roots())
        model_id = (s.get("model_id") or "").strip() or out.name
        out.parent.mkdir(parents=True, exist_ok=True)
        return launch_run(ui.db(), cat, s["plan"], str(out), model_id, views.log_dir(ui.db()))

    res = ui.action(ui.with_catalog, fn)
    if res:
        run_id, proc = res
        ui.keep_process(run_id, proc)
        s["run"] = str(run_id)
        s["run_watch"] = str(run_id)
        ui.flash("info", f"run {run_id} started (process {proc.pid})")


def do_cancel(run_id: int):
    if ui.action(ui.with_catalog, cancel_run, run_id):
        st.session_state.setdefault("_cancelled", set()).add(run_id)  # shown with the run from now on


ui.reap()
ui.show_flash()
with ui.user_errors(), ui.catalog() as cat:
    plans = views.plans_df(cat)
    st.subheader("Launch")
    if plans.empty:
        st.info("No saved plans yet: make and save one on the **Plan** page.")
    else:
        plan_labels = {r.plan: f"{r.plan} · {r.operator} · {r.budget} · {r.expert_read} · {r.experts}"
                  for r in plans.itertuples()}
        # no format_func: a selectbox bound to the URL matches ?plan= against the shown labels
        plan_id = st.selectbox("Saved plan", plans["plan"].tolist(), key="plan", bind="query-params")
        st.caption(plan_labels.get(plan_id, ""))
        if st.session_state.get("_out_for") != plan_id:
            out = views.next_out(cat, ui.db(), plan_id)
            st.session_state["out"] = str(out)
            st.session_state["model_id"] = out.name
            st.session_state["_out_for"] = plan_id
        c1, c2 = st.columns([2, 1])
        c1.text_input("Output directory (must not exist)", key="out")
        c2.text_input("Model id of the merged model", key="model_id")
        st.button("Launch merge", type="primary", on_click=do_launch, key="launch")
        with st.expander("EXPLAIN the plan"):
            st.code(load_plan(cat, plan_id).explain(), language=None)

    runs = views.runs(cat, "merge", 30)
    if runs:
        st.subheader("Progress")
        # labels stay fixed for a run (a keyed selectbox keeps showing the label it first had)
        run_labels = {str(r["id"]): f"run {r['id']} · {r['model_id']} · {r['started_at']}" for r in runs}
        if st.session_state.get("run") not in run_labels and st.query_params.get("run") not in run_labels:
            st.session_state["run"] = str(runs[0]["id"])
        run_key = st.selectbox("Run", list(run_labels), key="run", bind="query-params", format_func=run_labels.get)
        active = views.run_progress(get_run(cat, int(run_key)))["running"]

        @st.fragment(run_every=1.0 if active else None)
        def watch():
            ui.show_flash()  # a Cancel click reruns only this fragment
            with ui.user_errors(), ui.catalog() as c2:
                run = get_run(c2, int(run_key))
                p = views.run_progress(run)
                if p["id"] in st.session_state.get("_cancelled", ()):
                    st.warning(f"run {p['id']}: cancel requested")
                st.progress(p["fraction"], text=f"run {p['id']}: {p['status']} · {p['text']}")
                m = st.columns(4)
                m[0].metric("Status", p["status"])
                m[1].metric("Blocks", f"{p['blocks_done']}/{p['blocks_total']}" if p["blocks_total"] else "-")
                m[2].metric("Expert bytes read", views.fmt_bytes(p["bytes_done"]),
                            help=f"planned {views.fmt_bytes(p['bytes_planned'])}")
                m[3].metric("Elapsed", p["elapsed_text"])
                st.caption(p["detail"])
                if p["running"]:
                    st.button("Cancel", on_click=do_cancel, args=(p["id"],), key="cancel")
                    st.session_state["run_watch"] = run_key
                elif p["status"] == "succeeded" and p["snapshot_id"]:
                    st.success(f"Published {p['snapshot_id']} as model {run['model_id']} at {run['out']}")
                    st.page_link("pages/snapshots.py", label=f"Open snapshot {p['snapshot_id']}",
                                 query_params={"snapshot": p["snapshot_id"]}, icon=":material/description:")
                elif p["status"] in ("failed", "cancelled"):
                    st.error(f"run {p['id']} {p['status']}: {p['error'] or 'the process died'}")
                with st.expander("Log", expanded=p["running"]):
                    st.code(log_tail(run) or "(empty)", language=None)
                if not p["running"] and st.session_state.get("run_watch") == run_key:
                    st.session_state.pop("run_watch")
                    st.rerun(scope="app")

        watch()
        st.subheader("Runs")
        ui.table(views.runs_df(cat, "merge"), hide_index=True, key="runs_table",
                 column_config={"progress": st.column_config.ProgressColumn("progress", min_value=0, max_value=100,
                                                                            format="%.0f%%")})
