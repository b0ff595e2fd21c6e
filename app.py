"""MergePipe dashboard: `mergepipe dashboard` (or `streamlit run app.py`) with MERGEPIPE_DB set.

Pages only render; everything they show is computed by mergepipe.dashboard.views. The page config, the
navigation and the sidebar's catalog caption are pages/_nav.py's frame (a page opened before app.py ever ran
draws it itself)."""

from pages import _nav

_nav.frame().run()
