"""MergePipe dashboard: `mergepipe dashboard` (or `streamlit run app.py`) with MERGEPIPE_DB set.

Pages only render; everything they show is computed by mergepipe.dashboard.views."""

from pathlib import Path

import streamlit as st

# A local image: a ":material/...:" page icon makes the browser fetch it from fonts.gstatic.com.
ICON = Path(__file__).resolve().parent / "assets" / "favicon.png"
st.set_page_config(page_title="MergePipe", page_icon=str(ICON), layout="wide")

PAGES = [
    st.Page("pages/home.py", title="Home", icon=":material/home:", default=True),
    st.Page("pages/models.py", title="Models", icon=":material/inventory_2:", url_path="models"),
    st.Page("pages/catalog.py", title="Catalog", icon=":material/grid_on:", url_path="catalog"),
    st.Page("pages/plan.py", title="Plan", icon=":material/tune:", url_path="plan"),
    st.Page("pages/run.py", title="Run", icon=":material/play_circle:", url_path="run"),
    st.Page("pages/snapshots.py", title="Snapshots", icon=":material/photo_library:", url_path="snapshots"),
    st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("pages/lineage.py", title="Lineage", icon=":material/account_tree:", url_path="lineage"),
    st.Page("pages/sweeps.py", title="Sweeps", icon=":material/scatter_plot:", url_path="sweeps"),
]

page = st.navigation(PAGES)
from mergepipe.dashboard import views  # noqa: E402  (after set_page_config: importing torch takes a moment)

st.sidebar.caption(f"Catalog: `{views.db_path()}`")
page.run()
