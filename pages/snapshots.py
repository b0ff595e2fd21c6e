"""Snapshots: the published merges, each one's manifest (summary and raw JSON), estimated vs realized
bytes per expert and per tensor, the touched blocks, and a verify button."""

import streamlit as st

from mergepipe.dashboard import views
from mergepipe.api import verify
from pages import _ui as ui

st.title("Snapshots")


def pick_row():
    rows = st.session_state["snap_table"].selection.rows
    ids = st.session_state.get("_snap_ids", [])
    if rows and rows[0] < len(ids):
        st.session_state["snapshot"] = ids[rows[0]]


def do_verify(snapshot_id: str):
    res = ui.action(ui.with_catalog, verify, snapshot_id)
    if res is not None:
        ui.flash("success" if res["ok"] else "error", views.verify_text(res))


ui.show_flash()
with ui.user_errors(), ui.catalog() as cat:
    df = views.snapshots_df(cat)
    if df.empty:
        st.info("No snapshots yet: launch a merge on the **Run** page.")
        st.stop()
    ids = df["snapshot"].tolist()
    st.session_state["_snap_ids"] = ids
    st.dataframe(df, hide_index=True, key="snap_table", on_select=pick_row, selection_mode="single-row")
    models = dict(zip(df["snapshot"], df["model"]))
    sid = st.selectbox("Snapshot", ids, key="snapshot", bind="query-params",
                       format_func=lambda s: f"{s} · {models.get(s, '')}")
    manifest = views.load_manifest(cat, sid)
    plan = views.manifest_plan(cat, manifest)

    left, right = st.columns([3, 2])
    with left:
        st.subheader("Manifest")
        st.dataframe(views.manifest_summary(manifest), hide_index=True, key="manifest_summary")
    with right:
        st.subheader("Verify")
        st.caption("Re-hash every output file against the manifest and the catalog.")
        st.button("Verify", on_click=do_verify, args=(sid,), key="verify")
        st.download_button("Download manifest JSON", manifest.to_json(), file_name=f"{sid}.json",
                           mime="application/json", key="download")

    c1, c2 = st.columns(2)
    c1.plotly_chart(views.bytes_figure(views.bytes_by_expert_df(manifest), "expert"), key="bytes_expert")
    c2.plotly_chart(views.bytes_figure(views.bytes_by_tensor_df(manifest, plan), "tensor"), key="bytes_tensor")
    st.plotly_chart(views.touched_heatmap(ui.touched(ui.db(), views.stats_version(cat), sid)), key="touched_chart")
    with st.expander("Raw manifest (JSON)"):
        st.json(manifest.to_dict(), expanded=2)
