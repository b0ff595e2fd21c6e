"""Home: catalog totals and the last runs."""

import streamlit as st

from mergepipe.dashboard import views
from pages import _nav, _ui as ui

_nav.through_app()

st.title("MergePipe")
st.caption("Budget-aware merging: Catalog -> Plan -> Execute -> Manifest.")

with ui.user_errors(), ui.catalog() as cat:
    t = views.totals(cat)
    c = st.columns(4)
    c[0].metric("Models", t["models"])
    c[1].metric("Experts analyzed", t["experts_analyzed"])
    c[2].metric("Blocks", f"{t['blocks']:,}")
    c[3].metric("Model bytes", t["model_size"])
    c = st.columns(4)
    c[0].metric("Plans", t["plans"])
    c[1].metric("Snapshots", t["snapshots"])
    c[2].metric("Runs", t["runs"], help="Merge, analyze and evaluate runs started here, and merges made from the "
                                        "command line (the demo's too), each counted by the snapshot it published")
    if t["models"] == 0:
        st.info("The catalog is empty: register a base and its experts on the **Models** page, analyze them, "
                "then make a plan on the **Plan** page.")
    snaps = views.snapshots_df(cat).head(10)
    with st.expander("Getting started: this catalog from the command line", expanded=t["models"] == 0):
        st.code(views.getting_started(ui.db(), snaps["snapshot"].iloc[0] if len(snaps) else None,
                                      empty=t["models"] == 0), language="bash")
        st.caption("Models → register and analyze · Plan → budget and settings (also as mergekit YAML) · "
                   "Run → merge · Snapshots → manifest, model card, tags, delete.")
    st.subheader("Last runs")
    runs = views.activity_df(cat, limit=10)
    if runs.empty:
        st.caption("No runs yet.")
    else:
        if runs["run"].isna().any():
            st.caption("A merge made from the command line has no run number: its record is its snapshot.")
        ui.table(runs, hide_index=True, key="home_runs",
                 column_config={"progress": st.column_config.ProgressColumn("progress", min_value=0, max_value=100,
                                                                            format="%.0f%%")})
    st.subheader("Latest snapshots")
    if snaps.empty:
        st.caption("No snapshots yet.")
    else:
        ui.table(snaps, hide_index=True, key="home_snaps")
