"""The app's pages (app.py's st.navigation) and the guard each page calls first (not a page itself).

Streamlit runs a script of the ``pages/`` folder by itself -- with its automatic page list ("app, catalog, ...,
ui"), without app.py's wide layout and sidebar -- until app.py's ``st.navigation`` has run once in the server
process: on a freshly started server whose very first request opens a page directly (``/plan``). The guard
notices that app.py did not run before the page and draws app.py's frame (page config, navigation, sidebar
caption) -- which switches the server process to app.py's navigation for good.

In a session's first run it then reruns at once, before the page draws anything, so the page runs through app.py
like every later run: drawn in that first run, its widgets would get other ids (Streamlit hashes the running
script into them) than in every later run, so the next rerun (one budget step) would meet widgets it never saw,
each falling back to its default: the Plan page's Experts emptied ("choose at least one expert"). A first run
holds no click; the rerun keeps the URL's query string, so a shared link still sets the widgets. In a later run
(AppTest runs every page this way, with the same ids each time) the page is drawn in the same run, so a widget's
click or value of that run is kept."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

# A local image: a ":material/...:" page icon makes the browser fetch it from fonts.gstatic.com.
ICON = Path(__file__).resolve().parent.parent / "assets" / "favicon.png"

_VIA_APP = "_nav_via_app"  # set by app.py on each run, taken by the page it runs
_SEEN = "_nav_seen"  # set by the session's first run of app.py's frame


def app_pages() -> list:
    return [
        st.Page("pages/home.py", title="Home", icon=":material/home:", default=True),
        st.Page("pages/models.py", title="Models", icon=":material/inventory_2:", url_path="models"),
        st.Page("pages/catalog.py", title="Catalog", icon=":material/grid_on:", url_path="catalog"),
        st.Page("pages/plan.py", title="Plan", icon=":material/tune:", url_path="plan"),
        st.Page("pages/run.py", title="Run", icon=":material/play_circle:", url_path="run"),
        st.Page("pages/snapshots.py", title="Snapshots", icon=":material/photo_library:", url_path="snapshots"),
        st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
        st.Page("pages/lineage.py", title="Lineage", icon=":material/account_tree:", url_path="lineage"),
        st.Page("pages/sweeps.py", title="Sweeps", icon=":material/scatter_plot:", url_path="sweeps"),
        st.Page("pages/search.py", title="Search", icon=":material/travel_explore:", url_path="search"),
    ]


def frame():
    """What app.py draws around every page: the page config (wide layout), the navigation and the catalog's
    caption in the sidebar. Returns the page to run (marked as reached through app.py)."""
    st.set_page_config(page_title="MergePipe", page_icon=str(ICON), layout="wide")
    page = st.navigation(app_pages())
    st.session_state[_VIA_APP] = True
    st.session_state[_SEEN] = True
    from mergepipe.dashboard import views  # after set_page_config: importing torch takes a moment
    st.sidebar.caption(f"Catalog: `{views.db_path()}`")
    return page


def through_app() -> None:
    """First call of every page: when the page runs without app.py (see the module's text), draw app.py's frame
    around it now, and in the session's first run rerun through app.py at once; otherwise nothing."""
    if not st.session_state.pop(_VIA_APP, False):
        first = _SEEN not in st.session_state
        frame()
        st.session_state.pop(_VIA_APP, None)
        if first:
            st.rerun()  # the widgets get the ids of every later run (through app.py): they keep their values
