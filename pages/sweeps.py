"""Sweeps: the recorded merge sweeps (`mergepipe sweep --config ...`), each point's outcome, and the
frontier of quality vs expert bytes read vs time (marker size)."""

import streamlit as st

from mergepipe.dashboard import sweeps as data
from pages import _nav, _ui as ui

_nav.through_app()

st.title("Sweeps")

with ui.user_errors(), ui.catalog() as cat:
    table = data.sweeps_df(cat)
    if table.empty:
        st.info("No sweeps yet: run `mergepipe sweep --config sweep.yml` (see the README's Ray section).")
        st.stop()
    sweep_id = st.selectbox("Sweep", list(table["id"]), key="sweep_id",
                            format_func=lambda i: f"{i} ({table.set_index('id').loc[i, 'name']})")
    ui.table(table, hide_index=True, width="stretch")
    points = data.points_df(cat, sweep_id)
    st.subheader("Frontier")
    st.caption("Quality (lower is better: perplexity, or the error bound when the sweep was not evaluated) "
               "against the expert bytes read; marker size: merge time. Dotted: the frontier.")
    st.plotly_chart(data.frontier_figure(points), width="stretch")
    st.subheader("Points")
    ui.table(points.drop(columns=["expert_read"]), hide_index=True, width="stretch")
