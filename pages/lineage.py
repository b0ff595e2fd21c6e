"""Lineage: the DAG of models and merges; selecting a node opens its manifest or its model page."""

import streamlit as st

from mergepipe.dashboard import views
from pages import _nav, _ui as ui

_nav.through_app()

st.title("Lineage")


def pick_row():
    rows = st.session_state["lineage_table"].selection.rows
    ids = st.session_state.get("_node_ids", [])
    if rows and rows[0] < len(ids):
        st.session_state["node"] = ids[rows[0]]


with ui.user_errors(), ui.catalog() as cat:
    nodes = views.lineage_nodes_df(cat)
    if nodes.empty:
        st.info("No models registered yet.")
        st.stop()
    st.graphviz_chart(views.lineage_dot(cat))
    ids = nodes["node"].tolist()
    st.session_state["_node_ids"] = ids
    ui.table(nodes, hide_index=True, key="lineage_table", on_select=pick_row, selection_mode="single-row")
    node = st.selectbox("Node", ids, index=None, key="node", bind="query-params",
                        placeholder="choose a node (or select a table row)")
    if node:
        kind, target = views.node_target(cat, node)
        d = views.model_details(cat, node)
        ui.table(d["summary"], hide_index=True, key="node_summary")
        if kind == "snapshot":
            if st.button(f"Open the manifest of {target}", key="open_manifest", type="primary"):
                st.switch_page("pages/snapshots.py", query_params={"snapshot": target})
        else:
            if st.button(f"Open the model page of {target}", key="open_model"):
                st.switch_page("pages/models.py", query_params={"model": target})

    st.subheader("What changed since a snapshot")
    snaps = [n for n, k in zip(ids, nodes["kind"]) if k == "snapshot"]
    since = st.selectbox("Since snapshot", snaps, index=None, key="changes_since",
                         placeholder="choose a snapshot: every later merge on its base, diffed against it")
    if since:
        changes = views.changes_since(cat, since)
        if changes.empty:
            st.info(f"No snapshot was published after {since} on its base.")
        else:
            ui.table(changes, hide_index=True, key="changes_table")
